#include "engine/request_validation.h"

#include "engine/batch_assembly.h"

namespace quern {
namespace {

uint64_t Mix(uint64_t h, uint64_t v) {
  h ^= v + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
  return h;
}

}  // namespace

Status ValidateRequest(const ModelConfig& config, const InferRequest& r, int64_t& items, uint64_t& key,
                       OutputIndices& output_indices) {
  // Messages are built only for a request that fails (no allocation per
  // request that passes).
  const auto m = [&config] { return "model '" + config.name + "'"; };
  const bool batched = config.max_batch_size > 0;
  items = -1;
  key = 0;
  if (config.decoupled && !r.on_response) {
    return InvalidArgument(m() +
                           " is decoupled (it answers a request with any number of responses), and this call "
                           "takes one answer: use gRPC ModelStreamInfer, HTTP POST /v2/models/" +
                           config.name + "/generate_stream, or exec(decoupled=True) from a Python model");
  }
  for (const auto& in : r.inputs) {
    if (!config.FindInput(in.name)) {
      std::string names;
      for (const auto& t : config.inputs) names += (names.empty() ? "" : ", ") + t.name;
      return InvalidArgument(m() + " has no input '" + in.name + "' (inputs: " + names + ")");
    }
  }
  for (size_t i = 0; i < config.inputs.size(); ++i) {
    const TensorConfig& tc = config.inputs[i];
    const NamedTensor* nt = FindTensor(r.inputs, tc.name);
    if (!nt) {
      if (tc.optional) {
        key = Mix(key, 0xabcdef + i);
        continue;
      }
      return InvalidArgument(m() + ": input '" + tc.name + "' is missing from the request");
    }
    const Tensor& t = nt->tensor;
    const auto where = [&m, &tc] { return m() + " input '" + tc.name + "'"; };
    if (t.dtype() != tc.dtype) {
      return InvalidArgument(where() + ": expected data type " + std::string(DataTypeName(tc.dtype)) + ", got " +
                             std::string(DataTypeName(t.dtype())));
    }
    const Shape& s = t.shape();
    const size_t want_rank = tc.dims.size() + (batched ? 1 : 0);
    bool shape_ok = s.size() == want_rank;
    for (size_t d = 0; shape_ok && d < tc.dims.size(); ++d) {
      const int64_t got = s[d + (batched ? 1 : 0)];
      shape_ok = got >= 0 && (tc.dims[d] == -1 || tc.dims[d] == got);
    }
    if (shape_ok && batched) shape_ok = s[0] >= 1;
    if (!shape_ok) {
      Shape expected = tc.dims;
      if (batched) expected.insert(expected.begin(), -1);
      return InvalidArgument(where() + ": expected shape " + ShapeToString(expected) + ", got " + ShapeToString(s) +
                             (batched ? " (the first dimension is the batch)" : ""));
    }
    if (batched) {
      if (items >= 0 && s[0] != items) {
        return InvalidArgument(where() + ": batch dimension " + std::to_string(s[0]) +
                               " differs from the other inputs' " + std::to_string(items));
      }
      items = s[0];
      if (items > config.max_batch_size) {
        return InvalidArgument(where() + ": batch of " + std::to_string(items) + " exceeds max_batch_size " +
                               std::to_string(config.max_batch_size));
      }
    }
    Status v = t.Validate();
    if (!v.ok()) return InvalidArgument(where() + ": " + v.message());
    key = Mix(key, i + 1);
    for (size_t d = batched ? 1 : 0; d < s.size(); ++d) key = Mix(key, static_cast<uint64_t>(s[d]));
  }
  if (!batched) items = 1;
  if (items < 1) return InvalidArgument(m() + ": the request has no inputs");
  output_indices.clear();
  if (r.requested_outputs.empty()) {
    for (size_t i = 0; i < config.outputs.size(); ++i) output_indices.push_back(static_cast<int>(i));
  } else {
    for (const auto& name : r.requested_outputs) {
      int found = -1;
      for (size_t i = 0; i < config.outputs.size(); ++i) {
        if (config.outputs[i].name == name) found = static_cast<int>(i);
      }
      if (found < 0) return InvalidArgument(m() + " has no output '" + name + "'");
      output_indices.push_back(found);
    }
  }
  return Status::Ok();
}

}  // namespace quern
