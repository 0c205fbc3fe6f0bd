// Reading Triton-style config.pbtxt files into quern::ModelConfig.
//
// The text is parsed with protobuf's text format against proto/model_config.proto
// (Triton's field names and numbers), then converted and validated. Every
// error names the file, and for syntax errors the line and column.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "model_config.pb.h"
#include "quern/model.h"
#include "quern/status.h"

namespace quern {

// Parameter that declares fixed batch sizes (Quern-specific; Triton ignores
// unknown parameters, so the file stays loadable there):
//   parameters { key: "quern.fixed_batch_sizes" value { string_value: "1,4,8" } }
inline constexpr std::string_view kFixedBatchSizesParam = "quern.fixed_batch_sizes";
// Turns the batch size tuner on or off ("on" / "off"):
//   parameters { key: "quern.batch_size_tuning" value { string_value: "off" } }
inline constexpr std::string_view kBatchSizeTuningParam = "quern.batch_size_tuning";
// The wide instance of an automatic layout ("on" / "off"; see
// DynamicBatcher): a lone request runs on every core.
//   parameters { key: "quern.wide_instance" value { string_value: "off" } }
inline constexpr std::string_view kWideInstanceParam = "quern.wide_instance";
// Admission by waiting time in ms (0 = no bound):
//   parameters { key: "quern.max_queue_wait_ms" value { string_value: "2000" } }
inline constexpr std::string_view kMaxQueueWaitParam = "quern.max_queue_wait_ms";
inline constexpr std::string_view kLatencyTargetParam = "quern.latency_target_ms";
// A budget for the run memory the model's batches hold at once, in MiB (0 =
// none; see DynamicBatcherOptions::memory_budget_bytes):
//   parameters { key: "quern.memory_budget_mb" value { string_value: "256" } }
inline constexpr std::string_view kMemoryBudgetParam = "quern.memory_budget_mb";

// Bounds on configured numbers, checked at load so that a typo fails that
// model's load with an error naming the file and field instead of taking
// the server's memory or threads.
inline constexpr int kMaxInstances = 256;                          // instance_group counts, summed
inline constexpr int kMaxGpus = 64;                                // instance_group gpus: device ordinals below
inline constexpr int kMaxBatchSize = 1 << 16;                      // max_batch_size
inline constexpr int64_t kMaxDim = (int64_t{1} << 31) - 1;         // one configured dimension
inline constexpr uint32_t kMaxPriorityLevels = 256;                // dynamic_batching.priority_levels
inline constexpr uint64_t kMaxQueueDelayUs = 3'600'000'000;        // max_queue_delay_microseconds: 1 hour
inline constexpr uint64_t kMaxQueueTimeoutUs = 2'592'000'000'000;  // default_timeout_microseconds: 30 days
inline constexpr uint32_t kMaxWarmupCount = 1000;                  // model_warmup count
inline constexpr size_t kMaxConfigTensors = 1024;                  // inputs or outputs
inline constexpr size_t kMaxEnsembleSteps = 256;                   // ensemble_scheduling steps
inline constexpr int64_t kMaxMemoryBudgetMb = int64_t{1} << 30;    // quern.memory_budget_mb: 1 PiB

struct VersionPolicy {
  enum class Kind { kLatest, kAll, kSpecific };
  Kind kind = Kind::kLatest;
  uint32_t num_versions = 1;
  std::vector<int64_t> versions;

  // The versions to serve out of `available`, ascending.
  std::vector<int64_t> Select(std::vector<int64_t> available) const;
};

// Syntax and schema errors: INVALID_ARGUMENT "<file>:<line>:<column>: <message>".
Result<inference::ModelConfig> ParseModelConfigText(std::string_view text, const std::string& file);

// Converts a parsed config. Errors name `source` and the field.
Result<ModelConfig> ConvertModelConfig(const inference::ModelConfig& proto, const std::string& source);
VersionPolicy ConvertVersionPolicy(const inference::ModelConfig& proto);

// Checks a complete configuration (inputs and outputs known): names, types,
// dims, batching and instance settings. Errors start with "model '<name>': ".
Status ValidateModelConfig(const ModelConfig& config);

// The configuration as config.pbtxt text (for `quern models` and the config endpoints).
inference::ModelConfig ToProto(const ModelConfig& config);

// The configuration as Triton writes it as JSON (the HTTP config endpoint, a Python model's
// args["model_config"] and auto_complete_config's): Triton's field names, every field printed,
// defaults included ("max_batch_size": 0, "input": []), and 64-bit integers (dims, shape, queue
// delays, priority levels, versions) as JSON numbers, where protobuf's own JSON writes strings.
Result<std::string> ToTritonJson(const ModelConfig& config);

// A configuration as JSON (Triton's field names; integers as numbers or strings) into the
// message; unknown fields are refused. Errors name `source`.
Result<inference::ModelConfig> ParseModelConfigJson(std::string_view json, const std::string& source);

}  // namespace quern
