// The backends this build has, registered with the engine's registry.
#include <memory>
#include <string>
#include <vector>

#include "backends/onnxruntime/ort_model.h"
#include "engine/backend.h"

namespace quern {
namespace {

// ONNX Runtime: one session per instance, threads divided between instances
// (SessionOptionsFor), and a wide instance with every core's thread; the
// configuration completed from the ONNX file.
class OrtBackend final : public Backend {
 public:
  Result<std::unique_ptr<Model>> LoadFirst(ModelConfig& config, const std::filesystem::path& file, bool has_config_file,
                                           int cores) override {
    // Outputs the configuration does not list are derived in the model's
    // order, which is what an instance created without a list returns.
    QUERN_ASSIGN_OR_RETURN(auto model, Load(config, file, cores));
    QUERN_RETURN_IF_ERROR(CompleteConfigFromOnnx(config, model->io(), has_config_file));
    return std::unique_ptr<Model>(std::move(model));
  }

  Result<std::unique_ptr<Model>> LoadAnother(const ModelConfig& config, const std::filesystem::path& file,
                                             int cores) override {
    QUERN_ASSIGN_OR_RETURN(auto model, Load(config, file, cores));
    return std::unique_ptr<Model>(std::move(model));
  }

  // A session with every core's intra-op thread, unless the configuration
  // sets the threads itself.
  Result<std::unique_ptr<Model>> LoadWide(const ModelConfig& config, const std::filesystem::path& file,
                                          int cores) override {
    if (config.parameters.count("intra_op_thread_count") || cores < 2) return std::unique_ptr<Model>();
    ModelConfig one = config;
    one.instance_count = 1;
    QUERN_ASSIGN_OR_RETURN(auto model, Load(one, file, cores));
    return std::unique_ptr<Model>(std::move(model));
  }

 private:
  static Result<std::unique_ptr<OrtModel>> Load(const ModelConfig& config, const std::filesystem::path& file,
                                                int cores) {
    QUERN_ASSIGN_OR_RETURN(OrtSessionOptions options, SessionOptionsFor(config, cores));
    std::vector<std::string> outputs;
    for (const auto& o : config.outputs) outputs.push_back(o.name);
    auto model = std::make_unique<OrtModel>(config.name, file, options, std::move(outputs));
    QUERN_RETURN_IF_ERROR(model->Load());
    return model;
  }
};

}  // namespace

void RegisterBuiltinBackends(BackendRegistry& registry) {
  registry.Register("onnxruntime", std::make_shared<OrtBackend>());
}

}  // namespace quern
