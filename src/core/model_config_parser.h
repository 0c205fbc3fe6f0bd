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

}  // namespace quern
