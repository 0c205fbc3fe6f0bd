#include "backends/openvino/openvino_backend.h"

#include <algorithm>
#include <charconv>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "backends/onnxruntime/ort_model.h"
#include "backends/openvino/ov_plugin_api.h"
#include "backends/plugin_loader.h"
#include "core/idle_release.h"
#include "core/log.h"
#include "core/memory.h"
#include "core/mutex.h"
#include "engine/instance_placement.h"

namespace quern {
namespace {

// The plugin, loaded once per process (never unloaded: OpenVINO's CPU
// plugin and TBB threads outlive any model).
Result<const QuernOvApi*> OpenvinoPlugin() {
  static std::once_flag once;
  static const QuernOvApi* api = nullptr;
  static std::string error;
  std::call_once(once, [] {
    PluginLocation where;
    where.env = "QUERN_OPENVINO_PLUGIN";
#ifdef QUERN_OPENVINO_PLUGIN_PATH
    where.from_bin = QUERN_OPENVINO_PLUGIN_FROM_BIN;
    where.from_lib = QUERN_OPENVINO_PLUGIN_FROM_LIB;
    where.build_path = QUERN_OPENVINO_PLUGIN_PATH;
#endif
    where.symbol = "quern_openvino_api";
    where.what = "OpenVINO plugin";
    where.missing =
        "this build of Quern has no OpenVINO plugin (OpenVINO was not found when it was built: "
        "scripts/setup.sh installs it)";
    where.accept = [](void* symbol) {
      const auto* found = reinterpret_cast<QuernOvApiFn>(symbol)();
      return found && found->abi == QUERN_OV_PLUGIN_ABI;
    };
    auto loaded = LoadPlugin(where);
    if (!loaded) {
      error = loaded.error().message();
      return;
    }
    const QuernOvApi* found = reinterpret_cast<QuernOvApiFn>(loaded->symbol)();
    if (!found || found->abi != QUERN_OV_PLUGIN_ABI) {
      error = "cannot load Quern's OpenVINO plugin (" + loaded->path + ": not an OpenVINO plugin of this version)";
      return;
    }
    api = found;
    Log(LogLevel::kInfo, "OpenVINO plugin " + loaded->path + " (OpenVINO " + found->version + ")");
  });
  if (!api) return Err(Unavailable(error));
  return api;
}

std::string Take(const QuernOvApi* api, char* s) {
  std::string out = s ? s : "unknown error";
  if (s) api->free_string(s);
  return out;
}

// How long a compiled model's runs must rest before the memory they keep
// between runs is given back (as BlockCache and a Python model's slots do).
constexpr int64_t kRunMemoryIdleNs = 5'000'000'000;
// Looks at a compiled model whose release OpenVINO refused before it waits
// for its next run.
constexpr int kReleaseTries = 3;

// A file as OpenVINO read it: the compiles of one model (its instances' and
// the wide instance's) share its weights.
struct ReadModel {
  const QuernOvApi* api = nullptr;
  void* read = nullptr;
  ~ReadModel() {
    if (read) api->release_read(read);
  }
};

// A compiled model, released when its last instance and opener let go.
//
// Its streams keep their intermediate buffers between runs (tens of MB for a
// detector at 640x640, each stream its own). Once a whole idle time has gone
// by without a run (between one and two idle times after the last) they are
// given back (OpenVINO's release_memory, then the C library's free pages);
// the next run allocates them again, so a steady load keeps them. OpenVINO
// may release them only while no request of the model runs: a run holds `mu`
// only to count itself in and out, and the release holds it throughout, so a
// run that starts meanwhile waits for the release.
struct Compiled {
  const QuernOvApi* api = nullptr;
  void* model = nullptr;
  std::string model_name;                 // the configuration's, for the log
  std::vector<std::string> output_names;  // the compiled model's, in its order
  std::shared_ptr<IdleRelease> idle;      // null: its memory is kept
  mutable Mutex mu;
  mutable int running QUERN_GUARDED_BY(mu) = 0;          // requests between run and their last output
  mutable bool ran QUERN_GUARDED_BY(mu) = false;         // a run began since the last look
  mutable int failed_releases QUERN_GUARDED_BY(mu) = 0;  // since the last run
  mutable bool warned QUERN_GUARDED_BY(mu) = false;      // a refused release logged

  ~Compiled() {
    if (idle) idle->Remove(this);  // no release of it runs once this returns
    if (model) api->release_model(model);
  }

