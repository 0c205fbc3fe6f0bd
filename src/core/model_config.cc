#include "core/model_runtime.h"
#include "quern/model.h"

namespace quern {

const TensorConfig* ModelConfig::FindInput(const std::string& n) const {
  for (const auto& t : inputs) {
    if (t.name == n) return &t;
  }
  return nullptr;
}

const TensorConfig* ModelConfig::FindOutput(const std::string& n) const {
  for (const auto& t : outputs) {
    if (t.name == n) return &t;
  }
  return nullptr;
}

std::string ModelRuntime(const ModelConfig& config) {
  std::string runtime = config.backend;
  if (auto it = config.parameters.find("INFERENCE_PRECISION_HINT");
      runtime == "openvino" && it != config.parameters.end()) {
    runtime += " " + it->second;  // OpenVINO's own choice when none is set: "openvino"
  }
  return runtime;
}

}  // namespace quern
