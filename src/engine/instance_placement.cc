#include "engine/instance_placement.h"

#include <numeric>

#include "core/model_config_parser.h"

namespace quern {

Result<std::vector<InstanceDevice>> PlaceInstances(ModelConfig& config, const GpuAvailability& gpus) {
  const bool gpu_usable = gpus.devices > 0 && gpus.why_no_backend.empty();
  const bool gpu_by_default = gpu_usable && gpus.auto_to_gpu;
  std::vector<int> every_gpu(std::max(0, gpus.devices));
  std::iota(every_gpu.begin(), every_gpu.end(), 0);
  std::vector<InstanceDevice> placed;
  std::vector<InstanceGroup> groups;
  if (config.instance_groups.empty()) {
    if (config.instance_count == 0 && gpu_by_default) {
      groups.push_back({InstanceGroup::Kind::kGpu, 1, every_gpu});
    } else if (config.instance_count > 0) {
      groups.push_back({InstanceGroup::Kind::kCpu, config.instance_count, {}});
    } else {
      return placed;  // the automatic layout on the CPU
    }
  } else {
    for (size_t i = 0; i < config.instance_groups.size(); ++i) {
      InstanceGroup g = config.instance_groups[i];
      const std::string which = "model '" + config.name + "': instance_group " + std::to_string(i);
      if (g.kind == InstanceGroup::Kind::kAuto) {
        g.kind = gpu_usable ? InstanceGroup::Kind::kGpu : InstanceGroup::Kind::kCpu;
        if (g.kind == InstanceGroup::Kind::kCpu) g.gpus.clear();
      }
      if (g.kind == InstanceGroup::Kind::kGpu) {
        if (!gpus.why_no_backend.empty()) {
          return Err(FailedPrecondition(which + " asks for KIND_GPU, but backend '" + config.backend +
                                        "' cannot run on one here: " + gpus.why_no_backend));
        }
        if (gpus.devices <= 0) {
          return Err(FailedPrecondition(which + " asks for KIND_GPU, but " + gpus.why_no_devices));
        }
        if (g.gpus.empty()) g.gpus = every_gpu;
        for (int d : g.gpus) {
          if (d >= gpus.devices) {
            return Err(FailedPrecondition(which + " lists GPU " + std::to_string(d) + ", but CUDA sees " +
                                          std::to_string(gpus.devices) + " (devices 0 to " +
                                          std::to_string(gpus.devices - 1) + ")"));
          }
        }
      }
      groups.push_back(std::move(g));
    }
  }
  for (const InstanceGroup& g : groups) {
    const size_t devices = g.kind == InstanceGroup::Kind::kGpu ? g.gpus.size() : 1;
    if (placed.size() + devices * static_cast<size_t>(g.count) > static_cast<size_t>(kMaxInstances)) {
      return Err(InvalidArgument("model '" + config.name + "': instance_group places more than " +
                                 std::to_string(kMaxInstances) + " instances"));
    }
    if (g.kind == InstanceGroup::Kind::kGpu) {
      for (int d : g.gpus)
        for (int k = 0; k < g.count; ++k) placed.push_back({true, d});
    } else {
      for (int k = 0; k < g.count; ++k) placed.push_back({false, -1});
    }
  }
  config.instance_groups = std::move(groups);
  config.instance_count = static_cast<int>(placed.size());
  return placed;
}

int CpuInstances(const ModelConfig& config) {
  if (config.instance_groups.empty()) return config.instance_count;
  int n = 0;
  for (const InstanceGroup& g : config.instance_groups) {
    if (g.kind != InstanceGroup::Kind::kGpu) n += g.count;
  }
  return n;
}

}  // namespace quern
