// Fuzz target: a job's record as a result store reads it back (the JSON and
// binary values Redis holds; docs/api/jobs.md). The input is the record's
// JSON, then its binary parts, each after the separator "\n--part--\n". A
// record that reads is written again (RedisResultStore::Encode) and read
// back: the same state, error, outputs and responses, byte for byte (but
// for floating-point values JSON does not carry bit for bit: Close).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "fuzz_util.h"
#include "store/redis_store.h"

namespace {

constexpr std::string_view kSeparator = "\n--part--\n";

// Whether element `i` of two floating-point tensors is the same number as
// far as JSON carries it: NaN in both (JSON keeps a NaN, not its payload
// bits), or FP32 / FP64 values a few units in the last place apart (the
// JSON reader parses decimals in rapidjson's normal precision, not its full
// one: a long decimal in a record may read back that far from the shortest
// form the writer gives the same value).
// Element `i` of x and y as F (float or double), compared as Close says.
template <typename F, typename I>
bool CloseAs(const quern::Tensor& x, const quern::Tensor& y, size_t i) {
  constexpr I kUlps = 4;
  F a, b;
  I ia, ib;
  std::memcpy(&a, x.data() + sizeof(F) * i, sizeof(F));
  std::memcpy(&b, y.data() + sizeof(F) * i, sizeof(F));
  std::memcpy(&ia, &a, sizeof(F));
  std::memcpy(&ib, &b, sizeof(F));
  return (std::isnan(a) && std::isnan(b)) || ((ia < 0) == (ib < 0) && (ia > ib ? ia - ib : ib - ia) <= kUlps);
}

bool Close(const quern::Tensor& x, const quern::Tensor& y, size_t i) {
  switch (x.dtype()) {
    case quern::DataType::kFp32: return CloseAs<float, int32_t>(x, y, i);
    case quern::DataType::kFp64: return CloseAs<double, int64_t>(x, y, i);
    case quern::DataType::kFp16:
    case quern::DataType::kBf16: {
      uint16_t a, b;
      std::memcpy(&a, x.data() + 2 * i, 2);
      std::memcpy(&b, y.data() + 2 * i, 2);
      const uint16_t exp = x.dtype() == quern::DataType::kFp16 ? 0x7c00 : 0x7f80;
      auto nan = [exp](uint16_t v) { return (v & exp) == exp && (v & static_cast<uint16_t>(~exp & 0x7fff)) != 0; };
      return nan(a) && nan(b);
    }
    default: return false;
  }
}

bool SameTensors(const std::vector<quern::NamedTensor>& a, const std::vector<quern::NamedTensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    const quern::Tensor& x = a[i].tensor;
    const quern::Tensor& y = b[i].tensor;
    if (a[i].name != b[i].name || x.dtype() != y.dtype() || x.shape() != y.shape() || x.byte_size() != y.byte_size()) {
      return false;
    }
    if (x.byte_size() == 0 || std::memcmp(x.data(), y.data(), x.byte_size()) == 0) continue;
    const size_t element = quern::DataTypeByteSize(x.dtype());
    if (x.dtype() == quern::DataType::kBytes || element == 0) return false;
    for (size_t k = 0; k < x.byte_size() / element; ++k) {
      if (std::memcmp(x.data() + k * element, y.data() + k * element, element) != 0 && !Close(x, y, k)) {
        return false;
      }
    }
  }
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view in = quern::fuzz::AsView(data, size);
  std::vector<std::string> parts;
  size_t at = 0;
  for (;;) {
    const size_t next = in.find(kSeparator, at);
    parts.emplace_back(in.substr(at, next == std::string_view::npos ? std::string_view::npos : next - at));
    if (next == std::string_view::npos) break;
    at = next + kSeparator.size();
  }
  const std::string json = std::move(parts.front());
  parts.erase(parts.begin());
  auto record = quern::RedisResultStore::Decode(json, parts);
  if (!record) return 0;
  const quern::JobRecord& rec = **record;
  for (const auto& o : rec.outputs) quern::fuzz::TouchTensor(o.tensor);
  for (const auto& r : rec.responses) {
    for (const auto& o : r) quern::fuzz::TouchTensor(o.tensor);
  }
  quern::RedisResultStoreOptions options;
  options.inline_max_bytes = 64;
  auto encoded = quern::RedisResultStore::Encode(rec, options);
  if (!encoded) return 0;  // (an output a record read back cannot be written: refused, not a crash)
  std::vector<std::string> binary;
  for (const auto& [key, bytes] : encoded->binary) binary.emplace_back(bytes);
  auto again = quern::RedisResultStore::Decode(encoded->json, binary);
  if (!again) quern::fuzz::Fail("a record written again does not read back", again.error().message());
  const quern::JobRecord& back = **again;
  if (back.state != rec.state || back.decoupled != rec.decoupled || back.error.code() != rec.error.code() ||
      back.error.message() != rec.error.message()) {
    quern::fuzz::Fail("a record read back changed its state or error");
  }
  if (!SameTensors(back.outputs, rec.outputs) || back.responses.size() != rec.responses.size()) {
    quern::fuzz::Fail("a record read back changed its outputs");
  }
  for (size_t k = 0; k < rec.responses.size(); ++k) {
    if (!SameTensors(back.responses[k], rec.responses[k])) quern::fuzz::Fail("a record read back changed a response");
  }
  return 0;
}
