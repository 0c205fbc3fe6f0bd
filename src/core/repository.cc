#include "core/repository.h"

#include <algorithm>
#include <charconv>
#include <fstream>
#include <sstream>

namespace fs = std::filesystem;

namespace quern {
namespace {

// config.pbtxt files larger than this are refused (real ones are a few KiB).
constexpr uintmax_t kMaxConfigBytes = 4 << 20;

bool ParseVersion(const std::string& s, int64_t& out) {
  if (s.empty() || s.size() > 18) return false;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), out);
  return ec == std::errc() && p == s.data() + s.size() && out >= 0;
}

// True when `p` is `root` or lies below it (both absolute and normal).
bool IsWithin(const fs::path& root, const fs::path& p) {
  auto r = root.begin(), q = p.begin();
  for (; r != root.end(); ++r, ++q) {
    if (r->empty() && std::next(r) == root.end()) break;  // trailing separator
    if (q == p.end() || *r != *q) return false;
  }
  return true;
}

std::string Quoted(std::string_view name) {
  std::string out = "'";
  for (unsigned char c : name.substr(0, 64)) {
    if (c < 0x20 || c == 0x7f) {
      static const char* hex = "0123456789abcdef";
      out += "\\x";
      out += hex[c >> 4];
      out += hex[c & 15];
    } else {
      out += static_cast<char>(c);
    }
  }
  if (name.size() > 64) out += "...";
  return out + "'";
}

Result<RepositoryModel> ReadModel(const fs::path& repository, const std::string& name, bool allow_links_outside) {
  RepositoryModel m;
  m.name = name;
  std::error_code ec;
  const fs::path link = repository / name;
  const auto link_status = fs::symlink_status(link, ec);
  if (ec || !fs::exists(link_status)) return Err(NotFound("unknown model '" + name + "': not in the repository"));
  // `repo` below: the folder every file of this model must stay inside.
  fs::path repo = repository;
  if (allow_links_outside && fs::is_symlink(link_status)) {
    repo = fs::weakly_canonical(fs::absolute(link, ec), ec);
    if (ec) return Err(InvalidArgument("model '" + name + "' folder cannot be resolved: " + ec.message()));
  }
  QUERN_ASSIGN_OR_RETURN(m.dir, ResolveInRepository(repo, repository, name, "model '" + name + "' folder"));
  if (!fs::is_directory(m.dir, ec)) {
    return Err(NotFound("model '" + name + "' is not a folder in the repository" +
                        (ec ? " (" + ec.message() + ")" : std::string())));
  }
  m.fingerprint = FingerprintModelDir(m.dir);

  const fs::path config_file = m.dir / "config.pbtxt";
  const auto config_status = fs::status(config_file, ec);
  if (ec && ec != std::errc::no_such_file_or_directory) {
    return Err(Unavailable("model '" + name + "': cannot read config.pbtxt: " + ec.message()));
  }
  if (fs::exists(config_status)) {
    QUERN_ASSIGN_OR_RETURN(fs::path resolved,
                           ResolveInRepository(repo, m.dir, "config.pbtxt", "model '" + name + "' config.pbtxt"));
    if (!fs::is_regular_file(resolved, ec)) {
      return Err(InvalidArgument(config_file.string() + " is not a regular file"));
    }
    const uintmax_t size = fs::file_size(resolved, ec);
    if (ec || size > kMaxConfigBytes) {
      return Err(InvalidArgument(
          config_file.string() +
          (ec ? ": " + ec.message() : " is larger than " + std::to_string(kMaxConfigBytes) + " bytes")));
    }
    std::ifstream in(resolved);
    if (!in) return Err(Unavailable("cannot read " + config_file.string()));
    std::stringstream text;
    text << in.rdbuf();
    auto proto = ParseModelConfigText(text.str(), config_file.string());
    if (!proto) return Err(proto.error());
    if (!proto->name().empty() && proto->name() != name) {
      return Err(InvalidArgument(config_file.string() + ": name '" + proto->name() +
                                 "' does not match the model folder '" + name + "'"));
    }
    auto config = ConvertModelConfig(*proto, config_file.string());
    if (!config) return Err(config.error());
    m.config = std::move(*config);
    m.version_policy = ConvertVersionPolicy(*proto);
    m.has_config_file = true;
  } else {
    // An ONNX model, run by the runtime measured fastest (backend "auto").
    m.config.backend = "auto";
    m.config.platform = "onnxruntime_onnx";
    m.config.instance_count = 0;  // automatic
  }
  m.config.name = name;

  std::vector<int64_t> available;
  for (auto it = fs::directory_iterator(m.dir, ec); !ec && it != fs::directory_iterator(); it.increment(ec)) {
    int64_t v;
    std::error_code dir_ec;
    if (ParseVersion(it->path().filename().string(), v) && it->is_directory(dir_ec)) available.push_back(v);
  }
  if (ec) return Err(Unavailable("model '" + name + "': cannot list its folder: " + ec.message()));
  if (available.empty()) {
    return Err(
        NotFound("model '" + name + "' has no version folders (expected " + (m.dir / "1").string() + "/model.onnx)"));
  }
  // Without config.pbtxt, a version folder holding model.py and no model.onnx is a Python model,
  // whose TritonPythonModel.auto_complete_config names its tensors (as in Triton).
  if (!m.has_config_file) {
    const fs::path newest = m.dir / std::to_string(*std::max_element(available.begin(), available.end()));
    std::error_code onnx_ec, py_ec;
    if (!fs::exists(newest / "model.onnx", onnx_ec) && fs::is_regular_file(newest / "model.py", py_ec)) {
      m.config.backend = "python";
      m.config.platform.clear();
    }
  }
  const std::string default_file = m.config.backend == "python"    ? "model.py"
                                   : m.config.backend == "pytorch" ? "model.pt"
                                                                   : "model.onnx";
  const std::string& file = m.config.default_model_filename.empty() ? default_file : m.config.default_model_filename;
  if (file.find('/') != std::string::npos || file == "." || file == "..") {
    return Err(InvalidArgument(config_file.string() + ": default_model_filename '" + file +
                               "' must be a file name inside the version folder"));
  }
  for (int64_t v : m.version_policy.Select(available)) {
    const fs::path version_dir = m.dir / std::to_string(v);
    std::string version_file = file;
    if (m.config.backend == "openvino" && m.config.default_model_filename.empty()) {
      // OpenVINO IR (model.xml beside model.bin) when the folder has it, else model.onnx.
      std::error_code xml_ec;
      if (fs::exists(version_dir / "model.xml", xml_ec)) version_file = "model.xml";
    }
    if (m.config.is_ensemble() || m.config.backend == "quern") {
      // An ensemble's version folder holds no file (Triton's layout), nor
      // does a built-in stage's: the folder itself stands for the version.
      QUERN_ASSIGN_OR_RETURN(fs::path dir, ResolveInRepository(repo, m.dir, std::to_string(v),
                                                               "model '" + name + "' version " + std::to_string(v)));
      m.versions.push_back({v, std::move(dir)});
      continue;
    }
    QUERN_ASSIGN_OR_RETURN(fs::path model_file,
                           ResolveInRepository(repo, version_dir, version_file,
                                               "model '" + name + "' version " + std::to_string(v) + " file"));
    m.versions.push_back({v, std::move(model_file)});
  }
  if (m.versions.empty()) {
    return Err(NotFound("model '" + name + "': the version_policy selects none of the versions present"));
  }
  return m;
}

}  // namespace

