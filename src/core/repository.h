// Reading a Triton-style model repository from disk:
//
//   <repo>/<model>/config.pbtxt          optional
//   <repo>/<model>/<version>/model.onnx  one folder per integer version
//
// Only reads files; loading models is the engine's job. Thread-compatible
// (free functions over the file system).
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "core/model_config_parser.h"
#include "quern/model.h"
#include "quern/status.h"

namespace quern {

struct RepositoryVersion {
  int64_t version = 0;
  std::filesystem::path model_file;  // may not exist: reported when loading
};

struct RepositoryModel {
  std::string name;
  std::filesystem::path dir;
  // True when config.pbtxt exists; otherwise `config` holds only the name
  // and the backend completes it from the model file.
  bool has_config_file = false;
  ModelConfig config;
  VersionPolicy version_policy;
  std::vector<RepositoryVersion> versions;  // selected by the policy, ascending
  // Changes whenever config.pbtxt or any file under a version folder changes.
  std::string fingerprint;
};

// Names of the model folders (sorted). NOT_FOUND when `repo` is not a folder.
Result<std::vector<std::string>> ListRepositoryModels(const std::filesystem::path& repo);

// Reads one model folder. Errors name the file (and line for syntax errors).
Result<RepositoryModel> ReadRepositoryModel(const std::filesystem::path& repo, const std::string& name);

// A cheap change detector for a model folder (names, sizes, modification times).
std::string FingerprintModelDir(const std::filesystem::path& dir);

}  // namespace quern
