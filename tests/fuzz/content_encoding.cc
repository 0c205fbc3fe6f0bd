// Fuzz target: request bodies with Content-Encoding (DecodeContentEncoding:
// gzip, zlib and raw deflate, inflated under the body limit and the ratio
// bound). The input's first byte picks the encoding and the limit; the rest
// is the body as a client sent it. The decoded body never passes either
// bound, and what zlib compresses from the body decodes back to it.
#include "frontends/http/content_encoding.h"

#include <zlib.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "fuzz_util.h"

namespace {

std::string Compress(std::string_view s, int window_bits) {
  z_stream zs{};
  if (deflateInit2(&zs, 6, Z_DEFLATED, window_bits, 8, Z_DEFAULT_STRATEGY) != Z_OK) return {};
  std::string out(deflateBound(&zs, static_cast<uLong>(s.size())) + 64, '\0');
  zs.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(s.data()));
  zs.avail_in = static_cast<uInt>(s.size());
  zs.next_out = reinterpret_cast<Bytef*>(out.data());
  zs.avail_out = static_cast<uInt>(out.size());
  deflate(&zs, Z_FINISH);
  out.resize(zs.total_out);
  deflateEnd(&zs);
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  static const char* const kEncodings[] = {"gzip", "deflate", "x-gzip", "identity", "Deflate ", "br"};
  const std::string_view encoding = kEncodings[data[0] % 6];
  const size_t max_bytes = size_t{1} << (10 + (data[0] >> 4) % 12);  // 1 KiB .. 2 MiB
  const std::string body(reinterpret_cast<const char*>(data + 1), size - 1);

  auto decoded = quern::DecodeContentEncoding(encoding, body, max_bytes);
  if (decoded) {
    const size_t ratio_bound = std::max(quern::kInflateFloorBytes, body.size() * quern::kMaxInflateRatio);
    if (decoded->size() > max_bytes && encoding != "identity") quern::fuzz::Fail("inflated past the body limit");
    if (decoded->size() > ratio_bound && encoding != "identity") quern::fuzz::Fail("inflated past the ratio bound");
  }

  // Round trip: the body compressed by zlib decodes to itself (it is far
  // under both bounds: a body compresses to at least 1/1032 of its size).
  for (int bits : {15 + 16, 15, -15}) {
    const std::string packed = Compress(body, bits);
    auto back = quern::DecodeContentEncoding(bits == 15 + 16 ? "gzip" : "deflate", packed, body.size() + 1);
    if (!back || *back != body) quern::fuzz::Fail("a zlib-compressed body did not decode back to itself");
  }
  return 0;
}