  // A request created or released: OpenVINO reads the graph meanwhile, so
  // no release may run.
  void* NewRequest(char** error) const {
    MutexLock lock(mu);
    return api->new_request(model, error);
  }
  void ReleaseRequest(void* request) const {
    MutexLock lock(mu);
    api->release_request(request);
  }

  void Enter() const {
    MutexLock lock(mu);
    ++running;
    ran = true;
    failed_releases = 0;
  }
  void Leave() const {
    {
      MutexLock lock(mu);
      --running;
    }
    if (idle) idle->Touch(this);  // arms the next look
  }

  // IdleRelease's thread, an idle time after a run armed it.
  IdleRelease::Outcome ReleaseIdle() const {
    {
      MutexLock lock(mu);
      if (running > 0 || ran) {  // not idle for a whole idle time: looked at again later
        ran = false;
        return IdleRelease::Outcome::kHeld;
      }
      char* error = nullptr;
      if (api->release_memory(model, &error) != 0) {
        const std::string why = error ? error : "unknown error";
        if (error) api->free_string(error);
        // A few more looks, then none until a run arms it again.
        if (!std::exchange(warned, true)) {
          Log(LogLevel::kWarning, "OpenVINO kept its run memory: " + why, {{"model", model_name}});
        }
        ++failed_releases;
        return failed_releases < kReleaseTries ? IdleRelease::Outcome::kHeld : IdleRelease::Outcome::kReleased;
      }
    }
    ReturnFreedMemory();
    Log(LogLevel::kDebug, "OpenVINO's run memory given back (idle)", {{"model", model_name}});
    return IdleRelease::Outcome::kReleased;
  }
};

class OvModel final : public Model {
 public:
  OvModel(std::string name, std::shared_ptr<const Compiled> compiled, std::vector<std::string> outputs)
      : name_(std::move(name)), compiled_(std::move(compiled)), wanted_(std::move(outputs)) {}
  ~OvModel() override {
    if (request_) compiled_->ReleaseRequest(request_);
  }

  Status Load() override {
    char* error = nullptr;
    request_ = compiled_->NewRequest(&error);
    if (!request_)
      return Unavailable(Who() + ": OpenVINO cannot create an infer request: " + Take(compiled_->api, error));
    for (const auto& name : wanted_) {
      auto it = std::find(compiled_->output_names.begin(), compiled_->output_names.end(), name);
      if (it == compiled_->output_names.end())
        return InvalidArgument(Who() + ": the model has no output '" + name + "'");
      output_index_.push_back(static_cast<int>(it - compiled_->output_names.begin()));
    }
    return Status::Ok();
  }

  Status Execute(const std::vector<NamedTensor>& inputs, int64_t /*batch_size*/,
                 std::vector<NamedTensor>& outputs) override {
    return Run(inputs, outputs, nullptr);
  }
  Status ExecuteRequests(const std::vector<NamedTensor>& inputs, int64_t /*batch_size*/, BatchRequests requests,
                         std::vector<NamedTensor>& outputs) override {
    return Run(inputs, outputs, requests.interrupt);
  }

 private:
  std::string Who() const { return "model '" + name_ + "'"; }

