#include "frontends/http/content_encoding.h"

#include <zlib.h>

#include <algorithm>
#include <cctype>

namespace quern {
namespace {

std::string Lower(std::string_view s) {
  std::string out(s);
  for (auto& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  while (!out.empty() && (out.back() == ' ' || out.back() == '\t')) out.pop_back();
  while (!out.empty() && (out.front() == ' ' || out.front() == '\t')) out.erase(out.begin());
  return out;
}

// window_bits: 15 + 32 = zlib or gzip (detected), -15 = raw deflate.
// `by_ratio`: max_bytes is the ratio's bound, not the body limit.
Result<std::string> Inflate(const std::string& in, int window_bits, size_t max_bytes, bool by_ratio,
                            const std::string& name) {
  z_stream zs{};
  if (inflateInit2(&zs, window_bits) != Z_OK) return Err(Internal("cannot start " + name + " decoding"));
  std::string out;
  out.resize(std::min<size_t>(std::max<size_t>(in.size() * 4, 4096), max_bytes + 1));
  zs.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(in.data()));
  size_t consumed = 0;
  size_t produced = 0;
  int rc = Z_OK;
  while (rc != Z_STREAM_END) {
    if (produced == out.size()) {
      if (out.size() > max_bytes) break;
      out.resize(std::min(out.size() * 2, max_bytes + 1));
    }
    // zlib counts in uInt: feed at most 1 GiB at a time.
    const size_t in_chunk = std::min<size_t>(in.size() - consumed, 1u << 30);
    const size_t out_chunk = std::min<size_t>(out.size() - produced, 1u << 30);
    zs.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(in.data() + consumed));
    zs.avail_in = static_cast<uInt>(in_chunk);
    zs.next_out = reinterpret_cast<Bytef*>(out.data() + produced);
    zs.avail_out = static_cast<uInt>(out_chunk);
    rc = inflate(&zs, Z_NO_FLUSH);
    consumed += in_chunk - zs.avail_in;
    produced += out_chunk - zs.avail_out;
    if (rc == Z_BUF_ERROR && consumed == in.size() && zs.avail_out > 0) break;  // input ends early
    if (rc != Z_OK && rc != Z_STREAM_END && rc != Z_BUF_ERROR) break;
  }
  const std::string zmsg = zs.msg != nullptr ? zs.msg : "";
  inflateEnd(&zs);
  if (produced > max_bytes && by_ratio) {
    return Err(ResourceExhausted("the " + name + " request body inflates to more than " +
                                 std::to_string(kMaxInflateRatio) + " times its " + std::to_string(in.size()) +
                                 " bytes; send it uncompressed"));
  }
  if (produced > max_bytes) {
    return Err(ResourceExhausted("the " + name + " request body inflates beyond the limit of " +
                                 std::to_string(max_bytes) + " bytes (--http-max-body-bytes)"));
  }
  if (rc != Z_STREAM_END) {
    return Err(InvalidArgument("the request body is not valid " + name + " data" +
                               (zmsg.empty() ? std::string(" (truncated)") : " (" + zmsg + ")")));
  }
  if (consumed != in.size()) {
    return Err(InvalidArgument("the " + name + " request body has " + std::to_string(in.size() - consumed) +
                               " bytes after the end of its compressed data"));
  }
  out.resize(produced);
  return out;
}

}  // namespace

Result<std::string> DecodeContentEncoding(std::string_view encoding, std::string body, size_t max_bytes) {
  max_bytes = std::min<size_t>(max_bytes, size_t{1} << 40);  // room for the one-byte overshoot test
  const size_t ratio_bound =
      std::max(kInflateFloorBytes, std::min<size_t>(body.size(), size_t{1} << 32) * kMaxInflateRatio);
  const bool by_ratio = ratio_bound < max_bytes;
  max_bytes = std::min(max_bytes, ratio_bound);
  const std::string e = Lower(encoding);
  if (e.empty() || e == "identity") return body;
  if (e == "gzip" || e == "x-gzip") return Inflate(body, 15 + 16, max_bytes, by_ratio, "gzip");
  if (e == "deflate") {
    // HTTP's "deflate" is the zlib format; some clients send raw deflate.
    const bool zlib_header =
        body.size() >= 2 && (static_cast<unsigned char>(body[0]) & 0x0f) == 8 &&
        ((static_cast<unsigned char>(body[0]) << 8) | static_cast<unsigned char>(body[1])) % 31 == 0;
    return Inflate(body, zlib_header ? 15 : -15, max_bytes, by_ratio, "deflate");
  }
  return Err(Unimplemented("Content-Encoding '" + std::string(encoding) +
                           "' is not supported; send the body as it is, or with gzip or deflate"));
}

}  // namespace quern
