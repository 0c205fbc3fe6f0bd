// How the engine turns a repository model's files into loaded instances,
// without knowing any runtime: each backend (ONNX Runtime, PyTorch, Python,
// the vision and OCR stages) registers a Backend under its configuration
// name ("backend" in config.pbtxt), and the
// engine asks the registry for the one a model names.
//
// Thread safety: a registry is filled before the engine starts and only read
// afterwards; a Backend's methods may be called from any thread.
#pragma once

#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <string>

#include "quern/engine.h"
#include "quern/model.h"
#include "quern/status.h"

namespace quern {

// One model version's files, opened once by a backend: makes the version's
// instances, which may share what opening read (an ONNX model's weights).
// Instances stay valid after the OpenedModel is destroyed.
class OpenedModel {
 public:
  virtual ~OpenedModel() = default;

  // Creates and loads one instance of the model, with the configuration
  // that Backend::Open completed, on `device` (a GPU only when the
  // backend's WhyNoGpu said it can).
  virtual Result<std::unique_ptr<Model>> NewInstance(const ModelConfig& config, const InstanceDevice& device) = 0;

  // Creates an instance that runs one batch on all the engine's cores (the
  // wide instance of an automatic layout, see DynamicBatcher), or null when
  // this backend's instances cannot use more cores for one batch.
  virtual Result<std::unique_ptr<Model>> NewWideInstance(const ModelConfig& /*config*/) {
    return std::unique_ptr<Model>();
  }
};

// What a backend's models may ask of the engine that serves them.
struct ModelServices {
  // Engine::InferAsync's contract (a refusal is returned and `done` stays with the caller; a request
  // taken is answered once, on an engine thread): a model calling another model (Python's BLS).
  std::function<Status(InferRequest&& request, InferCallback& done, const SubmitOptions& options)> submit;
  // EngineOptions::compare_answers (may be null).
  decltype(EngineOptions::compare_answers) compare_answers;
};

class Backend {
 public:
  virtual ~Backend() = default;

  // Called once by the engine, before any Open: how the models it opens reach the engine.
  virtual void SetServices(const ModelServices& /*services*/) {}

  // Opens a model version's `file` and fills in what `config` leaves out
  // (inputs, outputs, batch size) from what the file declares.
  // `has_config_file` says whether the configuration was written by a
  // person (checked more strictly against the file) or derived. `cores` is
  // what the engine may use; `instances` how many CPU instances the engine
  // will create (counting a wide one), so that a backend shares only when
  // there is something to share. config.instance_groups says where every
  // instance goes (see PlaceInstances).
  virtual Result<std::unique_ptr<OpenedModel>> Open(ModelConfig& config, const std::filesystem::path& file,
                                                    bool has_config_file, int cores, int instances) = 0;

  // Why this backend cannot run instances on this machine's GPUs, or empty
  // when it can. Asked only when CUDA sees a device.
  virtual std::string WhyNoGpu() const { return "it runs models on the CPU only"; }
  // Whether the automatic layout (no instance_group) puts its instances on
  // the GPUs (when WhyNoGpu is empty; KIND_AUTO does whenever it is).
  virtual bool GpuByDefault() const { return false; }
  // Whether a batch of its CPU instances is short and bounded by its inputs
  // (no Python process, no model code of the user's), so that a caller may
  // run it on its own thread (InferRequest::lend_thread, a lending loop):
  // the engine still lends only small inputs and batches measured short.
  virtual bool RunsOnCallerThreads() const { return false; }
  // The runtime's name and version ("ONNX Runtime 1.32.0"), or empty when
  // it has none or cannot be loaded. May load the runtime.
  virtual std::string RuntimeVersion() const { return ""; }
  // Returns to the system what the runtime keeps for later runs and no
  // model uses now (its runs' buffers), and the C library's free pages.
  // Called at a load's rare moments (a measurement closed a candidate).
  virtual void ReturnIdleMemory() {}
};

class BackendRegistry {
 public:
  // Replaces any backend registered under `name`.
  void Register(const std::string& name, std::shared_ptr<Backend> backend) { backends_[name] = std::move(backend); }
  // The backend registered under `name`, or null.
  Backend* Find(const std::string& name) const {
    auto it = backends_.find(name);
    return it == backends_.end() ? nullptr : it->second.get();
  }
  // Gives every backend the engine's services.
  void SetServices(const ModelServices& services) const {
    for (const auto& [name, backend] : backends_) backend->SetServices(services);
  }

 private:
  std::map<std::string, std::shared_ptr<Backend>> backends_;
};

// Registers every backend this build has (defined by the backends library).
// Backend "auto" keeps its choices in `runtime_cache_dir` ("" = measures at
// every load).
// With `measure_runtimes` false it opens ONNX Runtime without measuring.
void RegisterBuiltinBackends(BackendRegistry& registry, const std::string& runtime_cache_dir = "",
                             bool measure_runtimes = true);

}  // namespace quern