  Status Run(const std::vector<NamedTensor>& inputs, std::vector<NamedTensor>& outputs, BatchInterrupt* interrupt) {
    const QuernOvApi* api = compiled_->api;
    std::vector<const char*> names;
    std::vector<QuernOvTensor> args(inputs.size());
    names.reserve(inputs.size());
    for (size_t i = 0; i < inputs.size(); ++i) {
      const Tensor& t = inputs[i].tensor;
      if (t.dtype() == DataType::kBytes) {
        return InvalidArgument(Who() + ": input '" + inputs[i].name + "' is BYTES, which OpenVINO models do not take");
      }
      if (t.shape().size() > 8)
        return InvalidArgument(Who() + ": input '" + inputs[i].name + "' has over 8 dimensions");
      names.push_back(inputs[i].name.c_str());
      QuernOvTensor& a = args[i];
      a.dtype = static_cast<uint8_t>(t.dtype());
      a.rank = static_cast<int32_t>(t.shape().size());
      std::copy(t.shape().begin(), t.shape().end(), a.dims);
      a.data = const_cast<std::byte*>(t.data());  // read, never written
      a.bytes = t.byte_size();
    }
    struct Disarm {
      BatchInterrupt* interrupt;
      ~Disarm() {
        if (interrupt) interrupt->Disarm();
      }
    } disarm{interrupt};
    if (interrupt) {
      interrupt->Arm([api, request = request_] { api->cancel(request); });
      // Every request already cancelled: stop ran inside Arm, before the run
      // (OpenVINO's cancel acts only on a running request).
      if (interrupt->stopped()) return Cancelled(Who() + ": every request of the batch was cancelled before it ran");
    }
    // Counted in from the run to the last output copied: the outputs may
    // lie in the memory an idle release frees.
    struct Running {
      const Compiled& compiled;
      explicit Running(const Compiled& c) : compiled(c) { compiled.Enter(); }
      ~Running() { compiled.Leave(); }
    } running(*compiled_);
    char* error = nullptr;
    const int rc = api->run(request_, names.data(), args.data(), static_cast<int>(args.size()), &error);
    if (rc == 1 || (interrupt && interrupt->stopped())) {
      if (rc == -1) Take(api, error);
      return Cancelled(Who() + ": every request of the batch was cancelled; its run was stopped");
    }
    if (rc != 0) return Internal(Who() + ": OpenVINO failed to run the batch: " + Take(api, error));
    outputs.clear();
    outputs.reserve(wanted_.size());
    for (size_t i = 0; i < wanted_.size(); ++i) {
      QuernOvTensor out{};
      if (api->output(request_, output_index_[i], &out, &error) != 0) {
        return Internal(Who() + ": OpenVINO output '" + wanted_[i] + "': " + Take(api, error));
      }
      if (out.dtype == 0) return Internal(Who() + ": output '" + wanted_[i] + "' has a type Quern has no name for");
      // Copied: the request reuses its output memory at the next run, while
      // this batch's answers may still be on their way.
      Tensor copy = Tensor::AllocateUninitialized(static_cast<DataType>(out.dtype),
                                                  Shape(out.dims, out.dims + out.rank), out.bytes);
      if (out.bytes) std::memcpy(copy.mutable_data(), out.data, out.bytes);
      outputs.push_back({wanted_[i], std::move(copy)});
    }
    return Status::Ok();
  }

  std::string name_;
  std::shared_ptr<const Compiled> compiled_;
  std::vector<std::string> wanted_;
  std::vector<int> output_index_;
  void* request_ = nullptr;
};

// What one compile needs: the file as read (its name for the log),
// OpenVINO's properties, where idle run memory is given back.
struct CompileSpec {
  std::string model_name;
  std::filesystem::path file;
  std::shared_ptr<const ReadModel> read;
  std::map<std::string, std::string> props;
  std::shared_ptr<IdleRelease> idle;
};

// Compiles `spec` and logs what OpenVINO chose (precision, streams, threads).
Result<std::shared_ptr<Compiled>> CompileModel(const QuernOvApi* api, const CompileSpec& spec, const char* layout) {
  const std::string who = "model '" + spec.model_name + "'";
  std::vector<const char*> keys, values;
  for (const auto& [k, v] : spec.props) {
    keys.push_back(k.c_str());
    values.push_back(v.c_str());
  }
  char* error = nullptr;
  auto compiled = std::make_shared<Compiled>();
  compiled->api = api;
  compiled->model_name = spec.model_name;
  compiled->model = api->compile(spec.read->read, keys.data(), values.data(), static_cast<int>(keys.size()), &error);
  if (!compiled->model) {
    return Err(InvalidArgument(who + ": OpenVINO cannot compile " + spec.file.string() + ": " + Take(api, error)));
  }
  if (spec.idle) {
    compiled->idle = spec.idle;
    const Compiled* c = compiled.get();
    spec.idle->Add(c, [c] { return c->ReleaseIdle(); });
  }
  const QuernOvPort* ports = nullptr;
  const int n = api->ports(compiled->model, 1, &ports);
  for (int i = 0; i < n; ++i) compiled->output_names.push_back(ports[i].name);
  std::string chosen;
  for (const char* key : {"INFERENCE_PRECISION_HINT", "NUM_STREAMS", "INFERENCE_NUM_THREADS", "PERFORMANCE_HINT"}) {
    if (char* v = api->property(compiled->model, key)) {
      chosen += std::string(chosen.empty() ? "" : ", ") + key + "=" + Take(api, v);
    }
  }
  Log(LogLevel::kInfo,
      "OpenVINO compiled " + spec.file.filename().string() + " for the CPU, " + layout + " (" + chosen + ")",
      {{"model", spec.model_name}});
  return compiled;
}

class OvOpenedModel final : public OpenedModel {
 public:
  // `widened`: the caller will ask for a wide instance (it counted one in
  // the instances it opened the model for).
  OvOpenedModel(std::shared_ptr<const Compiled> compiled, CompileSpec spec, int cores, bool wide, bool widened)
      : compiled_(std::move(compiled)), spec_(std::move(spec)), cores_(cores), wide_(wide) {
    if (!wide_ || !widened || cores_ < 2) spec_.read.reset();  // no other compile to share it with
  }
  Result<std::unique_ptr<Model>> NewInstance(const ModelConfig& config, const InstanceDevice& device) override {
    if (device.gpu) return Err(InvalidArgument("model '" + config.name + "': OpenVINO runs it on the CPU only"));
    return Instance(config, compiled_);
  }

