// How the engine turns a repository model's files into loaded instances,
// without knowing any runtime: each backend (ONNX Runtime today) registers a
// Backend under its configuration name ("backend" in config.pbtxt), and the
// engine asks the registry for the one a model names.
//
// Thread safety: a registry is filled before the engine starts and only read
// afterwards; a Backend's methods may be called from any thread.
#pragma once

#include <filesystem>
#include <map>
#include <memory>
#include <string>

#include "quern/model.h"
#include "quern/status.h"

namespace quern {

class Backend {
 public:
  virtual ~Backend() = default;

  // Creates and loads the first instance of a model from `file`, and fills
  // in what `config` leaves out (inputs, outputs, batch size) from what the
  // file declares. `cores` is what the engine may use; `has_config_file`
  // says whether the configuration was written by a person (checked more
  // strictly against the file) or derived.
  virtual Result<std::unique_ptr<Model>> LoadFirst(ModelConfig& config, const std::filesystem::path& file,
                                                   bool has_config_file, int cores) = 0;

  // Creates and loads one more instance of a model whose configuration
  // LoadFirst completed.
  virtual Result<std::unique_ptr<Model>> LoadAnother(const ModelConfig& config, const std::filesystem::path& file,
                                                     int cores) = 0;

  // Creates an instance that runs one batch on all `cores` (the wide
  // instance of an automatic layout, see DynamicBatcher), or null when this
  // backend's instances cannot use more cores for one batch.
  virtual Result<std::unique_ptr<Model>> LoadWide(const ModelConfig& /*config*/, const std::filesystem::path& /*file*/,
                                                  int /*cores*/) {
    return std::unique_ptr<Model>();
  }
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

 private:
  std::map<std::string, std::shared_ptr<Backend>> backends_;
};

// Registers every backend this build has (defined by the backends library).
void RegisterBuiltinBackends(BackendRegistry& registry);

}  // namespace quern
