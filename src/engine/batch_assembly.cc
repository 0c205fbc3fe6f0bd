#include "engine/batch_assembly.h"

#include <cstring>

namespace quern {

const NamedTensor* FindTensor(const std::vector<NamedTensor>& v, const std::string& name) {
  for (const auto& t : v) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

int64_t PaddedBatchSize(const std::vector<int>& fixed_sizes, int64_t items) {
  int64_t best = 0;
  for (int s : fixed_sizes) {
    if (s >= items && (best == 0 || s < best)) best = s;
  }
  return best > 0 ? best : items;
}

Tensor ConcatenateRows(std::span<const Tensor* const> parts, int64_t padded_rows) {
  const Tensor& first = *parts[0];
  Shape shape = first.shape();
  shape[0] = padded_rows;
  if (first.dtype() == DataType::kBytes) {
    int64_t rows = 0;
    size_t bytes = 0;
    for (const Tensor* t : parts) {
      rows += t->shape()[0];
      bytes += t->byte_size();
    }
    const int64_t per_row = rows > 0 ? first.element_count() / first.shape()[0] : 0;
    const size_t pad_elems = static_cast<size_t>((padded_rows - rows) * per_row);
    Tensor out = Tensor::AllocateUninitialized(DataType::kBytes, std::move(shape), bytes + pad_elems * 4);
    std::byte* p = out.mutable_data();
    for (const Tensor* t : parts) {
      std::memcpy(p, t->data(), t->byte_size());
      p += t->byte_size();
    }
    std::memset(p, 0, pad_elems * 4);  // padding elements: empty strings
    return out;
  }
  const size_t row_bytes = first.byte_size() / static_cast<size_t>(first.shape()[0]);
  const size_t total = row_bytes * static_cast<size_t>(padded_rows);
  Tensor out = Tensor::AllocateUninitialized(first.dtype(), std::move(shape), total);
  std::byte* p = out.mutable_data();
  for (const Tensor* t : parts) {
    std::memcpy(p, t->data(), t->byte_size());
    p += t->byte_size();
  }
  std::memset(p, 0, static_cast<size_t>(out.mutable_data() + total - p));  // padding rows are zeros
  return out;
}

Tensor CopyTensor(const Tensor& t) {
  Tensor out = Tensor::AllocateUninitialized(t.dtype(), t.shape(), t.byte_size());
  std::memcpy(out.mutable_data(), t.data(), t.byte_size());
  return out;
}

Result<Tensor> SliceRows(const Tensor& t, int64_t row, int64_t rows) {
  Shape shape = t.shape();
  const int64_t total = shape[0];
  shape[0] = rows;
  if (row == 0 && rows == total) return t;
  if (t.dtype() != DataType::kBytes) {
    const size_t row_bytes = t.byte_size() / static_cast<size_t>(total);
    return t.View(std::move(shape), row_bytes * static_cast<size_t>(row), row_bytes * static_cast<size_t>(rows));
  }
  auto strings = t.Strings();
  if (!strings) return Err(strings.error());
  const int64_t per_row = total > 0 ? static_cast<int64_t>(strings->size()) / total : 0;
  std::vector<std::string> mine;
  for (int64_t i = row * per_row; i < (row + rows) * per_row; ++i) mine.emplace_back((*strings)[i]);
  return Tensor::FromStrings(std::move(shape), mine);
}

}  // namespace quern
