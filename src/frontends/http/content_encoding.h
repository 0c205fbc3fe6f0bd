// Request bodies sent with Content-Encoding: gzip or deflate (tritonclient's
// request_compression_algorithm), decoded before any handler sees them.
// Thread-compatible: free functions.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include "quern/status.h"

namespace quern {

// A decoded body of up to kInflateFloorBytes is always let through; beyond
// it, at most kMaxInflateRatio times the encoded body's size (JSON and
// tensors compress a few times; a bomb, a thousand).
inline constexpr size_t kInflateFloorBytes = size_t{1} << 20;
inline constexpr size_t kMaxInflateRatio = 100;

// Decodes `body` sent with Content-Encoding `encoding` (case-insensitive;
// "gzip", "x-gzip", "deflate" (zlib or raw), "identity" or empty). The
// decoded body may hold at most `max_bytes` bytes, and at most
// max(kInflateFloorBytes, kMaxInflateRatio x the body's size): a body that
// inflates beyond is refused as soon as it does (RESOURCE_EXHAUSTED), so a
// small compressed body can take neither memory beyond the request limit
// nor much time. Corrupt data: INVALID_ARGUMENT; another encoding:
// UNIMPLEMENTED. CPU-bound for up to max_bytes of output: callers keep it
// off threads that serve other clients.
Result<std::string> DecodeContentEncoding(std::string_view encoding, std::string body, size_t max_bytes);

}  // namespace quern
