// Where each instance of a model runs: instance_group resolved against the
// GPUs this machine has and what the model's backend can use.
//
// Triton's rules: KIND_CPU instances run on the CPU; KIND_GPU puts `count`
// instances on each device of `gpus` (every visible device when empty);
// KIND_AUTO is KIND_GPU when there is a GPU and the backend can use one
// (ONNX Runtime with its CUDA provider; Python, whose models are told their
// device), else KIND_CPU. Quern's automatic layout (no instance_group)
// becomes one instance per GPU only for a backend that runs its models
// there by itself (ONNX Runtime: a Python model keeps its per-core
// processes), else stays on the CPU.
#pragma once

#include <string>
#include <vector>

#include "quern/model.h"
#include "quern/status.h"

namespace quern {

struct GpuAvailability {
  int devices = 0;             // GPUs CUDA sees
  std::string why_no_devices;  // when devices == 0
  std::string why_no_backend;  // why the backend cannot run on them; empty = it can
  bool auto_to_gpu = false;    // the automatic layout goes to the GPUs
};

// One device per instance, in the groups' order; config.instance_groups
// becomes the groups as placed and config.instance_count their total (an
// automatic layout, instance_count 0, is left to the caller when it stays
// on the CPU: the result is then empty). Errors name the model and group.
Result<std::vector<InstanceDevice>> PlaceInstances(ModelConfig& config, const GpuAvailability& gpus);

// How many of a placed model's instances run on the CPU.
int CpuInstances(const ModelConfig& config);

}  // namespace quern
