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

}  // namespace quern
