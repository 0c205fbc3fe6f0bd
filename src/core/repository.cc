#include "core/repository.h"

#include <algorithm>
#include <charconv>
#include <fstream>
#include <sstream>

namespace fs = std::filesystem;

namespace quern {
namespace {

bool ParseVersion(const std::string& s, int64_t& out) {
  if (s.empty() || s.size() > 18) return false;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), out);
  return ec == std::errc() && p == s.data() + s.size() && out >= 0;
}

}  // namespace

Result<std::vector<std::string>> ListRepositoryModels(const fs::path& repo) {
  std::error_code ec;
  if (!fs::is_directory(repo, ec)) {
    return Err(NotFound("model repository '" + repo.string() + "' is not a directory"));
  }
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(repo, ec)) {
    const std::string n = e.path().filename().string();
    if (!n.empty() && n[0] != '.' && e.is_directory()) names.push_back(n);
  }
  if (ec) return Err(Unavailable("cannot read model repository '" + repo.string() + "': " + ec.message()));
  std::sort(names.begin(), names.end());
  return names;
}

std::string FingerprintModelDir(const fs::path& dir) {
  std::vector<std::string> parts;
  std::error_code ec;
  for (auto it = fs::recursive_directory_iterator(dir, ec); !ec && it != fs::recursive_directory_iterator();
       it.increment(ec)) {
    if (!it->is_regular_file(ec)) continue;
    auto size = it->file_size(ec);
    auto mtime = it->last_write_time(ec).time_since_epoch().count();
    parts.push_back(fs::relative(it->path(), dir, ec).string() + ":" + std::to_string(size) + ":" +
                    std::to_string(mtime));
  }
  std::sort(parts.begin(), parts.end());
  std::string out;
  for (const auto& p : parts) out += p + ";";
  return out;
}

Result<RepositoryModel> ReadRepositoryModel(const fs::path& repo, const std::string& name) {
  RepositoryModel m;
  m.name = name;
  m.dir = repo / name;
  std::error_code ec;
  if (!fs::is_directory(m.dir, ec)) {
    return Err(NotFound("model '" + name + "' is not in repository '" + repo.string() + "'"));
  }
  m.fingerprint = FingerprintModelDir(m.dir);

  const fs::path config_file = m.dir / "config.pbtxt";
  if (fs::exists(config_file, ec)) {
    std::ifstream in(config_file);
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
    m.config.backend = "onnxruntime";
    m.config.platform = "onnxruntime_onnx";
    m.config.instance_count = 0;  // automatic
  }
  m.config.name = name;

  std::vector<int64_t> available;
  for (const auto& e : fs::directory_iterator(m.dir, ec)) {
    int64_t v;
    if (e.is_directory() && ParseVersion(e.path().filename().string(), v)) available.push_back(v);
  }
  if (available.empty()) {
    return Err(
        NotFound("model '" + name + "' has no version folders (expected " + (m.dir / "1").string() + "/model.onnx)"));
  }
  const std::string file = m.config.default_model_filename.empty() ? "model.onnx" : m.config.default_model_filename;
  for (int64_t v : m.version_policy.Select(available)) {
    m.versions.push_back({v, m.dir / std::to_string(v) / file});
  }
  if (m.versions.empty()) {
    return Err(NotFound("model '" + name + "': the version_policy selects none of the versions present"));
  }
  return m;
}

}  // namespace quern
