// Reading a Triton-style model repository from disk:
//
//   <repo>/<model>/config.pbtxt          optional
//   <repo>/<model>/<version>/model.onnx  one folder per integer version
//
// Only reads files; loading models is the engine's job. Thread-compatible
// (free functions over the file system).
//
// Confinement: a model name is a name, never a path (CheckModelName), and
// every file a model reads (its folder, model files, label and warm-up files)
// must resolve, symbolic links followed, to a place inside the repository
// (or, where allowed, inside the model's own folder); anything else is that
// model's load error. No function here throws: file
// system errors (permissions, symbolic link loops) become errors.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
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

// The longest model name accepted (a file name on every common file system).
inline constexpr size_t kMaxModelNameBytes = 255;

// OK when `name` can name a model: 1..255 bytes, not "." or "..", no '/',
// '\\', NUL or other control characters. INVALID_ARGUMENT otherwise, quoting
// the name with control characters escaped.
Status CheckModelName(std::string_view name);

// `path` (relative paths are taken from `base`) with symbolic links resolved,
// when it lies inside `repo`; INVALID_ARGUMENT naming `what` otherwise. The
// file need not exist.
Result<std::filesystem::path> ResolveInRepository(const std::filesystem::path& repo, const std::filesystem::path& base,
                                                  const std::filesystem::path& path, const std::string& what);

// The class labels of a model's output, one per line of `label_filename`
// (a path inside `model_dir`; a trailing "\r" is dropped). INVALID_ARGUMENT
// naming `what` when the file lies outside the folder, is not a regular file
// of at most 16 MiB, or cannot be read.
Result<std::vector<std::string>> ReadLabelFile(const std::filesystem::path& model_dir,
                                               const std::string& label_filename, const std::string& what);

// The labels of each of `config`'s outputs that names a label file (KServe's
// classification extension names the classes with them), read from
// `model_dir`; the first file that cannot be read fails, naming the model
// and the output. Outputs without a label file are not listed.
using OutputLabelSet = std::vector<std::pair<std::string, std::shared_ptr<const std::vector<std::string>>>>;
Result<OutputLabelSet> ReadOutputLabels(const ModelConfig& config, const std::filesystem::path& model_dir);
// The labels `set` holds for output `output`, or null.
std::shared_ptr<const std::vector<std::string>> FindOutputLabels(const OutputLabelSet& set, std::string_view output);

// Names of the model folders (sorted); folders whose names fail
// CheckModelName or that start with '.' are skipped. NOT_FOUND when `repo` is
// not a folder.
Result<std::vector<std::string>> ListRepositoryModels(const std::filesystem::path& repo);

// Reads one model folder. Errors name the file (and line for syntax errors);
// NOT_FOUND when the repository has no folder `name`. With
// `allow_links_outside`, a model folder may be a symbolic link to a folder
// outside the repository (the operator's choice); the model's files must
// then lie inside that folder.
Result<RepositoryModel> ReadRepositoryModel(const std::filesystem::path& repo, const std::string& name,
                                            bool allow_links_outside = false);

// A cheap change detector for a model folder (names, sizes, modification times).
std::string FingerprintModelDir(const std::filesystem::path& dir);

}  // namespace quern
