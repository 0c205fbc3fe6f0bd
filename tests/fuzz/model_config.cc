// Fuzz target: config.pbtxt, as a model repository is read: protobuf text
// format (ParseModelConfigText), conversion (ConvertModelConfig,
// ConvertVersionPolicy), validation (ValidateModelConfig), the vision
// pipeline parameters (quern.task, quern.image.*, quern.detection.*), and the
// configuration written back (ToProto) and read again.
//
// Nothing is loaded: no model file, label file or warmup file is read.
#include <cstdint>
#include <filesystem>
#include <string>

#include "core/model_config_parser.h"
#include "fuzz_util.h"
#include "pipeline/vision_model.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text = quern::fuzz::AsView(data, size);
  auto proto = quern::ParseModelConfigText(text, "config.pbtxt");
  if (!proto) return 0;
  const quern::VersionPolicy policy = quern::ConvertVersionPolicy(*proto);
  (void)policy.Select({1, 2, 3, 7, 100});
  auto config = quern::ConvertModelConfig(*proto, "config.pbtxt");
  if (!config) return 0;
  if (!quern::ValidateModelConfig(*config).ok()) return 0;

  // A valid configuration survives its own text form.
  const inference::ModelConfig written = quern::ToProto(*config);
  auto again = quern::ConvertModelConfig(written, "written");
  if (!again) quern::fuzz::Fail("ToProto wrote a configuration that does not convert", again.error().message());
  if (auto s = quern::ValidateModelConfig(*again); !s.ok()) {
    quern::fuzz::Fail("ToProto wrote a configuration that does not validate", s.message());
  }

  if (quern::IsVisionModel(*config)) {
    quern::ModelStatus status;
    status.name = config->name.empty() ? "m" : config->name;
    status.version = 1;
    status.state = quern::ModelState::kReady;
    status.config = *config;
    for (auto& o : status.config.outputs) o.label_filename.clear();  // reads no file
    (void)quern::VisionModelFromStatus(status, std::filesystem::path("/nonexistent-quern-fuzz"));
  }
  return 0;
}
