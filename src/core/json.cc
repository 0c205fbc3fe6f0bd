#include "core/json.h"

#include <rapidjson/error/en.h>
#include <rapidjson/memorystream.h>
#include <rapidjson/reader.h>

#include <cstdint>
#include <memory>
#include <optional>

namespace quern {

size_t Utf8SequenceLength(std::string_view s) {
  const auto b = [&](size_t i) { return static_cast<unsigned char>(s[i]); };
  const unsigned char c = b(0);
  size_t n = 0;
  unsigned char lo = 0x80, hi = 0xBF;  // the second byte's range
  if (c >= 0xC2 && c <= 0xDF) {
    n = 2;
  } else if (c >= 0xE0 && c <= 0xEF) {
    n = 3;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    n = 4;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
  } else {
    return 0;
  }
  if (s.size() < n || b(1) < lo || b(1) > hi) return 0;
  for (size_t i = 2; i < n; ++i) {
    if (b(i) < 0x80 || b(i) > 0xBF) return 0;
  }
  return n;
}

bool IsUtf8(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    if (static_cast<unsigned char>(s[i]) < 0x80) {
      ++i;
      continue;
    }
    const size_t n = Utf8SequenceLength(s.substr(i));
    if (n == 0) return false;
    i += n;
  }
  return true;
}

std::string ValidUtf8(std::string_view s) {
  if (IsUtf8(s)) return std::string(s);
  std::string out;
  out.reserve(s.size() + 8);
  while (!s.empty()) {
    const size_t n = static_cast<unsigned char>(s[0]) < 0x80 ? 1 : Utf8SequenceLength(s);
    if (n == 0) {
      out += "\xEF\xBF\xBD";  // U+FFFD REPLACEMENT CHARACTER
      s.remove_prefix(1);
    } else {
      out.append(s.substr(0, n));
      s.remove_prefix(n);
    }
  }
  return out;
}
namespace {

// Forwards SAX events to the document and stops the parse when arrays and
// objects nest deeper than the limit.
class DepthLimit {
 public:
  DepthLimit(rapidjson::Document& doc, int max_depth) : doc_(doc), max_depth_(max_depth) {}

  bool Null() { return doc_.Null(); }
  bool Bool(bool b) { return doc_.Bool(b); }
  bool Int(int i) { return doc_.Int(i); }
  bool Uint(unsigned u) { return doc_.Uint(u); }
  bool Int64(int64_t i) { return doc_.Int64(i); }
  bool Uint64(uint64_t u) { return doc_.Uint64(u); }
  bool Double(double d) { return doc_.Double(d); }
  bool RawNumber(const char* s, rapidjson::SizeType n, bool copy) { return doc_.RawNumber(s, n, copy); }
  bool String(const char* s, rapidjson::SizeType n, bool copy) { return doc_.String(s, n, copy); }
  bool Key(const char* s, rapidjson::SizeType n, bool copy) { return doc_.Key(s, n, copy); }
  bool StartObject() { return Enter() && doc_.StartObject(); }
  bool EndObject(rapidjson::SizeType n) {
    --depth_;
    return doc_.EndObject(n);
  }
  bool StartArray() { return Enter() && doc_.StartArray(); }
  bool EndArray(rapidjson::SizeType n) {
    --depth_;
    return doc_.EndArray(n);
  }

  bool too_deep() const { return too_deep_; }

 private:
  bool Enter() {
    if (++depth_ > max_depth_) {
      too_deep_ = true;
      return false;
    }
    return true;
  }

  rapidjson::Document& doc_;
  const int max_depth_;
  int depth_ = 0;
  bool too_deep_ = false;
};

}  // namespace

namespace {
// Stateless: shared, so that no stack or pool news an allocator of its own.
rapidjson::CrtAllocator g_crt;
constexpr size_t kScratchBytes = 16 * 1024;
constexpr size_t kKeepReaderBelow = 64 * 1024;
thread_local std::unique_ptr<char[]> t_scratch;
thread_local bool t_scratch_in_use = false;
}  // namespace

rapidjson::CrtAllocator* SharedCrtAllocator() {
  return &g_crt;
}

ScratchDocument::ScratchDocument() {
  if (!t_scratch_in_use) {
    if (!t_scratch) t_scratch = std::make_unique<char[]>(kScratchBytes);
    t_scratch_in_use = holds_buffer_ = true;
    pool_.emplace(t_scratch.get(), kScratchBytes, 64 * 1024, &g_crt);
    doc_.emplace(&*pool_, 1024, &g_crt);
  } else {
    doc_.emplace();
  }
}

ScratchDocument::~ScratchDocument() {
  doc_.reset();
  pool_.reset();
  if (holds_buffer_) t_scratch_in_use = false;
}

bool ParseJson(rapidjson::Document& doc, const char* data, size_t size, JsonParseError& error, int max_depth) {
  rapidjson::ParseResult result;
  bool too_deep = false;
  auto generate = [&](rapidjson::Document& d) {
    DepthLimit handler(d, max_depth);
    rapidjson::MemoryStream ms(data, size);
    // The reader's stack (where strings are assembled) is kept by the thread
    // for texts of up to kKeepReaderBelow bytes (it grows to the longest
    // string's size, bounded by the text's): one allocation less per request.
    thread_local rapidjson::Reader kept_reader(&g_crt);
    std::optional<rapidjson::Reader> own_reader;
    rapidjson::Reader& reader = size <= kKeepReaderBelow ? kept_reader : own_reader.emplace(&g_crt);
    // NaN and Infinity as Python's json module and JavaScript write them.
    // The recursive parser (a sixth fewer instructions than the iterative
    // one on a KServe request's header): the handler stops it at an array
    // or object past max_depth before it recurses into it, so its stack is
    // bounded (a few KiB at 64 levels).
    result = reader.Parse<rapidjson::kParseNanAndInfFlag>(ms, handler);
    too_deep = handler.too_deep();
    // The stream reads a NUL byte as the text's end: bytes from one on
    // (after the document and its spaces) are refused like any others.
    if (!result.IsError() && ms.Tell() < size) {
      result.Set(rapidjson::kParseErrorDocumentRootNotSingular, ms.Tell());
    }
    return !result.IsError();
  };
  doc.Populate(generate);
  if (!result.IsError()) return true;
  doc.SetNull();
  // Refused for depth, the parser has taken the bracket: its offset is the one before.
  error.offset = too_deep && result.Offset() > 0 ? result.Offset() - 1 : result.Offset();
  error.message = too_deep ? "nested deeper than " + std::to_string(max_depth) + " levels"
                           : std::string(rapidjson::GetParseError_En(result.Code()));
  return false;
}

}  // namespace quern
