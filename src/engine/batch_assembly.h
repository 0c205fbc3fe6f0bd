// Batch assembly: requests' rows gathered into one batch (with zero rows of
// padding up to a fixed batch size), and a batch's outputs split back into
// each request's rows.
#pragma once

#include <span>
#include <string>
#include <vector>

#include "quern/engine.h"
#include "quern/status.h"
#include "quern/tensor.h"

namespace quern {

// The tensor named `name` in `tensors`, or null.
const NamedTensor* FindTensor(const std::vector<NamedTensor>& tensors, const std::string& name);

// The smallest of `fixed_sizes` that holds `items`, or `items` when none
// does (or none is given).
int64_t PaddedBatchSize(const std::vector<int>& fixed_sizes, int64_t items);

// A copy of `t` in memory of its own (aligned for every type): a tensor of
// a model that does not batch, whose data is not aligned.
Tensor CopyTensor(const Tensor& t);

// One tensor of `padded_rows` rows from `parts` (each with the batch
// dimension first, all alike after it), in order; rows past the parts are
// zeros (empty strings for BYTES).
Tensor ConcatenateRows(std::span<const Tensor* const> parts, int64_t padded_rows);
inline Tensor ConcatenateRows(const std::vector<const Tensor*>& parts, int64_t padded_rows) {
  return ConcatenateRows(std::span<const Tensor* const>(parts), padded_rows);
}

// Rows [row, row + rows) of a batched tensor: a view (no copy) unless BYTES.
Result<Tensor> SliceRows(const Tensor& t, int64_t row, int64_t rows);

}  // namespace quern
