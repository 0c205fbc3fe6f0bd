// Fuzz target: what a Redis stream consumer and the Redis result store read
// from Redis.
//
// The stream consumer's own decoding: the XREADGROUP reply
// (ParseRedisReply), each entry (ParseStreamEntry) and the job it asks for
// (DecodeStreamJob: the KServe body with its header_length field, the
// deadline). The second half decodes a results:{id} record (RedisResultStore::Decode),
// then encodes it again and decodes that.
//
// Input: byte 0 chooses
//   0: an XREADGROUP reply in RESP: [[stream, [[entry-id, [field, value, ...]], ...]], ...]
//   1: one entry as NUL-separated field, value, field, value, ... (the
//      fields without RESP framing, so that mutations keep their shape)
//   2, 3: a results record: its JSON, then NUL-separated binary values.
// Inputs run on a small stack (fuzz_util.h): deep nesting overflows early.

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "frontends/jobs/stream_consumer.h"
#include "fuzz_util.h"
#include "store/redis_client.h"
#include "store/redis_store.h"

namespace {

// The consumer's own decoding, up to the engine.
void DecodeEntry(const quern::StreamEntry& e) {
  auto job = quern::DecodeStreamJob(e, "m", "quern:jobs:m");
  if (!job) return;
  for (const auto& in : job->infer.request.inputs) quern::fuzz::TouchTensor(in.tensor);
}

std::vector<std::string_view> SplitNul(std::string_view s) {
  std::vector<std::string_view> out;
  size_t start = 0;
  while (true) {
    const size_t z = s.find('\0', start);
    out.push_back(s.substr(start, z == std::string_view::npos ? std::string_view::npos : z - start));
    if (z == std::string_view::npos) return out;
    start = z + 1;
  }
}

void DecodeRecord(std::string_view in) {
  auto parts = SplitNul(in);
  const std::string_view json = parts.front();
  std::vector<std::string> binary(parts.begin() + 1, parts.end());
  auto record = quern::RedisResultStore::Decode(json, binary);
  if (!record) return;
  for (const auto& o : (*record)->outputs) {
    quern::fuzz::TouchTensor(o.tensor);
    if (!o.tensor.Validate().ok()) quern::fuzz::Fail("a decoded record holds an output that does not match its shape");
  }
  quern::RedisResultStoreOptions options;
  options.inline_max_bytes = 16;  // some outputs inline, some in binary keys
  auto encoded = quern::RedisResultStore::Encode(**record, options);
  if (!encoded) return;
  quern::fuzz::CheckJson(encoded->json, "an encoded results record is not JSON");
  std::vector<std::string> bin;
  for (auto& [key, bytes] : encoded->binary) bin.push_back(std::move(bytes));
  auto again = quern::RedisResultStore::Decode(encoded->json, bin);
  if (!again) quern::fuzz::Fail("an encoded results record does not decode", again.error().message());
  if ((*again)->state != (*record)->state || (*again)->outputs.size() != (*record)->outputs.size()) {
    quern::fuzz::Fail("a results record changed in an encode/decode round trip");
  }
}

void FuzzOne(const uint8_t* data, size_t size) {
  const std::string_view in = quern::fuzz::AsView(data + 1, size - 1);
  switch (data[0] & 3) {
    case 0: {
      size_t consumed = 0;
      auto reply = quern::ParseRedisReply(in, consumed);
      if (!reply || !*reply || !(*reply)->is_array()) return;
      for (auto& stream : (*reply)->elements) {
        if (!stream.is_array() || stream.elements.size() != 2) continue;
        for (auto& e : stream.elements[1].elements) {
          quern::StreamEntry entry;
          if (quern::ParseStreamEntry(e, entry)) DecodeEntry(entry);
        }
      }
      return;
    }
    case 1: {
      auto parts = SplitNul(in);
      quern::StreamEntry entry;
      entry.entry_id = "1700000000000-0";
      for (size_t i = 0; i + 1 < parts.size(); i += 2) entry.fields.emplace_back(parts[i], parts[i + 1]);
      DecodeEntry(entry);
      return;
    }
    default: DecodeRecord(in); return;
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size >= 1) quern::fuzz::SmallStack::Run([&] { FuzzOne(data, size); });
  return 0;
}
