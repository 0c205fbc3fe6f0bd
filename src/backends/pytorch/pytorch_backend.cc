#include "backends/pytorch/pytorch_backend.h"

#include <algorithm>
#include <charconv>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "backends/plugin_loader.h"
#include "backends/pytorch/torch_plugin_api.h"
#include "core/log.h"

namespace quern {
namespace {

// The plugin, loaded once per process (never unloaded: LibTorch's threads
// and static state outlive any model).
Result<const QuernTorchApi*> TorchPlugin() {
  static std::once_flag once;
  static const QuernTorchApi* api = nullptr;
  static std::string error;
  std::call_once(once, [] {
    PluginLocation where;
    where.env = "QUERN_PYTORCH_PLUGIN";
#ifdef QUERN_PYTORCH_PLUGIN_PATH
    where.from_bin = QUERN_PYTORCH_PLUGIN_FROM_BIN;
    where.from_lib = QUERN_PYTORCH_PLUGIN_FROM_LIB;
    where.build_path = QUERN_PYTORCH_PLUGIN_PATH;
#endif
    where.symbol = "quern_torch_api";
    where.what = "LibTorch plugin";
    where.missing =
        "this build of Quern has no LibTorch plugin (LibTorch was not found when it was built: "
        "scripts/setup.sh installs it)";
    where.accept = [](void* symbol) {
      const auto* found = reinterpret_cast<QuernTorchApiFn>(symbol)();
      return found && found->abi == QUERN_TORCH_PLUGIN_ABI;
    };
    auto loaded = LoadPlugin(where);
    if (!loaded) {
      error = loaded.error().message();
      return;
    }
    const QuernTorchApi* found = reinterpret_cast<QuernTorchApiFn>(loaded->symbol)();
    if (!found || found->abi != QUERN_TORCH_PLUGIN_ABI) {
      error =
          "cannot load Quern's LibTorch plugin (" + loaded->path + ": not a LibTorch plugin of this version of Quern)";
      return;
    }
    api = found;
    Log(LogLevel::kInfo, "LibTorch plugin " + loaded->path + " (LibTorch " + found->version + ")");
  });
  if (!api) return Err(Unavailable(error));
  return api;
}

// The number a Triton-style name ends with ("INPUT__3", "image__0" -> 3, 0),
// or -1.
int IndexedName(const std::string& name) {
  const size_t at = name.rfind("__");
  if (at == std::string::npos || at == 0 || at + 2 == name.size()) return -1;
  int n = -1;
  const char* begin = name.data() + at + 2;
  const char* end = name.data() + name.size();
  const auto parsed = std::from_chars(begin, end, n);
  if (parsed.ec != std::errc() || parsed.ptr != end || n < 0 || n > 1'000'000) return -1;
  return n;
}

// Where each configured tensor goes: forward()'s argument or result
// position, by the number its name ends with when every name has one
// (Triton's <name>__<index>), else in the configuration's order.
Result<std::vector<int>> Positions(const std::vector<TensorConfig>& tensors, const std::string& who, const char* what) {
  std::vector<int> pos(tensors.size());
  bool all = true;
  for (size_t i = 0; i < tensors.size(); ++i) {
    pos[i] = IndexedName(tensors[i].name);
    all = all && pos[i] >= 0;
  }
  if (!all) {
    for (size_t i = 0; i < tensors.size(); ++i) pos[i] = static_cast<int>(i);
    return pos;
  }
  for (size_t i = 0; i < pos.size(); ++i) {
    for (size_t j = 0; j < i; ++j) {
      if (pos[i] == pos[j]) {
        return Err(InvalidArgument(who + ": " + what + "s '" + tensors[j].name + "' and '" + tensors[i].name +
                                   "' have the same number"));
      }
    }
  }
  return pos;
}

// The inputs' places among forward()'s arguments (`arguments`: one line per
// argument after self, "name" or "name=" with a default): by name when
// every input names an argument, else as Positions says. The inputs are
// forward()'s first arguments (they go by position); the others need
// defaults.
Result<std::vector<int>> InputPositions(const std::vector<TensorConfig>& inputs, const std::string& arguments,
                                        const std::string& who) {
  std::vector<std::string> names;
  std::vector<bool> defaulted;
  for (size_t at = 0; at < arguments.size();) {
    size_t end = arguments.find('\n', at);
    if (end == std::string::npos) end = arguments.size();
    std::string name = arguments.substr(at, end - at);
    const bool has_default = !name.empty() && name.back() == '=';
    if (has_default) name.pop_back();
    names.push_back(std::move(name));
    defaulted.push_back(has_default);
    at = end + 1;
  }
  std::vector<int> pos(inputs.size(), -1);
  bool by_name = true;
  for (size_t i = 0; i < inputs.size() && by_name; ++i) {
    auto it = std::find(names.begin(), names.end(), inputs[i].name);
    if (it == names.end()) {
      by_name = false;
    } else {
      pos[i] = static_cast<int>(it - names.begin());
    }
  }
  if (!by_name) {
    QUERN_ASSIGN_OR_RETURN(pos, Positions(inputs, who, "input"));
  }
  std::string listed;
  for (const auto& n : names) listed += (listed.empty() ? "" : ", ") + n;
  std::vector<bool> given(names.size(), false);
  for (size_t i = 0; i < inputs.size(); ++i) {
    // Arguments are passed by position: the inputs are the first ones.
    if (pos[i] >= static_cast<int>(std::min(inputs.size(), names.size()))) {
      return Err(InvalidArgument(who + ": input '" + inputs[i].name + "' would be argument " + std::to_string(pos[i]) +
                                 " of forward(" + listed + "), which takes the " + std::to_string(inputs.size()) +
                                 " inputs as its first arguments"));
    }
    given[static_cast<size_t>(pos[i])] = true;
  }
  for (size_t a = 0; a < names.size(); ++a) {
    if (!given[a] && !defaulted[a]) {
      return Err(InvalidArgument(who + ": forward()'s argument '" + names[a] + "' gets no input (forward(" + listed +
                                 "); inputs go by argument name, else by the number after '__', else in order)"));
    }
  }
  return pos;
}

struct TorchSpec {
  std::string name;
  std::string file;
  int max_batch_size = 0;
  std::vector<TensorConfig> inputs, outputs;
  std::vector<int> output_pos;
};

class TorchModel final : public Model {
 public:
  TorchModel(const QuernTorchApi* api, std::shared_ptr<const TorchSpec> spec) : api_(api), spec_(std::move(spec)) {}
  ~TorchModel() override {
    if (module_) api_->unload(module_);
  }

