// The backends this build has, registered with the engine's registry.
#include <onnxruntime_c_api.h>

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "backends/auto_backend.h"
#include "backends/onnxruntime/ort_model.h"
#include "backends/onnxruntime/ort_shared_weights.h"
#include "backends/openvino/openvino_backend.h"
#include "backends/python/python_backend.h"
#include "backends/pytorch/pytorch_backend.h"
#include "backends/stages/ocr_stages.h"
#include "core/log.h"
#include "engine/backend.h"
#include "engine/engine_factory.h"
#include "engine/instance_placement.h"

namespace quern {
namespace {

// Whether an ONNX model gets the wide instance it is offered (every core's intra-op thread, a session
// of its own): not when the configuration sets the threads itself, nor on one core.
bool TakesWideInstance(const ModelConfig& config, int cores) {
  return !config.parameters.count("intra_op_thread_count") && cores >= 2;
}

// One ONNX model version: CPU instances on one intra-op thread each share
// one session (OrtModel::Share); otherwise its instances' sessions share
// one copy of the weights when there are two or more (SharedOnnxWeights),
// or the first instance, loaded while opening, is handed out as is.
class OrtOpenedModel final : public OpenedModel {
 public:
  OrtOpenedModel(std::filesystem::path file, int cores, std::unique_ptr<OrtModel> first,
                 std::shared_ptr<SharedOnnxWeights> weights, std::unique_ptr<OrtModel> one_session = nullptr)
      : file_(std::move(file)),
        cores_(cores),
        first_(std::move(first)),
        weights_(std::move(weights)),
        one_session_(std::move(one_session)) {}
  // The temporary files go; the instances keep the weights.
  ~OrtOpenedModel() override {
    if (weights_) weights_->RemoveFiles();
  }

  Result<std::unique_ptr<Model>> NewInstance(const ModelConfig& config, const InstanceDevice& device) override {
    if (device.gpu) {
      // A GPU session reads the file itself: the shared weights were
      // optimized for the CPU (blocked layouts only CPU kernels run).
      QUERN_ASSIGN_OR_RETURN(OrtSessionOptions options, SessionOptionsForGpu(config, device.device));
      return Load(config, options, nullptr);
    }
    if (one_session_) return std::unique_ptr<Model>(one_session_->Share());
    if (first_) return std::unique_ptr<Model>(std::move(first_));
    ModelConfig layout = config;
    layout.instance_count = CpuInstances(config);
    QUERN_ASSIGN_OR_RETURN(OrtSessionOptions options, SessionOptionsFor(layout, cores_));
    return Load(config, options, weights_);
  }

  // A session with every core's intra-op thread, unless the configuration
  // sets the threads itself.
  Result<std::unique_ptr<Model>> NewWideInstance(const ModelConfig& config) override {
    if (!TakesWideInstance(config, cores_)) return std::unique_ptr<Model>();
    ModelConfig one = config;
    one.instance_count = 1;
    QUERN_ASSIGN_OR_RETURN(OrtSessionOptions options, SessionOptionsFor(one, cores_));
    return Load(config, options, weights_);
  }

 private:
  Result<std::unique_ptr<Model>> Load(const ModelConfig& config, const OrtSessionOptions& options,
                                      std::shared_ptr<SharedOnnxWeights> weights) {
    std::vector<std::string> outputs;
    for (const auto& o : config.outputs) outputs.push_back(o.name);
    auto model = std::make_unique<OrtModel>(config.name, file_, options, std::move(outputs), std::move(weights));
    QUERN_RETURN_IF_ERROR(model->Load());
    return std::unique_ptr<Model>(std::move(model));
  }

