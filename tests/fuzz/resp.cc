// Fuzz target: what the Redis client reads and is configured with. The input
// is read as a stream of RESP2 replies (ParseRedisReply, back to back, as a
// pipeline's answers arrive) and as a redis:// URL (ParseRedisUrl). Then its
// lines are sent through RedisPipeline's encoder and parsed back, which must
// give the same strings.
#include <cstdint>
#include <string>
#include <vector>

#include "fuzz_util.h"
#include "store/redis_client.h"

namespace {

size_t CountReplies(const quern::RedisReply& r) {
  size_t n = 1;
  for (const auto& e : r.elements) n += CountReplies(e);
  return n;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view in = quern::fuzz::AsView(data, size);

  size_t pos = 0;
  while (pos < in.size()) {
    size_t consumed = 0;
    auto r = quern::ParseRedisReply(in.substr(pos), consumed);
    if (!r || !*r) break;
    if (consumed == 0 || consumed > in.size() - pos) quern::fuzz::Fail("ParseRedisReply consumed nothing or too much");
    (void)CountReplies(**r);
    pos += consumed;
  }

  // Dropping long bulk strings as they arrive gives the same bytes whether
  // the input comes at once or in two reads, and never more than it holds.
  {
    const size_t max_bulk = 16;
    std::string whole(in);
    size_t scan = 0, skip = 0;
    (void)quern::MarkOversizeBulks(whole, scan, skip, max_bulk);
    if (whole.size() > in.size()) quern::fuzz::Fail("MarkOversizeBulks grew the buffer");
    const size_t cut = in.empty() ? 0 : static_cast<uint8_t>(in[0]) % (in.size() + 1);
    std::string parts(in.substr(0, cut));
    size_t scan2 = 0, skip2 = 0;
    (void)quern::MarkOversizeBulks(parts, scan2, skip2, max_bulk);
    parts.append(in.substr(cut));
    (void)quern::MarkOversizeBulks(parts, scan2, skip2, max_bulk);
    if (parts != whole) quern::fuzz::Fail("MarkOversizeBulks depends on how the bytes arrive");
    size_t p = 0;
    while (p < whole.size()) {
      size_t consumed = 0;
      auto r = quern::ParseRedisReply(std::string_view(whole).substr(p), consumed);
      if (!r || !*r) break;
      p += consumed;
    }
  }

  quern::RedisOptions options;
  if (quern::ParseRedisUrl(in, options).ok()) {
    if (options.port < 0 || options.port > 65535) quern::fuzz::Fail("ParseRedisUrl accepted a port out of range");
    (void)options.Address();
  }

  // Encoder round trip: one command, its arguments the input's lines.
  std::vector<std::string> args;
  size_t start = 0;
  while (start <= in.size() && args.size() < 64) {
    const size_t nl = in.find('\n', start);
    args.emplace_back(in.substr(start, nl == std::string_view::npos ? std::string_view::npos : nl - start));
    if (nl == std::string_view::npos) break;
    start = nl + 1;
  }
  // The last argument once copied, once viewed (after a command before it,
  // then appended to another): the same bytes either way.
  quern::RedisPipeline pipeline, viewing, appended;
  pipeline.Add(args);
  const std::vector<std::string_view> head(args.begin(), args.end() - 1);
  auto last = std::make_shared<const std::string>(args.back());
  viewing.Add({"PING"});
  viewing.AddViewing(head, *last, last);
  appended.Add({"PING"});
  appended.Append(viewing);
  if (appended.Joined() != "*1\r\n$4\r\nPING\r\n*1\r\n$4\r\nPING\r\n" + pipeline.Joined() || appended.size() != 3 ||
      appended.bytes() != appended.Joined().size()) {
    quern::fuzz::Fail("a viewed argument is sent differently from a copied one");
  }
  const std::string encoded = pipeline.Joined();
  size_t consumed = 0;
  auto back = quern::ParseRedisReply(encoded, consumed);
  if (!back || !*back || consumed != encoded.size()) quern::fuzz::Fail("an encoded command does not parse");
  const quern::RedisReply& cmd = **back;
  if (!cmd.is_array() || cmd.elements.size() != args.size()) quern::fuzz::Fail("an encoded command lost arguments");
  for (size_t i = 0; i < args.size(); ++i) {
    if (cmd.elements[i].type != quern::RedisReply::Type::kString || cmd.elements[i].str != args[i]) {
      quern::fuzz::Fail("an encoded argument came back different", std::to_string(i));
    }
  }
  return 0;
}