  // One stream on every core: a compile of its own (OpenVINO fixes a
  // compiled model's threads per stream), unless the configuration chose
  // the streams or the hint itself.
  Result<std::unique_ptr<Model>> NewWideInstance(const ModelConfig& config) override {
    if (!wide_ || cores_ < 2) return std::unique_ptr<Model>();
    std::call_once(wide_once_, [&] {
      CompileSpec wide = spec_;
      wide.props["NUM_STREAMS"] = "1";
      wide.props["INFERENCE_NUM_THREADS"] = std::to_string(cores_);
      auto compiled = CompileModel(compiled_->api, wide, "one stream on every core");
      if (compiled) {
        wide_compiled_ = std::move(*compiled);
      } else {  // optional: the instances serve without it
        Log(LogLevel::kWarning, "no wide instance: " + compiled.error().message(), {{"model", config.name}});
      }
      spec_.read.reset();
    });
    if (!wide_compiled_) return std::unique_ptr<Model>();
    return Instance(config, wide_compiled_);
  }

 private:
  static Result<std::unique_ptr<Model>> Instance(const ModelConfig& config,
                                                 const std::shared_ptr<const Compiled>& compiled) {
    std::vector<std::string> outputs;
    for (const auto& o : config.outputs) outputs.push_back(o.name);
    auto model = std::make_unique<OvModel>(config.name, compiled, std::move(outputs));
    QUERN_RETURN_IF_ERROR(model->Load());
    return std::unique_ptr<Model>(std::move(model));
  }

