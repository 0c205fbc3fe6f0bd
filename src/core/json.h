// Reading JSON from untrusted bytes.
//
// Every JSON document Quern reads (HTTP bodies, job requests, stream entries,
// records read back from Redis) goes through ParseJson: RapidJSON's parser
// with a bound on nesting depth, checked before the parser recurses into an
// array or object (so its own stack is bounded) and holding for code that
// walks the document recursively afterwards.
// NaN, Infinity and -Infinity are read as numbers (Python's json module and
// JavaScript write them; Quern writes non-finite outputs so).
// Thread-compatible: a free function.
#pragma once

#include <rapidjson/document.h>

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

namespace quern {

// The length of the well-formed UTF-8 sequence at the start of `s` (no
// overlong forms, no surrogates, nothing past U+10FFFF), or 0.
size_t Utf8SequenceLength(std::string_view s);
// Whether all of `s` is well-formed UTF-8 (a JSON string can carry it as it is).
bool IsUtf8(std::string_view s);
// `s` with each byte that starts no well-formed UTF-8 sequence replaced by U+FFFD, so that a
// message quoting a client's bytes (cut anywhere) is valid JSON text.
std::string ValidUtf8(std::string_view s);

// Deeper documents are refused. Tensors nest one level per dimension; 64
// covers any real shape and every request Quern defines.
inline constexpr int kMaxJsonDepth = 64;

struct JsonParseError {
  size_t offset = 0;    // byte offset of the error
  std::string message;  // "Invalid value.", "nested deeper than 64 levels", ...
};

// A document for reading one request on a hot path: while it is the only
// one alive on its thread, its values live in a buffer the thread keeps
// (16 KiB, then the heap for more), so parsing a request's header takes
// no allocation for its values. Others (nested in one thread) use the heap.
class ScratchDocument {
 public:
  ScratchDocument();
  ~ScratchDocument();
  ScratchDocument(const ScratchDocument&) = delete;
  ScratchDocument& operator=(const ScratchDocument&) = delete;
  rapidjson::Document& doc() { return *doc_; }

 private:
  bool holds_buffer_ = false;
  std::optional<rapidjson::MemoryPoolAllocator<>> pool_;
  std::optional<rapidjson::Document> doc_;
};

// One stateless allocator for every RapidJSON stack (readers', writers'),
// so that none news an allocator object of its own: pass it to a Writer.
rapidjson::CrtAllocator* SharedCrtAllocator();

// Parses `size` bytes at `data` into `doc`. On failure returns false and
// fills `error`; `doc` is then null. Never reads past `size` (no terminator
// needed), and all `size` bytes are the text: anything after the document
// but spaces is an error, a NUL byte too.
bool ParseJson(rapidjson::Document& doc, const char* data, size_t size, JsonParseError& error,
               int max_depth = kMaxJsonDepth);

}  // namespace quern