Status CheckModelName(std::string_view name) {
  if (name.empty()) return InvalidArgument("a model name must not be empty");
  if (name.size() > kMaxModelNameBytes) {
    return InvalidArgument("model name " + Quoted(name) + " is longer than " + std::to_string(kMaxModelNameBytes) +
                           " bytes");
  }
  if (name == "." || name == "..") return InvalidArgument("model name " + Quoted(name) + " is not a name");
  for (unsigned char c : name) {
    if (c == '/' || c == '\\' || c < 0x20 || c == 0x7f) {
      return InvalidArgument("model name " + Quoted(name) +
                             " is not a name: model names cannot hold '/', '\\\\' or control characters");
    }
  }
  return Status::Ok();
}

Result<fs::path> ResolveInRepository(const fs::path& repo, const fs::path& base, const fs::path& path,
                                     const std::string& what) {
  std::error_code ec;
  const fs::path root = fs::weakly_canonical(fs::absolute(repo, ec), ec);
  if (ec) return Err(Unavailable("cannot resolve the model repository: " + ec.message()));
  // ".." is refused outright: past a component that does not exist,
  // weakly_canonical resolves ".." by text, while opening the file would
  // follow the links on the way ("missing/../link/x").
  for (const auto& part : path) {
    if (part == "..") return Err(InvalidArgument(what + " '" + path.string() + "' must not contain '..'"));
  }
  const fs::path full = path.is_absolute() ? path : base / path;
  fs::path resolved = fs::weakly_canonical(fs::absolute(full, ec), ec);
  if (ec) return Err(InvalidArgument(what + " '" + path.string() + "' cannot be resolved: " + ec.message()));
  if (!IsWithin(root, resolved)) {
    return Err(InvalidArgument(what + " '" + path.string() + "' lies outside the model repository"));
  }
  return resolved;
}

