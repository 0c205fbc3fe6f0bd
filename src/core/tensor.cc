#include "quern/tensor.h"

#include <algorithm>
#include <array>

namespace quern {
namespace {

struct TypeInfo {
  DataType type;
  std::string_view name;
  std::string_view config_name;
  size_t size;
};

constexpr std::array<TypeInfo, 15> kTypes = {{
    {DataType::kInvalid, "INVALID", "TYPE_INVALID", 0},
    {DataType::kBool, "BOOL", "TYPE_BOOL", 1},
    {DataType::kUint8, "UINT8", "TYPE_UINT8", 1},
    {DataType::kUint16, "UINT16", "TYPE_UINT16", 2},
    {DataType::kUint32, "UINT32", "TYPE_UINT32", 4},
    {DataType::kUint64, "UINT64", "TYPE_UINT64", 8},
    {DataType::kInt8, "INT8", "TYPE_INT8", 1},
    {DataType::kInt16, "INT16", "TYPE_INT16", 2},
    {DataType::kInt32, "INT32", "TYPE_INT32", 4},
    {DataType::kInt64, "INT64", "TYPE_INT64", 8},
    {DataType::kFp16, "FP16", "TYPE_FP16", 2},
    {DataType::kFp32, "FP32", "TYPE_FP32", 4},
    {DataType::kFp64, "FP64", "TYPE_FP64", 8},
    {DataType::kBytes, "BYTES", "TYPE_STRING", 0},
    {DataType::kBf16, "BF16", "TYPE_BF16", 2},
}};

}  // namespace

// Values outside the enum (an integer from a config file, say) read as kInvalid.
const TypeInfo& Info(DataType type) {
  const auto i = static_cast<size_t>(type);
  return i < kTypes.size() ? kTypes[i] : kTypes[0];
}

size_t DataTypeByteSize(DataType type) {
  return Info(type).size;
}

std::string_view DataTypeName(DataType type) {
  return Info(type).name;
}

std::optional<DataType> DataTypeFromName(std::string_view name) {
  for (const auto& t : kTypes) {
    if (t.type == DataType::kInvalid) continue;
    if (name == t.name || name == t.config_name) return t.type;
  }
  if (name == "STRING") return DataType::kBytes;
  return std::nullopt;
}

int64_t ElementCount(const Shape& shape) {
  int64_t n = 1;
  bool overflow = false, zero = false;
  for (int64_t d : shape) {
    if (d < 0) return -1;
    // A zero dimension makes the count 0 whatever the others are.
    zero = zero || d == 0;
    overflow = overflow || __builtin_mul_overflow(n, d, &n);
  }
  if (zero) return 0;
  return overflow ? -1 : n;
}

int64_t ByteCount(const Shape& shape, size_t bytes_per_element) {
  const int64_t n = ElementCount(shape);
  int64_t bytes = 0;
  if (n < 0 || __builtin_mul_overflow(n, static_cast<int64_t>(bytes_per_element), &bytes)) return -1;
  return bytes;
}

std::string ShapeToString(const Shape& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ",";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

Tensor Tensor::Allocate(DataType type, Shape shape, size_t byte_size) {
  Tensor t = AllocateUninitialized(type, std::move(shape), byte_size);
  if (byte_size > 0) std::memset(t.mutable_, 0, byte_size);
  return t;
}

Tensor Tensor::AllocateUninitialized(DataType type, Shape shape, size_t byte_size) {
  Tensor t;
  t.dtype_ = type;
  t.shape_ = std::move(shape);
  std::shared_ptr<std::byte[]> buf(new std::byte[byte_size == 0 ? 1 : byte_size]);
  t.mutable_ = buf.get();
  t.data_ = buf.get();
  t.byte_size_ = byte_size;
  t.owner_ = std::shared_ptr<const void>(buf, buf.get());
  return t;
}

Tensor Tensor::Borrow(DataType type, Shape shape, const void* data, size_t byte_size,
                      std::shared_ptr<const void> owner) {
  Tensor t;
  t.dtype_ = type;
  t.shape_ = std::move(shape);
  t.data_ = static_cast<const std::byte*>(data);
  t.byte_size_ = byte_size;
  t.owner_ = std::move(owner);
  return t;
}

Tensor Tensor::FromStrings(Shape shape, const std::vector<std::string>& values) {
  size_t total = 0;
  for (const auto& v : values) total += 4 + v.size();
  Tensor t = Allocate(DataType::kBytes, std::move(shape), total);
  std::byte* p = t.mutable_data();
  for (const auto& v : values) {
    uint32_t len = static_cast<uint32_t>(v.size());
    std::memcpy(p, &len, 4);  // little-endian hosts only (x86_64, aarch64)
    std::memcpy(p + 4, v.data(), v.size());
    p += 4 + v.size();
  }
  return t;
}

Result<std::vector<std::string_view>> Tensor::Strings() const {
  if (dtype_ != DataType::kBytes) {
    return Err(InvalidArgument("tensor of type " + std::string(DataTypeName(dtype_)) + " is not BYTES"));
  }
  std::vector<std::string_view> out;
  int64_t n = element_count();
  if (n < 0) return Err(InvalidArgument("BYTES tensor has an unknown or too large shape " + ShapeToString(shape_)));
  // Every element takes at least its 4-byte length: a shape claiming more
  // elements than that fails below, before anything large is reserved.
  out.reserve(std::min(static_cast<size_t>(n), byte_size_ / 4));
  size_t off = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (off + 4 > byte_size_) {
      return Err(InvalidArgument("BYTES tensor holds " + std::to_string(i) + " elements, shape " +
                                 ShapeToString(shape_) + " needs " + std::to_string(n)));
    }
    uint32_t len;
    std::memcpy(&len, data_ + off, 4);
    off += 4;
    if (len > byte_size_ - off) {
      return Err(InvalidArgument("BYTES element " + std::to_string(i) + " claims " + std::to_string(len) +
                                 " bytes but only " + std::to_string(byte_size_ - off) + " remain"));
    }
    out.emplace_back(reinterpret_cast<const char*>(data_ + off), len);
    off += len;
  }
  if (off != byte_size_) {
    return Err(InvalidArgument("BYTES tensor has " + std::to_string(byte_size_ - off) + " trailing bytes after its " +
                               std::to_string(n) + " elements"));
  }
  return out;
}

Tensor Tensor::Reshaped(Shape shape) const {
  Tensor t = *this;
  t.shape_ = std::move(shape);
  return t;
}

Tensor Tensor::View(Shape shape, size_t byte_offset, size_t byte_size) const {
  // Field by field: a copy of *this would copy the shape only to replace it.
  Tensor t;
  t.dtype_ = dtype_;
  t.shape_ = std::move(shape);
  t.owner_ = owner_;
  t.data_ = data_ + byte_offset;
  t.byte_size_ = byte_size;
  return t;
}

Status Tensor::Validate() const {
  if (dtype_ == DataType::kInvalid) return InvalidArgument("tensor has no data type");
  const int64_t n = element_count();
  if (n < 0) {
    return InvalidArgument("tensor shape " + ShapeToString(shape_) +
                           " has a negative dimension or more elements than fit in 64 bits");
  }
  if (dtype_ == DataType::kBytes) {
    auto s = Strings();
    return s ? Status::Ok() : s.error();
  }
  const int64_t want = ByteCount(shape_, DataTypeByteSize(dtype_));
  if (want < 0 || static_cast<uint64_t>(want) != byte_size_) {
    if (want < 0) {
      return InvalidArgument("tensor of shape " + ShapeToString(shape_) + " and type " +
                             std::string(DataTypeName(dtype_)) + " would need more bytes than fit in 64 bits");
    }
    return InvalidArgument("tensor of shape " + ShapeToString(shape_) + " and type " +
                           std::string(DataTypeName(dtype_)) + " needs " + std::to_string(want) + " bytes, got " +
                           std::to_string(byte_size_));
  }
  return Status::Ok();
}

}  // namespace quern