  std::filesystem::path file_;
  int cores_;
  std::unique_ptr<OrtModel> first_;
  std::shared_ptr<SharedOnnxWeights> weights_;
  std::unique_ptr<OrtModel> one_session_;  // every CPU instance's session (not the wide one's)
};

// ONNX Runtime: threads divided between instances (SessionOptionsFor), one
// session for the CPU instances on one thread each, else one per instance,
// and a wide instance with every core's thread (a session of its own); the
// configuration completed from the ONNX file.
class OrtBackend final : public Backend {
 public:
  Result<std::unique_ptr<OpenedModel>> Open(ModelConfig& config, const std::filesystem::path& file,
                                            bool has_config_file, int cores, int instances) override {
    std::unique_ptr<OrtModel> first;
    std::shared_ptr<SharedOnnxWeights> weights;
    std::string not_shared;  // why sharing failed
    // CPU instances on one intra-op thread each share one session: their runs go beside one another
    // on their own threads as on sessions of their own, and the session holds the weights once, with
    // the forms its kernels packed them into (separate sessions keep a packed matrix beside its
    // original). Instances on several threads keep sessions of their own: runs beside one another
    // on one session share its thread pool, and were measured a third slower.
    ModelConfig layout = config;
    layout.instance_count = CpuInstances(config);
    QUERN_ASSIGN_OR_RETURN(OrtSessionOptions narrow, SessionOptionsFor(layout, cores));
    const bool one_session = layout.instance_count > 1 && narrow.intra_op_threads == 1;
    // The wide instance, a session of its own (as NewWideInstance decides).
    const bool wide_too = instances > layout.instance_count && TakesWideInstance(config, cores);
    if (one_session && !wide_too) {
      std::vector<std::string> outputs;
      for (const auto& o : config.outputs) outputs.push_back(o.name);
      auto session = std::make_unique<OrtModel>(config.name, file, narrow, std::move(outputs));
      QUERN_RETURN_IF_ERROR(session->Load());
      QUERN_RETURN_IF_ERROR(CompleteConfigFromOnnx(config, session->io(), has_config_file));
      return std::unique_ptr<OpenedModel>(
          std::make_unique<OrtOpenedModel>(file, cores, nullptr, nullptr, std::move(session)));
    }
    if (instances > 1) {
      auto shared = SharedOnnxWeights::Create(config.name, file, config.graph_optimization_level);
      if (shared) {
        weights = std::move(*shared);
      } else {
        not_shared = shared.error().message();
      }
    }
    const OnnxModelIO* io = nullptr;
    if (weights) {
      io = &weights->io();
    } else {
      // Each instance loads the file itself: a single instance, or sharing
      // failed (a model that cannot load fails here with its own error).
      // Outputs the configuration does not list are derived in the model's
      // order, which is what an instance created without a list returns.
      OrtSessionOptions options = narrow;
      if (layout.instance_count == 0) {
        // Every instance is on a GPU: this session only reads what the
        // model declares (one thread, no optimization) and is dropped.
        options.intra_op_threads = 1;
        options.graph_optimization_level = -1;
      }
      std::vector<std::string> outputs;
      for (const auto& o : config.outputs) outputs.push_back(o.name);
      first = std::make_unique<OrtModel>(config.name, file, options, std::move(outputs));
      QUERN_RETURN_IF_ERROR(first->Load());
      io = &first->io();
      if (!not_shared.empty()) {
        Log(LogLevel::kWarning, not_shared + "; each session loads its own copy of the weights",
            {{"model", config.name}});
      }
    }
    QUERN_RETURN_IF_ERROR(CompleteConfigFromOnnx(config, *io, has_config_file));
    std::unique_ptr<OrtModel> narrow_session;
    if (one_session && !weights && first) {
      narrow_session = std::move(first);  // sharing with the wide one failed: the narrow ones still share this
    } else if (one_session && weights) {  // beside the wide instance: the narrow ones' session shares its weights
      std::vector<std::string> outputs;
      for (const auto& o : config.outputs) outputs.push_back(o.name);
      narrow_session = std::make_unique<OrtModel>(config.name, file, narrow, std::move(outputs), weights);
      QUERN_RETURN_IF_ERROR(narrow_session->Load());
    }
    return std::unique_ptr<OpenedModel>(
        std::make_unique<OrtOpenedModel>(file, cores, std::move(first), std::move(weights), std::move(narrow_session)));
  }

  std::string WhyNoGpu() const override { return OrtWhyNoCuda(); }
  bool GpuByDefault() const override { return true; }
  // A session's run is bounded by its inputs and runs no code of the user's.
  bool RunsOnCallerThreads() const override { return true; }
  std::string RuntimeVersion() const override {
    return std::string("ONNX Runtime ") + OrtGetApiBase()->GetVersionString();
  }
  void ReturnIdleMemory() override { OrtReturnIdleMemory(); }
};

// Built-in stages (backend "quern", parameter quern.stage): C++ steps for
// ensembles, such as OCR's pre- and post-processing. The version folder
// holds no model file; files a stage reads lie beside config.pbtxt.
class StageOpenedModel final : public OpenedModel {
 public:
  explicit StageOpenedModel(std::function<std::unique_ptr<Model>()> factory) : factory_(std::move(factory)) {}
  Result<std::unique_ptr<Model>> NewInstance(const ModelConfig&, const InstanceDevice&) override { return factory_(); }

 private:
  std::function<std::unique_ptr<Model>()> factory_;
};

class StageBackend final : public Backend {
 public:
  Result<std::unique_ptr<OpenedModel>> Open(ModelConfig& config, const std::filesystem::path& version_dir, bool, int,
                                            int) override {
    auto it = config.parameters.find("quern.stage");
    if (it == config.parameters.end()) {
      return Err(InvalidArgument("model '" + config.name + "': backend \"quern\" needs parameter quern.stage"));
    }
    QUERN_ASSIGN_OR_RETURN(auto factory, ocr::MakeStage(it->second, config, version_dir.parent_path()));
    return std::unique_ptr<OpenedModel>(std::make_unique<StageOpenedModel>(std::move(factory)));
  }
};

}  // namespace

void RegisterBuiltinBackends(BackendRegistry& registry, const std::string& runtime_cache_dir, bool measure_runtimes) {
  registry.Register("quern", std::make_shared<StageBackend>());
  auto onnxruntime = std::make_shared<OrtBackend>();
  auto openvino = NewOpenvinoBackend();
  registry.Register("onnxruntime", onnxruntime);
  registry.Register("openvino", openvino);
  registry.Register("auto", NewAutoBackend(onnxruntime, openvino, runtime_cache_dir, measure_runtimes));
  registry.Register("python", NewPythonBackend());
  registry.Register("pytorch", NewPytorchBackend());
}

// The engine with the built-in backends: the composition every program
// that links this library gets.
Result<std::unique_ptr<Engine>> Engine::Create(EngineOptions options) {
  const std::string cache = options.runtime_cache_dir;
  const bool measure = options.measure_runtimes;
  return EngineFactory::Create(std::move(options), [cache, measure](BackendRegistry& registry) {
    RegisterBuiltinBackends(registry, cache, measure);
  });
}

}  // namespace quern
