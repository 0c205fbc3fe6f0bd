// Request validation: whether a request fits its model's configuration
// (inputs by name, type and shape, batch dimension, requested outputs),
// checked before it is queued, with errors that name the model, the tensor
// and what was expected.
#pragma once

#include <boost/container/small_vector.hpp>
#include <cstdint>

#include "quern/engine.h"
#include "quern/model.h"
#include "quern/status.h"

namespace quern {

// The outputs a request asked for, as indices into config.outputs: a model
// of up to 8 outputs needs no allocation per request.
using OutputIndices = boost::container::small_vector<int, 8>;

// INVALID_ARGUMENT when `request` does not fit `config`. Otherwise sets
// `items` (rows of the batch dimension; 1 for a model without one), `key`
// (equal for requests that may share a batch: the same inputs present with
// the same shapes past the batch dimension) and `output_indices` (the
// outputs to return, as indices into config.outputs).
Status ValidateRequest(const ModelConfig& config, const InferRequest& request, int64_t& items, uint64_t& key,
                       OutputIndices& output_indices);

}  // namespace quern
