// Reading JSON from untrusted bytes.
//
// Every JSON document Quern reads (HTTP bodies, job requests, stream entries,
// records read back from Redis) goes through ParseJson: RapidJSON's iterative
// parser (no recursion, so no stack to exhaust) with a bound on nesting depth,
// so that code walking the document recursively afterwards is bounded too.
// NaN, Infinity and -Infinity are read as numbers (Python's json module and
// JavaScript write them; Quern writes non-finite outputs so).
// Thread-compatible: a free function.
#pragma once

#include <rapidjson/document.h>

#include <cstddef>
#include <string>

namespace quern {

// Deeper documents are refused. Tensors nest one level per dimension; 64
// covers any real shape and every request Quern defines.
inline constexpr int kMaxJsonDepth = 64;

struct JsonParseError {
  size_t offset = 0;    // byte offset of the error
  std::string message;  // "Invalid value.", "nested deeper than 64 levels", ...
};

// Parses `size` bytes at `data` into `doc`. On failure returns false and
// fills `error`; `doc` is then null. Never reads past `size` (no terminator
// needed).
bool ParseJson(rapidjson::Document& doc, const char* data, size_t size, JsonParseError& error,
               int max_depth = kMaxJsonDepth);

}  // namespace quern
