// The LibTorch plugin (see torch_plugin_api.h): TorchScript modules loaded
// and run for Quern's PyTorch backend. Every LibTorch exception stops here
// and goes back as an error message.
#include <ATen/Parallel.h>
#include <torch/script.h>
#include <torch/version.h>

#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <string>
#include <vector>

#include "backends/pytorch/torch_plugin_api.h"

namespace {

// quern::DataType values (include/quern/tensor.h) and LibTorch's types.
struct TypePair {
  uint8_t quern;
  c10::ScalarType torch;
};
constexpr TypePair kTypes[] = {
    {1, c10::kBool}, {2, c10::kByte},  {6, c10::kChar},   {7, c10::kShort},   {8, c10::kInt},
    {9, c10::kLong}, {10, c10::kHalf}, {11, c10::kFloat}, {12, c10::kDouble}, {14, c10::kBFloat16},
};

bool ToTorch(uint8_t quern, c10::ScalarType& out) {
  for (const auto& t : kTypes) {
    if (t.quern == quern) {
      out = t.torch;
      return true;
    }
  }
  return false;
}

uint8_t ToQuern(c10::ScalarType torch) {
  for (const auto& t : kTypes) {
    if (t.torch == torch) return t.quern;
  }
  return 0;
}

char* Copy(const std::string& s) {
  char* p = static_cast<char*>(std::malloc(s.size() + 1));
  if (p) std::memcpy(p, s.c_str(), s.size() + 1);
  return p;
}

// LibTorch's messages carry a C++ backtrace after the first lines.
std::string Message(const std::exception& e) {
  if (const auto* c10 = dynamic_cast<const c10::Error*>(&e)) return c10->what_without_backtrace();
  return e.what();
}

struct Result {
  std::vector<at::Tensor> tensors;
  std::vector<QuernTorchTensor> views;
};

int SetThreads(int intra_op) {
  static std::once_flag once;
  std::call_once(once, [intra_op] {
    if (intra_op > 0) at::set_num_threads(intra_op);
    // Inter-op parallelism (forked subgraphs) would start a second pool.
    try {
      at::set_num_interop_threads(1);
    } catch (const std::exception&) {  // already started: left as it is
    }
  });
  return at::get_num_threads();
}

void* Load(const char* path, char** error) {
  try {
    auto module = std::make_unique<torch::jit::Module>(torch::jit::load(path, c10::Device(c10::kCPU)));
    module->eval();
    return module.release();
  } catch (const std::exception& e) {
    *error = Copy(Message(e));
    return nullptr;
  }
}

void Unload(void* module) {
  delete static_cast<torch::jit::Module*>(module);
}

char* Arguments(void* module) {
  std::string names;
  try {
    const auto& schema = static_cast<torch::jit::Module*>(module)->get_method("forward").function().getSchema();
    const auto& args = schema.arguments();
    for (size_t i = 1; i < args.size(); ++i) {  // 0 is self
      names += args[i].name() + (args[i].default_value() ? "=" : "") + "\n";
    }
  } catch (const std::exception&) {  // no forward(): run() says so
  }
  return Copy(names);
}

// One output of forward(): a tensor, or a tuple or list of them.
bool Collect(const c10::IValue& v, std::vector<at::Tensor>& out, std::string& why) {
  if (v.isTensor()) {
    out.push_back(v.toTensor());
    return true;
  }
  if (v.isTuple()) {
    for (const auto& e : v.toTupleRef().elements()) {
      if (!e.isTensor()) {
        why = "forward() returned a tuple holding a " + e.tagKind() + ", not only tensors";
        return false;
      }
      out.push_back(e.toTensor());
    }
    return true;
  }
  if (v.isTensorList()) {
    for (const at::Tensor& t : v.toTensorVector()) out.push_back(t);
    return true;
  }
  why = "forward() returned a " + v.tagKind() + "; Quern takes a tensor, or a tuple or list of tensors";
  return false;
}

void* Run(void* module, const QuernTorchTensor* inputs, int n_inputs, const QuernTorchTensor** outputs, int* n_outputs,
          char** error) {
  try {
    c10::InferenceMode inference;
    std::vector<c10::IValue> args;
    args.reserve(static_cast<size_t>(n_inputs));
    for (int i = 0; i < n_inputs; ++i) {
      const QuernTorchTensor& in = inputs[i];
      c10::ScalarType type;
      if (!ToTorch(in.dtype, type)) {
        *error = Copy("input " + std::to_string(i) + ": LibTorch has no tensor type for Quern's type " +
                      std::to_string(in.dtype));
        return nullptr;
      }
      // A copy: forward() may write into its inputs (x.relu_(), x += 1,
      // inference mode allows it), and the caller's bytes may be shared
      // (an ensemble's tensor, an embedding caller's array) or read-only.
      args.emplace_back(torch::from_blob(in.data, c10::IntArrayRef(in.dims, static_cast<size_t>(in.rank)),
                                         torch::TensorOptions().dtype(type))
                            .clone());
    }
    auto result = std::make_unique<Result>();
    std::string why;
    {
      c10::IValue out = static_cast<torch::jit::Module*>(module)->forward(args);
      if (!Collect(out, result->tensors, why)) {
        *error = Copy(why);
        return nullptr;
      }
    }
    args.clear();
    for (at::Tensor& t : result->tensors) {
      if (t.device().type() != c10::kCPU) t = t.to(c10::kCPU);
      t = t.contiguous();
      // The caller borrows a result's bytes, and may be handed them as a
      // writable array: a result that shares its memory with anything else
      // (the module's parameter or buffer, a view of one, another result)
      // is copied, so that neither side changes the other.
      if (t.use_count() > 1 || t.storage().use_count() > 1) t = t.clone();
      QuernTorchTensor v{};
      v.dtype = ToQuern(t.scalar_type());
      if (t.dim() > 8) {
        *error = Copy("forward() returned a tensor of rank " + std::to_string(t.dim()) + " (at most 8)");
        return nullptr;
      }
      v.rank = static_cast<int32_t>(t.dim());
      for (int64_t d = 0; d < t.dim(); ++d) v.dims[d] = t.size(d);
      v.data = t.data_ptr();
      v.bytes = t.nbytes();
      result->views.push_back(v);
    }
    *outputs = result->views.data();
    *n_outputs = static_cast<int>(result->views.size());
    return result.release();
  } catch (const std::exception& e) {
    *error = Copy(Message(e));
    return nullptr;
  }
}

void Release(void* result) {
  delete static_cast<Result*>(result);
}

void FreeString(char* s) {
  std::free(s);
}

const QuernTorchApi kApi = {
    QUERN_TORCH_PLUGIN_ABI, TORCH_VERSION, SetThreads, Load, Unload, Arguments, Run, Release, FreeString};

}  // namespace

extern "C" __attribute__((visibility("default"))) const QuernTorchApi* quern_torch_api(void) {
  return &kApi;
}