  Status Load() override {
    char* error = nullptr;
    module_ = api_->load(spec_->file.c_str(), &error);
    if (!module_) return Unavailable(Who() + ": LibTorch cannot load " + spec_->file + ": " + Take(error));
    QUERN_ASSIGN_OR_RETURN(input_pos_, InputPositions(spec_->inputs, Take(api_->arguments(module_)), Who()));
    return Status::Ok();
  }

  Status Execute(const std::vector<NamedTensor>& inputs, int64_t batch_size,
                 std::vector<NamedTensor>& outputs) override {
    const size_t n = spec_->inputs.size();
    std::vector<QuernTorchTensor> args(n);
    for (size_t i = 0; i < n; ++i) {
      const std::string& name = spec_->inputs[i].name;
      const NamedTensor* in = nullptr;
      for (const auto& t : inputs) {
        if (t.name == name) in = &t;
      }
      if (!in) return InvalidArgument(Who() + ": input '" + name + "' is missing");
      const Shape& shape = in->tensor.shape();
      if (shape.size() > 8) return InvalidArgument(Who() + ": input '" + name + "' has more than 8 dimensions");
      QuernTorchTensor& a = args[static_cast<size_t>(input_pos_[i])];
      a.dtype = static_cast<uint8_t>(in->tensor.dtype());
      a.rank = static_cast<int32_t>(shape.size());
      std::copy(shape.begin(), shape.end(), a.dims);
      // LibTorch views the bytes without writing them (inference mode).
      a.data = const_cast<std::byte*>(in->tensor.data());
      a.bytes = in->tensor.byte_size();
    }
    const QuernTorchTensor* results = nullptr;
    int count = 0;
    char* error = nullptr;
    void* handle = api_->run(module_, args.data(), static_cast<int>(n), &results, &count, &error);
    if (!handle) return Internal(Who() + ": LibTorch: " + Take(error));
    std::shared_ptr<void> owner(handle, [api = api_](void* h) { api->release(h); });
    outputs.clear();
    outputs.reserve(spec_->outputs.size());
    for (size_t i = 0; i < spec_->outputs.size(); ++i) {
      const TensorConfig& want = spec_->outputs[i];
      const int at = spec_->output_pos[i];
      if (at >= count) {
        return Internal(Who() + ": output '" + want.name + "' is result " + std::to_string(at) + " of forward(), " +
                        "which returned " + std::to_string(count) + " tensor" + (count == 1 ? "" : "s"));
      }
      const QuernTorchTensor& r = results[at];
      const auto type = static_cast<DataType>(r.dtype);
      if (type != want.dtype) {
        return Internal(
            Who() + ": output '" + want.name + "' is " +
            (r.dtype == 0 ? std::string("of a type Quern has no name for") : std::string(DataTypeName(type))) +
            ", the configuration says " + std::string(DataTypeName(want.dtype)));
      }
      Shape shape(r.dims, r.dims + r.rank);
      if (spec_->max_batch_size > 0 && (shape.empty() || shape[0] != batch_size)) {
        return Internal(Who() + ": output '" + want.name + "' has shape " + ShapeToString(shape) + " for a batch of " +
                        std::to_string(batch_size) + " (its first dimension must be the batch)");
      }
      outputs.push_back({want.name, Tensor::Borrow(type, std::move(shape), r.data, r.bytes, owner)});
    }
    return Status::Ok();
  }