  std::shared_ptr<const Compiled> compiled_;
  CompileSpec spec_;
  int cores_;
  bool wide_;
  std::once_flag wide_once_;
  std::shared_ptr<const Compiled> wide_compiled_;
};

// A whole number parameter in [1, 1024], or an error naming it.
Status PositiveParameter(const std::string& who, const std::string& key, const std::string& v) {
  int n = 0;
  const auto parsed = std::from_chars(v.data(), v.data() + v.size(), n);
  if (parsed.ec != std::errc() || parsed.ptr != v.data() + v.size() || n < 1 || n > 1024) {
    return InvalidArgument(who + ": parameter " + key + " must be a whole number in [1, 1024], got \"" + v + "\"");
  }
  return Status::Ok();
}

// OpenVINO's compile properties from the configuration's parameters.
Result<std::map<std::string, std::string>> Properties(const ModelConfig& config, int cores) {
  const std::string who = "model '" + config.name + "'";
  std::map<std::string, std::string> props;
  const std::map<std::string, std::vector<std::string>> choices = {
      {"PERFORMANCE_HINT", {"LATENCY", "THROUGHPUT", "CUMULATIVE_THROUGHPUT"}},
      {"INFERENCE_PRECISION_HINT", {"f32", "bf16", "f16"}},
  };
  for (const auto& [key, value] : config.parameters) {
    if (key == "NUM_STREAMS" || key == "INFERENCE_NUM_THREADS") {
      QUERN_RETURN_IF_ERROR(PositiveParameter(who, key, value));
      props[key] = value;
    } else if (auto it = choices.find(key); it != choices.end()) {
      if (std::find(it->second.begin(), it->second.end(), value) == it->second.end()) {
        std::string listed;
        for (const auto& c : it->second) listed += (listed.empty() ? "" : ", ") + c;
        return Err(
            InvalidArgument(who + ": parameter " + key + " must be one of " + listed + ", got \"" + value + "\""));
      }
      props[key] = value;
    }
  }
  if (!props.count("NUM_STREAMS") && !props.count("PERFORMANCE_HINT")) {
    props["NUM_STREAMS"] = std::to_string(std::max(1, CpuInstances(config)));
  }
  if (!props.count("INFERENCE_NUM_THREADS")) props["INFERENCE_NUM_THREADS"] = std::to_string(std::max(1, cores));
  return props;
}

class OpenvinoBackend final : public Backend {
 public:
  Result<std::unique_ptr<OpenedModel>> Open(ModelConfig& config, const std::filesystem::path& file,
                                            bool has_config_file, int cores, int instances) override {
    const std::string who = "model '" + config.name + "'";
    const bool widened = instances > CpuInstances(config);
    std::error_code ec;
    if (!std::filesystem::is_regular_file(file, ec)) {
      return Err(NotFound(who + ": " + file.string() +
                          " does not exist (an OpenVINO model is <version>/model.xml beside model.bin, or "
                          "<version>/model.onnx)"));
    }
    CompileSpec spec;
    spec.model_name = config.name;
    spec.file = file;
    QUERN_ASSIGN_OR_RETURN(spec.props, Properties(config, cores));
    auto plugin = OpenvinoPlugin();
    if (!plugin) return Err(Unavailable(who + ": " + plugin.error().message()));
    const QuernOvApi* api = *plugin;
    for (const auto& in : config.inputs) {
      if (in.optional) {
        return Err(InvalidArgument(who + ": input '" + in.name + "' is optional; OpenVINO models take every input"));
      }
    }
    // A configured batch over 1: the first dimension of every input made
    // dynamic (a file exported at batch 1 serves max_batch_size 1 as it is).
    const int batch_dynamic = has_config_file && config.max_batch_size > 1 ? 1 : 0;
    char* error = nullptr;
    auto read = std::make_shared<ReadModel>();
    read->api = api;
    read->read = api->read(file.c_str(), batch_dynamic, &error);
    if (!read->read) {
      return Err(InvalidArgument(who + ": OpenVINO cannot read " + file.string() + ": " + Take(api, error)));
    }
    spec.read = std::move(read);
    std::call_once(idle_once_,
                   [this] { idle_ = std::make_shared<IdleRelease>(RealClockInstance(), kRunMemoryIdleNs); });
    spec.idle = idle_;
    const int streams = std::max(1, CpuInstances(config));
    QUERN_ASSIGN_OR_RETURN(
        std::shared_ptr<Compiled> compiled,
        CompileModel(api, spec, streams > 1 ? "a stream per instance" : "one stream for its instance"));
    OnnxModelIO io;
    for (int side = 0; side < 2; ++side) {
      const QuernOvPort* ports = nullptr;
      const int n = api->ports(compiled->model, side, &ports);
      for (int i = 0; i < n; ++i) {
        OnnxTensorInfo t;
        t.name = ports[i].name;
        if (t.name.empty()) {
          return Err(InvalidArgument(who + ": " + (side ? "output " : "input ") + std::to_string(i) +
                                     " has no name (Quern addresses tensors by name)"));
        }
        t.dtype = static_cast<DataType>(ports[i].dtype);
        if (ports[i].rank < 0) {
          return Err(InvalidArgument(
              who + ": tensor '" + t.name + "' has " +
              (ports[i].rank == -1 ? "a dynamic rank, which Quern cannot batch" : "over 8 dimensions")));
        }
        t.shape.assign(ports[i].dims, ports[i].dims + ports[i].rank);
        (side ? io.outputs : io.inputs).push_back(std::move(t));
      }
    }
    QUERN_RETURN_IF_ERROR(CompleteConfigFromOnnx(config, io, has_config_file));
    const bool wide = !config.parameters.count("NUM_STREAMS") && !config.parameters.count("PERFORMANCE_HINT") &&
                      !config.parameters.count("INFERENCE_NUM_THREADS");
    return std::unique_ptr<OpenedModel>(
        std::make_unique<OvOpenedModel>(std::move(compiled), spec, cores, wide, widened));
  }

  std::string WhyNoGpu() const override { return "Quern runs OpenVINO models on the CPU only"; }
  // A run is bounded by its inputs and runs no code of the user's.
  bool RunsOnCallerThreads() const override { return true; }
  std::string RuntimeVersion() const override {
    auto plugin = OpenvinoPlugin();
    return plugin ? std::string("OpenVINO ") + (*plugin)->version : "";
  }

 private:
  std::once_flag idle_once_;
  std::shared_ptr<IdleRelease> idle_;  // gives idle compiled models' run memory back
};

}  // namespace

std::shared_ptr<Backend> NewOpenvinoBackend() {
  return std::make_shared<OpenvinoBackend>();
}

Status SaveOpenvinoIr(const std::filesystem::path& model_file, const std::filesystem::path& xml_file, bool f16) {
  QUERN_ASSIGN_OR_RETURN(const QuernOvApi* api, OpenvinoPlugin());
  char* error = nullptr;
  if (api->save_ir(model_file.c_str(), xml_file.c_str(), f16 ? 1 : 0, &error) != 0) {
    return InvalidArgument("OpenVINO cannot write " + model_file.string() + " as " + xml_file.string() + ": " +
                           Take(api, error));
  }
  return Status::Ok();
}

}  // namespace quern
