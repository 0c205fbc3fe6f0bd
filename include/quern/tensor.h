// Tensors: a data type, a shape and a byte buffer that is either owned by the
// tensor or borrowed from someone else (a request body, a batch output) and
// kept alive by a shared owner handle. Copying a Tensor copies the handle, not
// the bytes. Thread safety: a Tensor is immutable once built and may be read
// from any number of threads.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "quern/status.h"

namespace quern {

// Element types; numbering follows Triton's model configuration DataType.
enum class DataType : uint8_t {
  kInvalid = 0,
  kBool = 1,
  kUint8 = 2,
  kUint16 = 3,
  kUint32 = 4,
  kUint64 = 5,
  kInt8 = 6,
  kInt16 = 7,
  kInt32 = 8,
  kInt64 = 9,
  kFp16 = 10,
  kFp32 = 11,
  kFp64 = 12,
  kBytes = 13,  // variable-length byte strings ("STRING" in Triton configs)
  kBf16 = 14,
};

// Size of one element in bytes; 0 for kBytes and kInvalid.
size_t DataTypeByteSize(DataType type);
// KServe v2 name: "BOOL", "UINT8", ..., "FP32", "BYTES".
std::string_view DataTypeName(DataType type);
// Accepts KServe names ("FP32") and Triton config names ("TYPE_FP32", "TYPE_STRING").
std::optional<DataType> DataTypeFromName(std::string_view name);

using Shape = std::vector<int64_t>;

// The most dimensions a tensor arriving from a client may have (ONNX Runtime
// and every real model stay far below).
inline constexpr size_t kMaxTensorRank = 64;

// Product of the dimensions; -1 when any dimension is negative (unknown) or
// when the product does not fit in int64_t (no such tensor can exist).
int64_t ElementCount(const Shape& shape);
// ElementCount(shape) * bytes_per_element, or -1 when the count is -1 or the
// product does not fit in int64_t.
int64_t ByteCount(const Shape& shape, size_t bytes_per_element);
// "[1,3,224,224]"
std::string ShapeToString(const Shape& shape);

class Tensor {
 public:
  Tensor() = default;

  // A new zero-filled buffer of `byte_size` bytes. For fixed-size types
  // byte_size must equal ElementCount(shape) * DataTypeByteSize(type).
  static Tensor Allocate(DataType type, Shape shape, size_t byte_size);
  // Like Allocate, but the bytes are left uninitialised: for buffers the
  // caller overwrites completely (batch concatenation).
  static Tensor AllocateUninitialized(DataType type, Shape shape, size_t byte_size);
  // Views `data` without copying; `owner` (may be null when the caller
  // guarantees the bytes outlive every copy of the tensor) keeps them alive.
  static Tensor Borrow(DataType type, Shape shape, const void* data, size_t byte_size,
                       std::shared_ptr<const void> owner = nullptr);

  // Convenience constructors that copy the values in.
  template <typename T>
  static Tensor From(DataType type, Shape shape, std::span<const T> values) {
    Tensor t = Allocate(type, std::move(shape), values.size_bytes());
    if (!values.empty()) std::memcpy(t.mutable_data(), values.data(), values.size_bytes());
    return t;
  }
  // A BYTES tensor; each element is serialised as a 4-byte little-endian
  // length followed by its bytes (the KServe binary layout).
  static Tensor FromStrings(Shape shape, const std::vector<std::string>& values);

  DataType dtype() const { return dtype_; }
  const Shape& shape() const { return shape_; }
  int64_t element_count() const { return ElementCount(shape_); }
  size_t byte_size() const { return byte_size_; }
  const std::byte* data() const { return data_; }
  // Only valid for tensors made by Allocate/From/FromStrings (nullptr otherwise).
  std::byte* mutable_data() const { return mutable_; }
  bool empty() const { return dtype_ == DataType::kInvalid; }

  template <typename T>
  std::span<const T> values() const {
    return {reinterpret_cast<const T*>(data_), byte_size_ / sizeof(T)};
  }

  // Splits a BYTES tensor into its elements (views into this tensor's buffer).
  Result<std::vector<std::string_view>> Strings() const;

  // Returns a tensor with the same bytes and a different shape (no copy).
  Tensor Reshaped(Shape shape) const;
  // A view of `byte_size` bytes starting at `byte_offset`, sharing this
  // tensor's owner (no copy). The caller keeps the range inside the buffer.
  Tensor View(Shape shape, size_t byte_offset, size_t byte_size) const;

  // Checks that the buffer size matches shape and type (and that a BYTES
  // buffer holds exactly element_count well-formed elements).
  Status Validate() const;

 private:
  DataType dtype_ = DataType::kInvalid;
  Shape shape_;
  std::shared_ptr<const void> owner_;
  const std::byte* data_ = nullptr;
  std::byte* mutable_ = nullptr;
  size_t byte_size_ = 0;
};

struct NamedTensor {
  std::string name;
  Tensor tensor;
};

}  // namespace quern
