// `quern models` and `quern infer`: a repository's models, and one request.
#include "cli/commands.h"

#include <google/protobuf/text_format.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <random>
#include <set>
#include <sstream>

#include "backends/openvino/openvino_backend.h"
#include "core/model_config_parser.h"
#include "core/npy.h"
#include "server/server.h"

namespace quern::cli {
namespace {

template <typename T>
void PrintValues(const quern::Tensor& t, size_t limit) {
  auto v = t.values<T>();
  for (size_t i = 0; i < v.size() && i < limit; ++i) std::cout << (i ? " " : "") << +v[i];
  if (v.size() > limit) std::cout << " ...";
}

quern::Result<quern::Tensor> MakeInput(const quern::ModelConfig& c, const quern::TensorConfig& tc,
                                       const std::string& spec) {
  if (spec != "zeros" && spec != "random") return quern::ReadNpy(spec);
  quern::Shape shape = tc.dims;
  if (c.max_batch_size > 0) shape.insert(shape.begin(), 1);
  if (quern::ElementCount(shape) < 0) {
    return quern::Err(quern::InvalidArgument("input '" + tc.name + "' has a variable shape " +
                                             quern::ShapeToString(shape) + "; give a .npy file"));
  }
  if (tc.dtype == quern::DataType::kBytes) {
    return quern::Tensor::FromStrings(shape, std::vector<std::string>(quern::ElementCount(shape)));
  }
  const size_t bytes = quern::ElementCount(shape) * quern::DataTypeByteSize(tc.dtype);
  quern::Tensor t = quern::Tensor::Allocate(tc.dtype, shape, bytes);
  if (spec == "random" && tc.dtype == quern::DataType::kFp32) {
    std::mt19937 rng(1);
    std::uniform_real_distribution<float> d(-1.f, 1.f);
    auto* f = reinterpret_cast<float*>(t.mutable_data());
    for (size_t i = 0; i < bytes / 4; ++i) f[i] = d(rng);
  }
  return t;
}

// The repository opened as `quern serve` opens it; the error printed.
quern::Result<std::unique_ptr<quern::Engine>> Open(const std::string& repo, bool load_all_models = true) {
  quern::ServerOptions options;
  options.model_repository = repo;
  // Listing or trying a model: backend "auto" opens ONNX Runtime unmeasured
  // (`quern serve` and `quern tune` measure).
  options.measure_runtimes = false;
  auto engine = quern::OpenEngine(options, load_all_models);
  if (!engine) std::fprintf(stderr, "quern: %s\n", engine.error().ToString().c_str());
  return engine;
}

// The models an ensemble's config.pbtxt names as its steps (none for a
// model without one, or whose file does not parse: its load says why).
std::vector<std::string> StepsOf(const std::string& repo, const std::string& model) {
  std::vector<std::string> steps;
  const std::filesystem::path file = std::filesystem::path(repo) / model / "config.pbtxt";
  std::ifstream in(file, std::ios::binary);
  if (!in) return steps;
  std::ostringstream text;
  text << in.rdbuf();
  auto proto = quern::ParseModelConfigText(text.str(), file.string());
  if (!proto) return steps;
  for (const auto& step : proto->ensemble_scheduling().step()) steps.push_back(step.model_name());
  return steps;
}

// Loads `model` after the models its ensemble steps run (and theirs), each
// once; a cycle or a model that fails to load is left to LoadModel to name.
quern::Status LoadWithSteps(quern::Engine& engine, const std::string& repo, const std::string& model,
                            std::set<std::string>& loaded) {
  if (!loaded.insert(model).second) return quern::Status::Ok();
  for (const std::string& step : StepsOf(repo, model)) {
    quern::Status st = LoadWithSteps(engine, repo, step, loaded);
    if (!st.ok()) return st;
  }
  return engine.LoadModel(model);
}

}  // namespace

int Infer(const std::string& repo, const std::string& model, const std::vector<std::string>& specs) {
  // Only the model asked for (and what an ensemble runs) is loaded.
  auto engine = Open(repo, /*load_all_models=*/false);
  if (!engine) return 1;
  std::set<std::string> loaded;
  if (quern::Status st = LoadWithSteps(**engine, repo, model, loaded); !st.ok()) {
    std::fprintf(stderr, "quern: %s\n", st.ToString().c_str());
    return 1;
  }
  auto status = (*engine)->GetModel(model);
  if (!status) {
    std::fprintf(stderr, "quern: %s\n", status.error().ToString().c_str());
    return 1;
  }
  if (status->state != quern::ModelState::kReady) {
    std::fprintf(stderr, "quern: model '%s' is not ready: %s\n", model.c_str(), status->reason.c_str());
    return 1;
  }
  quern::InferRequest req;
  req.model = model;
  for (const auto& s : specs) {
    auto eq = s.find('=');
    if (eq == std::string::npos) {
      std::fprintf(stderr, "quern: --input '%s' is not NAME=FILE.npy|zeros|random\n", s.c_str());
      return 2;
    }
    const std::string name = s.substr(0, eq);
    const quern::TensorConfig* tc = status->config.FindInput(name);
    if (!tc) {
      std::fprintf(stderr, "quern: model '%s' has no input '%s'\n", model.c_str(), name.c_str());
      return 2;
    }
    auto t = MakeInput(status->config, *tc, s.substr(eq + 1));
    if (!t) {
      std::fprintf(stderr, "quern: %s\n", t.error().ToString().c_str());
      return 2;
    }
    req.inputs.push_back({name, std::move(*t)});
  }
  quern::InferResponse r = (*engine)->Infer(std::move(req)).get();
  if (!r.status.ok()) {
    std::fprintf(stderr, "quern: %s\n", r.status.ToString().c_str());
    return 1;
  }
  for (const auto& o : r.outputs) {
    const quern::Tensor& t = o.tensor;
    std::cout << o.name << " " << quern::DataTypeName(t.dtype()) << " " << quern::ShapeToString(t.shape()) << ": ";
    switch (t.dtype()) {
      case quern::DataType::kFp32: PrintValues<float>(t, 16); break;
      case quern::DataType::kFp64: PrintValues<double>(t, 16); break;
      case quern::DataType::kInt64: PrintValues<int64_t>(t, 16); break;
      case quern::DataType::kInt32: PrintValues<int32_t>(t, 16); break;
      case quern::DataType::kUint8: PrintValues<uint8_t>(t, 16); break;
      case quern::DataType::kInt8: PrintValues<int8_t>(t, 16); break;
      default: std::cout << t.byte_size() << " bytes";
    }
    std::cout << "\n";
  }
  std::printf("request %llu: batch %lld, queue %.3f ms, compute %.3f ms, total %.3f ms\n",
              static_cast<unsigned long long>(r.request_id), static_cast<long long>(r.telemetry.batch_size),
              r.telemetry.queue_ns() / 1e6, r.telemetry.compute_ns() / 1e6, r.telemetry.total_ns() / 1e6);
  return 0;
}

int Models(const std::string& repo) {
  auto engine = Open(repo);
  if (!engine) return 1;
  quern::PrintModels(**engine, repo);
  for (const auto& m : (*engine)->ListModels()) {
    if (m.state != quern::ModelState::kReady) return 3;
  }
  return 0;
}

int Tune(const std::string& model_dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path src = fs::weakly_canonical(model_dir, ec);
  int64_t version = -1;
  fs::path version_dir;
  for (auto it = fs::directory_iterator(src, ec); !ec && it != fs::directory_iterator(); it.increment(ec)) {
    const std::string n = it->path().filename().string();
    std::error_code file_ec;
    if (!n.empty() && n.size() < 18 && n.find_first_not_of("0123456789") == std::string::npos &&
        fs::exists(it->path() / "model.onnx", file_ec) && std::stoll(n) > version) {
      version = std::stoll(n);
      version_dir = it->path();
    }
  }
  if (version < 0) {
    std::fprintf(stderr, "quern tune: %s has no <version>/model.onnx\n", model_dir.c_str());
    return 1;
  }
  const char* tmpdir = std::getenv("TMPDIR");
  std::string tmpl = std::string(tmpdir && *tmpdir ? tmpdir : "/tmp") + "/quern-tune-XXXXXX";
  if (!::mkdtemp(tmpl.data())) {
    std::fprintf(stderr, "quern tune: cannot make a temporary folder: %s\n", std::strerror(errno));
    return 1;
  }
  const fs::path tmp = tmpl;
  struct Remove {  // the temporary repository goes, whatever happens below
    fs::path dir;
    ~Remove() {
      std::error_code ignored;
      fs::remove_all(dir, ignored);
    }
  } remove{tmp};
  const fs::path model = tmp / src.filename();
  fs::create_directories(model / "1", ec);
  // The folder's files as they are (labels; the version's model.onnx and
  // its external data), linked to the files links point at, else copied.
  const auto place_files = [&](const fs::path& from_dir, const fs::path& to_dir, bool follow_links = true) -> bool {
    std::error_code list_ec;
    for (auto it = fs::directory_iterator(from_dir, list_ec); !list_ec && it != fs::directory_iterator();
         it.increment(list_ec)) {
      std::error_code file_ec;
      const std::string n = it->path().filename().string();
      if (n == "config.pbtxt" || !fs::is_regular_file(it->path(), file_ec)) continue;
      if (!follow_links && it->is_symlink(file_ec)) continue;
      const fs::path from = fs::canonical(it->path(), file_ec);
      std::error_code link_ec;
      if (!file_ec) fs::create_hard_link(from, to_dir / n, link_ec);
      if (file_ec || link_ec) fs::copy_file(from, to_dir / n, file_ec);
      if (file_ec) {
        std::fprintf(stderr, "quern tune: cannot place %s: %s\n", it->path().c_str(), file_ec.message().c_str());
        return false;
      }
    }
    return !list_ec;
  };
  if (!place_files(src, model) || !place_files(version_dir, model / "1")) return 1;
  // Its warm-up files (model_warmup's input_data_file): the check input when there is a sample.
  // Its plain files only: a link or a subfolder there is left out, though serving would follow one
  // that stays inside the model's folder.
  if (std::error_code dir_ec; fs::is_directory(fs::symlink_status(src / "warmup", dir_ec))) {
    fs::create_directories(model / "warmup", ec);
    if (!place_files(src / "warmup", model / "warmup", false)) return 1;
  }
  // Its configuration as parsed, with backend "auto" and the automatic
  // layout of one version (a file that does not parse: its load says why).
  std::string config = "backend: \"auto\"\n";
  if (std::ifstream in(src / "config.pbtxt"); in) {
    std::ostringstream text;
    text << in.rdbuf();
    auto proto = quern::ParseModelConfigText(text.str(), (src / "config.pbtxt").string());
    if (proto) {
      proto->clear_name();
      proto->clear_platform();
      proto->clear_version_policy();
      proto->clear_instance_group();
      proto->set_backend("auto");
      google::protobuf::TextFormat::PrintToString(*proto, &config);
    } else {
      config = text.str();
    }
  }
  std::ofstream(model / "config.pbtxt") << config;
  quern::ServerOptions options;
  options.model_repository = tmp.string();
  auto engine = quern::OpenEngine(options, true);
  if (!engine) {
    std::fprintf(stderr, "quern tune: %s\n", engine.error().ToString().c_str());
    return 1;
  }
  int rc = 0;
  for (const auto& m : (*engine)->ListModels()) {
    if (m.state != quern::ModelState::kReady) rc = 1;
    if (!m.reason.empty()) std::fprintf(stderr, "quern tune: %s\n", m.reason.c_str());
  }
  return rc;
}

int OpenvinoIr(const std::string& model_file, const std::string& xml_file, bool f16) {
  if (const Status st = SaveOpenvinoIr(model_file, xml_file, f16); !st.ok()) {
    std::fprintf(stderr, "quern openvino-ir: %s\n", st.message().c_str());
    return 1;
  }
  std::printf("wrote %s and its .bin\n", xml_file.c_str());
  return 0;
}

namespace {

// The folder of the running `quern` (where quern-perf and quern-quantize are
// built and installed).
std::filesystem::path SelfDir(const char* argv0) {
  std::error_code ec;
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", ec);
  return (ec ? std::filesystem::path(argv0) : self).parent_path();
}

}  // namespace

int RunPerfTool(int argc, char** argv) {
  const std::string name = (SelfDir(argv[0]) / "quern-perf").string();
  std::vector<char*> args(argv, argv + argc);
  args[0] = const_cast<char*>(name.c_str());
  args.push_back(nullptr);
  execv(name.c_str(), args.data());
  std::fprintf(stderr, "quern perf: cannot run %s: %s (it is installed beside quern)\n", name.c_str(),
               std::strerror(errno));
  return 127;
}

int RunQuantizeTool(int argc, char** argv) {
  const std::string script = (SelfDir(argv[0]) / "quern-quantize").string();
  if (access(script.c_str(), R_OK) != 0) {
    std::fprintf(stderr, "quern quantize: cannot read %s: %s (it is installed beside quern)\n", script.c_str(),
                 std::strerror(errno));
    return 127;
  }
  // argv[1] is "quantize": the script takes what follows it.
  std::vector<char*> args;
  const char* python = std::getenv("QUERN_PYTHON");
  std::string interpreter = python && *python ? python : "";
  if (!interpreter.empty()) args.push_back(interpreter.data());
  std::string script_arg = script;
  args.push_back(script_arg.data());
  for (int i = 2; i < argc; ++i) args.push_back(argv[i]);
  args.push_back(nullptr);
  if (interpreter.empty()) {
    execv(script.c_str(), args.data());  // its first line: #!/usr/bin/env python3
  } else {
    execvp(interpreter.c_str(), args.data());
  }
  const int error = errno;
  std::fprintf(stderr, "quern quantize: cannot run %s: %s (%s)\n",
               interpreter.empty() ? script.c_str() : interpreter.c_str(), std::strerror(error),
               interpreter.empty() ? "it runs the python3 on PATH; QUERN_PYTHON=/path/to/python names another"
                                   : "QUERN_PYTHON names the Python interpreter");
  return error == EACCES ? 126 : 127;  // as a shell says: found but not runnable, or not found
}

}  // namespace quern::cli