 private:
  std::string Who() const { return "model '" + spec_->name + "'"; }
  std::string Take(char* error) const {
    std::string s = error ? error : "unknown error";
    if (error) api_->free_string(error);
    return s;
  }

  const QuernTorchApi* api_;
  std::shared_ptr<const TorchSpec> spec_;
  void* module_ = nullptr;
  std::vector<int> input_pos_;  // each configured input's place among forward()'s arguments
};

class TorchOpenedModel final : public OpenedModel {
 public:
  TorchOpenedModel(const QuernTorchApi* api, std::shared_ptr<const TorchSpec> spec)
      : api_(api), spec_(std::move(spec)) {}
  Result<std::unique_ptr<Model>> NewInstance(const ModelConfig&, const InstanceDevice&) override {
    auto model = std::make_unique<TorchModel>(api_, spec_);
    QUERN_RETURN_IF_ERROR(model->Load());
    return std::unique_ptr<Model>(std::move(model));
  }

 private:
  const QuernTorchApi* api_;
  std::shared_ptr<const TorchSpec> spec_;
};

class PytorchBackend final : public Backend {
 public:
  Result<std::unique_ptr<OpenedModel>> Open(ModelConfig& config, const std::filesystem::path& file,
                                            bool has_config_file, int cores, int /*instances*/) override {
    const std::string who = "model '" + config.name + "'";
    if (!has_config_file || config.inputs.empty() || config.outputs.empty()) {
      return Err(InvalidArgument(who + ": a PyTorch model needs a config.pbtxt listing its inputs and outputs " +
                                 "(a TorchScript file declares no types or shapes)"));
    }
    std::error_code ec;
    if (!std::filesystem::is_regular_file(file, ec)) {
      return Err(NotFound(who + ": " + file.string() + " does not exist (a PyTorch model is <version>/" +
                          file.filename().string() + ", a TorchScript module)"));
    }
    for (const auto* list : {&config.inputs, &config.outputs}) {
      for (const auto& t : *list) {
        if (t.optional) {
          return Err(InvalidArgument(who + ": input '" + t.name + "' is optional; forward() takes every input"));
        }
        if (t.dims.size() + (config.max_batch_size > 0 ? 1 : 0) > 8) {
          return Err(InvalidArgument(who + ": tensor '" + t.name + "' has more than 8 dimensions"));
        }
        switch (t.dtype) {
          case DataType::kBytes:
          case DataType::kUint16:
          case DataType::kUint32:
          case DataType::kUint64:
          case DataType::kInvalid:
            return Err(InvalidArgument(who + ": tensor '" + t.name + "' has type " +
                                       std::string(DataTypeName(t.dtype)) + ", which LibTorch does not have"));
          default: break;
        }
      }
    }
    auto spec = std::make_shared<TorchSpec>();
    spec->name = config.name;
    spec->file = file.string();
    spec->max_batch_size = config.max_batch_size;
    spec->inputs = config.inputs;
    spec->outputs = config.outputs;
    QUERN_ASSIGN_OR_RETURN(spec->output_pos, Positions(config.outputs, who, "output"));

    // Every core by default, whatever the instances: they share the one
    // pool, and Debian's LibTorch 1.13 runs convolutions an order of
    // magnitude slower on one thread than on two (bench/torch_bench.sh).
    int threads = std::max(1, cores);
    if (auto it = config.parameters.find("intra_op_thread_count"); it != config.parameters.end()) {
      const std::string& v = it->second;
      const auto parsed = std::from_chars(v.data(), v.data() + v.size(), threads);
      if (parsed.ec != std::errc() || parsed.ptr != v.data() + v.size() || threads < 1 || threads > 1024) {
        return Err(InvalidArgument(who +
                                   ": parameter intra_op_thread_count must be a whole number in [1, 1024], "
                                   "got \"" +
                                   v + "\""));
      }
    }
    QUERN_ASSIGN_OR_RETURN(const QuernTorchApi* api, TorchPlugin());
    const int in_force = api->set_threads(threads);
    if (in_force != threads) {
      Log(LogLevel::kInfo,
          "LibTorch's intra-op threads are " + std::to_string(in_force) + " (set once per process), not " +
              std::to_string(threads),
          {{"model", config.name}});
    }
    return std::unique_ptr<OpenedModel>(std::make_unique<TorchOpenedModel>(api, std::move(spec)));
  }

  std::string WhyNoGpu() const override { return "the LibTorch it is built with (Debian's) runs on the CPU only"; }
};

}  // namespace

std::shared_ptr<Backend> NewPytorchBackend() {
  return std::make_shared<PytorchBackend>();
}

}  // namespace quern
