// What the ONNX Runtime backend's files share; not part of its interface.
#pragma once

#include <onnxruntime_cxx_api.h>

#include "backends/onnxruntime/ort_model.h"
#include "quern/tensor.h"

namespace quern {

class BlockCache;

// The process's one environment, with one CPU allocator that sessions created
// with session.use_env_allocators allocate from: its large blocks come from
// OrtRunMemory(), kept between runs and returned once idle.
Ort::Env& OrtEnv();
BlockCache& OrtRunMemory();

// Element types; kInvalid / UNDEFINED where the other side has no match.
DataType FromOrt(ONNXTensorElementDataType type);
ONNXTensorElementDataType ToOrt(DataType type);

// ModelConfig::graph_optimization_level (-1 off, 0 all, 1 basic, 2 extended)
// as ONNX Runtime names it.
GraphOptimizationLevel OrtOptimizationLevel(int level);

// The inputs and outputs a session's model declares.
OnnxModelIO DescribeModel(const Ort::Session& session);

}  // namespace quern
