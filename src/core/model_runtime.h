// The runtime that runs a model, as metrics and the dashboard name it.
#pragma once

#include <string>

#include "quern/model.h"

namespace quern {

// Its backend and, for OpenVINO with a precision set (by the configuration
// or backend "auto"), the precision: "onnxruntime", "openvino bf16",
// "python"; "" for ensembles.
std::string ModelRuntime(const ModelConfig& config);

}  // namespace quern