Result<std::vector<std::string>> ReadLabelFile(const fs::path& model_dir, const std::string& label_filename,
                                               const std::string& what) {
  // ImageNet's 1000 labels take 30 KiB.
  constexpr uintmax_t kMaxLabelFileBytes = 16 << 20;
  QUERN_ASSIGN_OR_RETURN(const auto path, ResolveInRepository(model_dir, model_dir, label_filename, what));
  std::error_code ec;
  const bool regular = fs::is_regular_file(path, ec);
  const uintmax_t size = regular ? fs::file_size(path, ec) : 0;
  if (!regular || ec || size > kMaxLabelFileBytes) {
    return std::unexpected(InvalidArgument(what + " '" + label_filename +
                                           "' is not a readable regular file of at most " +
                                           std::to_string(kMaxLabelFileBytes) + " bytes"));
  }
  std::ifstream in(path);
  if (!in) return std::unexpected(InvalidArgument(what + " '" + label_filename + "' cannot be read"));
  std::vector<std::string> labels;
  for (std::string line; std::getline(in, line);) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    labels.push_back(std::move(line));
  }
  return labels;
}

Result<OutputLabelSet> ReadOutputLabels(const ModelConfig& config, const fs::path& model_dir) {
  OutputLabelSet set;
  for (const TensorConfig& o : config.outputs) {
    if (o.label_filename.empty()) continue;
    QUERN_ASSIGN_OR_RETURN(
        auto labels,
        ReadLabelFile(model_dir, o.label_filename, "model '" + config.name + "' output '" + o.name + "' label file"));
    set.emplace_back(o.name, std::make_shared<const std::vector<std::string>>(std::move(labels)));
  }
  return set;
}

std::shared_ptr<const std::vector<std::string>> FindOutputLabels(const OutputLabelSet& set, std::string_view output) {
  for (const auto& [name, labels] : set) {
    if (name == output) return labels;
  }
  return nullptr;
}

Result<std::vector<std::string>> ListRepositoryModels(const fs::path& repo) {
  std::error_code ec;
  if (!fs::is_directory(repo, ec)) {
    return Err(NotFound("model repository '" + repo.string() + "' is not a directory"));
  }
  std::vector<std::string> names;
  for (auto it = fs::directory_iterator(repo, ec); !ec && it != fs::directory_iterator(); it.increment(ec)) {
    const std::string n = it->path().filename().string();
    if (n.empty() || n[0] == '.' || !CheckModelName(n).ok()) continue;
    // A symbolic link loop or an unreadable entry is listed: loading it
    // reports the error for that model alone.
    std::error_code entry_ec;
    if (it->is_directory(entry_ec) || entry_ec || it->is_symlink(entry_ec)) names.push_back(n);
  }
  if (ec) return Err(Unavailable("cannot read model repository '" + repo.string() + "': " + ec.message()));
  std::sort(names.begin(), names.end());
  return names;
}

std::string FingerprintModelDir(const fs::path& dir) {
  try {
    std::vector<std::string> parts;
    std::error_code ec;
    for (auto it = fs::recursive_directory_iterator(dir, ec); !ec && it != fs::recursive_directory_iterator();
         it.increment(ec)) {
      std::error_code file_ec;
      if (!it->is_regular_file(file_ec)) continue;
      auto size = it->file_size(file_ec);
      auto mtime = it->last_write_time(file_ec).time_since_epoch().count();
      parts.push_back(fs::relative(it->path(), dir, file_ec).string() + ":" + std::to_string(size) + ":" +
                      std::to_string(mtime));
      if (parts.size() > 100000) break;  // a folder this large is not a model; enough to see changes
    }
    if (ec) parts.push_back("error:" + ec.message());
    std::sort(parts.begin(), parts.end());
    std::string out;
    for (const auto& p : parts) out += p + ";";
    return out;
  } catch (const std::exception& e) {
    return std::string("error:") + e.what();
  }
}

Result<RepositoryModel> ReadRepositoryModel(const fs::path& repo, const std::string& name, bool allow_links_outside) {
  QUERN_RETURN_IF_ERROR(CheckModelName(name));
  try {
    return ReadModel(repo, name, allow_links_outside);
  } catch (const std::exception& e) {
    return Err(Unavailable("model '" + name + "' cannot be read from the repository: " + e.what()));
  }
}

}  // namespace quern
