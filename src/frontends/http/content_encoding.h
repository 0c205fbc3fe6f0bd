// Request bodies sent with Content-Encoding: gzip or deflate (tritonclient's
// request_compression_algorithm), decoded before any handler sees them.
// Thread-compatible: free functions.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include "quern/status.h"

namespace quern {

// Decodes `body` sent with Content-Encoding `encoding` (case-insensitive;
// "gzip", "x-gzip", "deflate" (zlib or raw), "identity" or empty). The
// decoded body may hold at most `max_bytes` bytes: a body that inflates
// beyond is refused as soon as it does (RESOURCE_EXHAUSTED), so a small
// compressed body cannot take memory beyond the request limit. Corrupt data:
// INVALID_ARGUMENT; another encoding: UNIMPLEMENTED.
Result<std::string> DecodeContentEncoding(std::string_view encoding, std::string body, size_t max_bytes);

}  // namespace quern
