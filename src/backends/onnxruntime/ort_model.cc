#include "backends/onnxruntime/ort_model.h"

#include <dlfcn.h>
#include <onnxruntime_cxx_api.h>
#include <onnxruntime_session_options_config_keys.h>

#include <algorithm>
#include <charconv>
#include <cstdlib>
#include <cstring>
#include <memory_resource>
#include <mutex>
#include <new>

#include "backends/onnxruntime/ort_internal.h"
#include "backends/onnxruntime/ort_shared_weights.h"
#include "core/block_cache.h"
#include "core/memory.h"
#include "quern/clock.h"

#if defined(__SANITIZE_ADDRESS__)
#define QUERN_LSAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define QUERN_LSAN 1
#endif
#endif
#ifdef QUERN_LSAN
#include <sanitizer/lsan_interface.h>
#endif

namespace quern {
namespace {

Result<bool> ParseBool(const std::string& v, const std::string& what) {
  if (v == "1" || v == "true" || v == "TRUE" || v == "True") return true;
  if (v == "0" || v == "false" || v == "FALSE" || v == "False") return false;
  return Err(InvalidArgument(what + ": '" + v + "' is not true/false"));
}

// Thread counts above this per session are refused (a typo such as
// "100000" would otherwise start that many threads while loading).
constexpr int kMaxSessionThreads = 256;

Result<int> ParseThreadCount(const std::string& v, const std::string& what) {
  int n = 0;
  auto [p, ec] = std::from_chars(v.data(), v.data() + v.size(), n);
  if (ec != std::errc() || p != v.data() + v.size() || n < 1 || n > kMaxSessionThreads) {
    return Err(InvalidArgument(what + ": '" + v + "' is not a thread count in [1, " +
                               std::to_string(kMaxSessionThreads) + "]"));
  }
  return n;
}

OnnxTensorInfo Describe(const std::string& name, const Ort::TypeInfo& info) {
  OnnxTensorInfo t;
  t.name = name;
  if (info.GetONNXType() != ONNX_TYPE_TENSOR) return t;  // dtype stays kInvalid
  auto ti = info.GetTensorTypeAndShapeInfo();
  t.dtype = FromOrt(ti.GetElementType());
  t.shape = ti.GetShape();
  for (auto& d : t.shape) {
    if (d < 0) d = -1;
  }
  return t;
}

const OnnxTensorInfo* Find(const std::vector<OnnxTensorInfo>& v, const std::string& name) {
  for (const auto& t : v) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

std::string NameList(const std::vector<OnnxTensorInfo>& v) {
  std::string s;
  for (const auto& t : v) s += (s.empty() ? "" : ", ") + t.name;
  return s;
}

Status CheckAgainstModel(const ModelConfig& c, const TensorConfig& t, const OnnxTensorInfo* m, const char* kind,
                         const std::vector<OnnxTensorInfo>& all) {
  const std::string where = "model '" + c.name + "' " + kind + " '" + t.name + "'";
  if (!m) return InvalidArgument(where + " is not in the ONNX model (it has: " + NameList(all) + ")");
  if (m->dtype != t.dtype) {
    return InvalidArgument(where + ": configured as " + std::string(DataTypeName(t.dtype)) + " but the model has " +
                           std::string(DataTypeName(m->dtype)));
  }
  const Shape& dims = t.reshape ? *t.reshape : t.dims;
  const size_t batch = c.max_batch_size > 0 ? 1 : 0;
  if (m->shape.size() != dims.size() + batch) {
    return InvalidArgument(where + ": configured dims " + ShapeToString(dims) +
                           (batch ? " (plus the batch dimension)" : "") + " do not match the model's shape " +
                           ShapeToString(m->shape));
  }
  for (size_t i = 0; i < dims.size(); ++i) {
    int64_t md = m->shape[i + batch];
    if (md >= 0 && dims[i] != md) {
      return InvalidArgument(where + ": configured dims " + ShapeToString(dims) + " do not match the model's shape " +
                             ShapeToString(m->shape));
    }
  }
  return Status::Ok();
}

}  // namespace

namespace {

// The CPU allocator every session uses (session.use_env_allocators): a
// model's instances share the memory their runs need, and a run's large
// buffers come from a BlockCache (core/block_cache.h): reused run after run,
// returned to the system once unused for its idle time, where ONNX Runtime's
// arena kept what the largest batch ever run needed until the end.
class RunMemory final : public OrtAllocator {
 public:
  // ONNX Runtime's allocators throw when memory runs out (the run fails, the
  // server stays): a null pointer would be written through.
  explicit RunMemory(BlockCache& cache) : OrtAllocator{}, cache_(cache) {
    version = 18;  // the fields set here: Alloc, Free, Info and Reserve (API 18)
    OrtAllocator::Alloc = [](OrtAllocator* self, size_t size) {
      void* p = static_cast<RunMemory*>(self)->cache_.Alloc(size);
      if (p == nullptr) throw std::bad_alloc();
      return p;
    };
    OrtAllocator::Free = [](OrtAllocator* self, void* p) { static_cast<RunMemory*>(self)->cache_.Free(p); };
    OrtAllocator::Info = [](const OrtAllocator* self) -> const OrtMemoryInfo* {
      return static_cast<const RunMemory*>(self)->info_;
    };
    // What a session keeps from its start to its end (its weights): not kept for runs, not
    // counted as a run's.
    OrtAllocator::Reserve = [](OrtAllocator* self, size_t size) {
      void* p = static_cast<RunMemory*>(self)->cache_.AllocLasting(size);
      if (p == nullptr) throw std::bad_alloc();
      return p;
    };
  }

 private:
  BlockCache& cache_;
  Ort::MemoryInfo info_ = Ort::MemoryInfo::CreateCpu(OrtDeviceAllocator, OrtMemTypeDefault);
};

}  // namespace

BlockCache& OrtRunMemory() {
  static BlockCache* cache = [] {
    BlockCache::Options o;
    o.on_idle = ReturnFreedMemory;  // what the runs' small buffers left in the C library's lists too
    return new BlockCache(std::move(o), RealClockInstance());
  }();
  return *cache;
}

void OrtReturnIdleMemory() {
  OrtRunMemory().ReturnKept();
  ReturnFreedMemory();
}

Ort::Env& OrtEnv() {
  static Ort::Env* env = [] {
    // ONNX Runtime 1.29 and later start Microsoft's telemetry on Linux when
    // the environment is created: an uploader that sends usage events over
    // the network, a device identifier and an event database under
    // ~/.cache, a session file and logs in the temporary directory. A server
    // neither phones home nor writes outside what it is given:
    // ORT_DISABLE_TELEMETRY=1, read at this point, turns all of it off. A
    // value the user set stays.
    setenv("ORT_DISABLE_TELEMETRY", "1", /*overwrite=*/0);
#ifdef QUERN_LSAN
    // ONNX Runtime 1.30 loses 14 bytes once while it creates its
    // environment (inside the library); what it allocates later, for
    // sessions and runs, is still checked for leaks.
    __lsan_disable();
    auto* e = new Ort::Env(ORT_LOGGING_LEVEL_WARNING, "quern");
    __lsan_enable();
#else
    auto* e = new Ort::Env(ORT_LOGGING_LEVEL_WARNING, "quern");
#endif
    e->DisableTelemetryEvents();
    static RunMemory* run_memory = new RunMemory(OrtRunMemory());  // outlives every session
    Ort::ThrowOnError(Ort::GetApi().RegisterAllocator(*e, run_memory));
    return e;
  }();
  return *env;
}

DataType FromOrt(ONNXTensorElementDataType t) {
  switch (t) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL: return DataType::kBool;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8: return DataType::kUint8;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT16: return DataType::kUint16;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT32: return DataType::kUint32;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT64: return DataType::kUint64;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8: return DataType::kInt8;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT16: return DataType::kInt16;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32: return DataType::kInt32;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64: return DataType::kInt64;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16: return DataType::kFp16;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT: return DataType::kFp32;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_DOUBLE: return DataType::kFp64;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_STRING: return DataType::kBytes;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16: return DataType::kBf16;
    default: return DataType::kInvalid;
  }
}

GraphOptimizationLevel OrtOptimizationLevel(int level) {
  if (level < 0) return ORT_DISABLE_ALL;
  if (level == 1) return ORT_ENABLE_BASIC;
  if (level == 2) return ORT_ENABLE_EXTENDED;
  return ORT_ENABLE_ALL;
}

ONNXTensorElementDataType ToOrt(DataType t) {
  switch (t) {
    case DataType::kBool: return ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL;
    case DataType::kUint8: return ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8;
    case DataType::kUint16: return ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT16;
    case DataType::kUint32: return ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT32;
    case DataType::kUint64: return ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT64;
    case DataType::kInt8: return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8;
    case DataType::kInt16: return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT16;
    case DataType::kInt32: return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
    case DataType::kInt64: return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
    case DataType::kFp16: return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
    case DataType::kFp32: return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
    case DataType::kFp64: return ONNX_TENSOR_ELEMENT_DATA_TYPE_DOUBLE;
    case DataType::kBytes: return ONNX_TENSOR_ELEMENT_DATA_TYPE_STRING;
    case DataType::kBf16: return ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16;
    default: return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  }
}

Result<OrtSessionOptions> SessionOptionsFor(const ModelConfig& c, int cores) {
  OrtSessionOptions o;
  o.intra_op_threads = std::max(1, cores / std::max(1, c.instance_count));
  o.graph_optimization_level = c.graph_optimization_level;
  const std::string m = "model '" + c.name + "' parameter ";
  if (auto it = c.parameters.find("intra_op_thread_count"); it != c.parameters.end()) {
    auto v = ParseThreadCount(it->second, m + it->first);
    if (!v) return Err(v.error());
    o.intra_op_threads = *v;
  }
  if (auto it = c.parameters.find("inter_op_thread_count"); it != c.parameters.end()) {
    auto v = ParseThreadCount(it->second, m + it->first);
    if (!v) return Err(v.error());
    o.inter_op_threads = *v;
  }
  const int64_t threads =
      int64_t{std::max(1, c.instance_count)} * (o.intra_op_threads + std::max(0, o.inter_op_threads));
  if (threads > 4 * kMaxSessionThreads) {
    return Err(InvalidArgument("model '" + c.name + "': " + std::to_string(c.instance_count) + " instances x " +
                               std::to_string(o.intra_op_threads) + " intra-op threads would start " +
                               std::to_string(threads) + " threads; at most " + std::to_string(4 * kMaxSessionThreads) +
                               " are allowed per model"));
  }
  for (auto [key, field] : {std::pair{"allow_spinning", &o.allow_spinning},
                            std::pair{"stop_spinning_after_run", &o.stop_spinning_after_run}}) {
    if (auto it = c.parameters.find(key); it != c.parameters.end()) {
      auto v = ParseBool(it->second, m + it->first);
      if (!v) return Err(v.error());
      *field = *v;
    }
  }
  return o;
}

Result<OrtSessionOptions> SessionOptionsForGpu(const ModelConfig& c, int device) {
  QUERN_ASSIGN_OR_RETURN(OrtSessionOptions o, SessionOptionsFor(c, /*cores=*/1));
  o.gpu_device = device;
  return o;
}

std::string OrtWhyNoCuda() {
  Dl_info info{};
  if (dladdr(reinterpret_cast<const void*>(&OrtGetApiBase), &info) == 0 || !info.dli_fname) {
    return "the folder of libonnxruntime could not be found";
  }
  const std::filesystem::path dir = std::filesystem::path(info.dli_fname).parent_path();
  const std::filesystem::path provider = dir / "libonnxruntime_providers_cuda.so";
  std::error_code ec;
  if (!std::filesystem::is_regular_file(provider, ec)) {
    return "ONNX Runtime's CUDA execution provider is not installed (no " + provider.string() +
           "; scripts/setup.sh installs it when QUERN_WITH_CUDA=1)";
  }
  return "";
}

Status CompleteConfigFromOnnx(ModelConfig& c, const OnnxModelIO& io, bool has_config_file) {
  for (const auto* list : {&io.inputs, &io.outputs}) {
    for (const auto& t : *list) {
      if (t.dtype == DataType::kInvalid) {
        return InvalidArgument("model '" + c.name + "': tensor '" + t.name +
                               "' is not a tensor of a supported element type");
      }
    }
  }
  if (!has_config_file) {
    bool batchable = true;
    for (const auto* list : {&io.inputs, &io.outputs}) {
      for (const auto& t : *list) batchable = batchable && !t.shape.empty() && t.shape[0] == -1;
    }
    c.max_batch_size = batchable ? kDefaultMaxBatchSize : 0;
    if (batchable) c.batching = BatchingConfig{};
  }
  const size_t skip = c.max_batch_size > 0 ? 1 : 0;
  auto derive = [&](const std::vector<OnnxTensorInfo>& from, std::vector<TensorConfig>& to) {
    for (const auto& t : from) {
      TensorConfig tc;
      tc.name = t.name;
      tc.dtype = t.dtype;
      if (t.shape.size() >= skip) tc.dims.assign(t.shape.begin() + static_cast<std::ptrdiff_t>(skip), t.shape.end());
      to.push_back(std::move(tc));
    }
  };
  if (c.inputs.empty()) derive(io.inputs, c.inputs);
  if (c.outputs.empty()) derive(io.outputs, c.outputs);

  for (const auto& t : c.inputs)
    QUERN_RETURN_IF_ERROR(CheckAgainstModel(c, t, Find(io.inputs, t.name), "input", io.inputs));
  for (const auto& t : c.outputs) {
    QUERN_RETURN_IF_ERROR(CheckAgainstModel(c, t, Find(io.outputs, t.name), "output", io.outputs));
  }
  for (const auto& t : io.inputs) {
    if (!c.FindInput(t.name)) {
      return InvalidArgument("model '" + c.name + "': the ONNX model's input '" + t.name +
                             "' is missing from the configuration");
    }
  }
  // A batched model whose ONNX batch dimension is static runs only at that size.
  if (c.max_batch_size > 0) {
    int64_t fixed = -1;
    for (const auto& t : io.inputs) {
      if (!t.shape.empty() && t.shape[0] >= 0) fixed = t.shape[0];
    }
    if (fixed > 0) {
      if (c.fixed_batch_sizes.empty() && fixed == c.max_batch_size) {
        c.fixed_batch_sizes = {static_cast<int>(fixed)};
      } else if (c.fixed_batch_sizes != std::vector<int>{static_cast<int>(fixed)}) {
        return InvalidArgument("model '" + c.name + "': the ONNX model's batch dimension is fixed at " +
                               std::to_string(fixed) + "; set max_batch_size: " + std::to_string(fixed) +
                               " and parameters { key: \"quern.fixed_batch_sizes\" value { string_value: \"" +
                               std::to_string(fixed) + "\" } }");
      }
    }
  }
  return Status::Ok();
}

struct OrtModel::Session {
  Ort::Session session{nullptr};
  Ort::MemoryInfo cpu = Ort::MemoryInfo::CreateCpu(OrtArenaAllocator, OrtMemTypeDefault);
  Ort::RunOptions run_options;
  std::vector<std::string> output_names;
  std::vector<const char*> output_cnames;
};

OrtModel::OrtModel(std::string model_name, std::filesystem::path file, OrtSessionOptions options,
                   std::vector<std::string> output_names, std::shared_ptr<const SharedOnnxWeights> weights)
    : model_name_(std::move(model_name)),
      file_(std::move(file)),
      options_(options),
      output_names_(std::move(output_names)),
      weights_(std::move(weights)) {}

OrtModel::~OrtModel() = default;

OnnxModelIO DescribeModel(const Ort::Session& session) {
  Ort::AllocatorWithDefaultOptions alloc;
  OnnxModelIO io;
  for (size_t i = 0; i < session.GetInputCount(); ++i) {
    io.inputs.push_back(Describe(session.GetInputNameAllocated(i, alloc).get(), session.GetInputTypeInfo(i)));
  }
  for (size_t i = 0; i < session.GetOutputCount(); ++i) {
    io.outputs.push_back(Describe(session.GetOutputNameAllocated(i, alloc).get(), session.GetOutputTypeInfo(i)));
  }
  return io;
}

namespace {

// Adds ONNX Runtime's CUDA execution provider on `device` to `so`.
Status AppendCuda(Ort::SessionOptions& so, int device) {
  const OrtApi& api = Ort::GetApi();
  OrtCUDAProviderOptionsV2* cuda = nullptr;
  auto fail = [&](OrtStatus* st) {
    std::string m = "ONNX Runtime's CUDA execution provider on GPU " + std::to_string(device) +
                    " cannot be used: " + api.GetErrorMessage(st);
    api.ReleaseStatus(st);
    return FailedPrecondition(std::move(m));
  };
  if (OrtStatus* st = api.CreateCUDAProviderOptions(&cuda)) return fail(st);
  std::unique_ptr<OrtCUDAProviderOptionsV2, void (*)(OrtCUDAProviderOptionsV2*)> owned(
      cuda, [](OrtCUDAProviderOptionsV2* p) { Ort::GetApi().ReleaseCUDAProviderOptions(p); });
  const std::string id = std::to_string(device);
  const char* keys[] = {"device_id"};
  const char* values[] = {id.c_str()};
  if (OrtStatus* st = api.UpdateCUDAProviderOptions(cuda, keys, values, 1)) return fail(st);
  if (OrtStatus* st = api.SessionOptionsAppendExecutionProvider_CUDA_V2(so, cuda)) return fail(st);
  return Status::Ok();
}

}  // namespace

std::unique_ptr<OrtModel> OrtModel::Share() const {
  auto other = std::make_unique<OrtModel>(model_name_, file_, options_, output_names_, weights_);
  other->io_ = io_;
  other->session_ = session_;
  return other;
}

Status OrtModel::Load() {
  if (session_) return Status::Ok();  // a session shared (Share)
  std::error_code ec;
  if (!weights_ && !std::filesystem::is_regular_file(file_, ec)) {
    return NotFound("model '" + model_name_ + "': model file " + file_.string() + " does not exist");
  }
  try {
    Ort::SessionOptions so;
    so.SetIntraOpNumThreads(options_.intra_op_threads);
    so.SetInterOpNumThreads(options_.inter_op_threads);
    so.SetExecutionMode(ORT_SEQUENTIAL);
    so.AddConfigEntry(kOrtSessionOptionsConfigUseEnvAllocators, "1");
    so.AddConfigEntry(kOrtSessionOptionsConfigAllowIntraOpSpinning, options_.allow_spinning ? "1" : "0");
    so.AddConfigEntry(kOrtSessionOptionsConfigAllowInterOpSpinning, options_.allow_spinning ? "1" : "0");
    if (options_.stop_spinning_after_run) so.AddConfigEntry(kOrtSessionOptionsConfigForceSpinningStop, "1");
    if (options_.gpu_device >= 0) {
      OrtEnv();  // the provider logs through the environment's logger: it must exist first
      Status st = AppendCuda(so, options_.gpu_device);
      if (!st.ok()) return Status(st.code(), "model '" + model_name_ + "': " + st.message());
    }

    auto s = std::make_unique<Session>();
    if (weights_) {
      s->session = weights_->NewSession(so);
    } else {
      so.SetGraphOptimizationLevel(OrtOptimizationLevel(options_.graph_optimization_level));
      s->session = Ort::Session(OrtEnv(), file_.c_str(), so);
    }
    io_ = DescribeModel(s->session);
    if (output_names_.empty()) {
      for (const auto& o : io_.outputs) s->output_names.push_back(o.name);
    } else {
      s->output_names = output_names_;
    }
    for (const auto& n : s->output_names) s->output_cnames.push_back(n.c_str());
    session_ = std::move(s);
  } catch (const Ort::Exception& e) {
    const std::string where = options_.gpu_device >= 0 ? " on GPU " + std::to_string(options_.gpu_device) : "";
    return InvalidArgument("model '" + model_name_ + "': onnxruntime cannot load " + file_.string() + where + ": " +
                           e.what());
  } catch (const std::exception& e) {
    return Internal("model '" + model_name_ + "': loading " + file_.string() + " failed: " + e.what());
  }
  return Status::Ok();
}

Status OrtModel::Execute(const std::vector<NamedTensor>& inputs, int64_t /*batch_size*/,
                         std::vector<NamedTensor>& outputs) {
  return Run(inputs, outputs, nullptr);
}

Status OrtModel::ExecuteRequests(const std::vector<NamedTensor>& inputs, int64_t /*batch_size*/, BatchRequests requests,
                                 std::vector<NamedTensor>& outputs) {
  return Run(inputs, outputs, requests.interrupt);
}

Status OrtModel::Run(const std::vector<NamedTensor>& inputs, std::vector<NamedTensor>& outputs,
                     BatchInterrupt* interrupt) {
  if (!session_) return FailedPrecondition("model '" + model_name_ + "' is not loaded");
  // A run that may be stopped has run options of its own (runs may go on
  // beside it on the same session: ExecutesConcurrently).
  std::optional<Ort::RunOptions> own;
  Ort::RunOptions* run_options = &session_->run_options;
  struct Disarm {
    BatchInterrupt* interrupt;
    ~Disarm() {
      if (interrupt) interrupt->Disarm();
    }
  } disarm{nullptr};
  try {
    if (interrupt) {
      own.emplace();
      run_options = &*own;
      interrupt->Arm([run_options] { run_options->SetTerminate(); });
      disarm.interrupt = interrupt;
    }
    // The call's arrays live on the stack for a few inputs and outputs.
    alignas(std::max_align_t) std::byte scratch[512];
    std::pmr::monotonic_buffer_resource arena(scratch, sizeof(scratch));
    std::pmr::vector<const char*> names(&arena);
    std::pmr::vector<Ort::Value> values(&arena);
    names.reserve(inputs.size());
    values.reserve(inputs.size());
    for (const auto& in : inputs) {
      const Tensor& t = in.tensor;
      names.push_back(in.name.c_str());
      if (t.dtype() == DataType::kBytes) {
        auto strings = t.Strings();
        if (!strings) return strings.error();
        Ort::AllocatorWithDefaultOptions alloc;
        Ort::Value v =
            Ort::Value::CreateTensor(alloc, t.shape().data(), t.shape().size(), ONNX_TENSOR_ELEMENT_DATA_TYPE_STRING);
        for (size_t i = 0; i < strings->size(); ++i) {
          const auto& s = (*strings)[i];
          char* dst = v.GetResizedStringTensorElementBuffer(i, s.size());
          if (!s.empty()) std::memcpy(dst, s.data(), s.size());
        }
        values.push_back(std::move(v));
      } else {
        values.push_back(Ort::Value::CreateTensor(session_->cpu, const_cast<std::byte*>(t.data()), t.byte_size(),
                                                  t.shape().data(), t.shape().size(), ToOrt(t.dtype())));
      }
    }
    std::pmr::vector<Ort::Value> results(&arena);
    results.reserve(session_->output_cnames.size());
    for (size_t i = 0; i < session_->output_cnames.size(); ++i) results.emplace_back(nullptr);
    session_->session.Run(*run_options, names.data(), values.data(), values.size(), session_->output_cnames.data(),
                          results.data(), results.size());
    outputs.clear();
    outputs.reserve(results.size());
    for (size_t i = 0; i < results.size(); ++i) {
      auto info = results[i].GetTensorTypeAndShapeInfo();
      Shape shape = info.GetShape();
      DataType dtype = FromOrt(info.GetElementType());
      if (dtype == DataType::kBytes) {
        const size_t n = info.GetElementCount();
        std::vector<std::string> strs(n);
        for (size_t k = 0; k < n; ++k) {
          strs[k].resize(results[i].GetStringTensorElementLength(k));
          results[i].GetStringTensorElement(strs[k].size(), k, strs[k].data());
        }
        outputs.push_back({session_->output_names[i], Tensor::FromStrings(std::move(shape), strs)});
        continue;
      }
      const size_t bytes = info.GetElementCount() * DataTypeByteSize(dtype);
      auto owner = std::make_shared<Ort::Value>(std::move(results[i]));
      const void* data = owner->GetTensorRawData();
      outputs.push_back(
          {session_->output_names[i], Tensor::Borrow(dtype, std::move(shape), data, bytes, std::move(owner))});
    }
  } catch (const Ort::Exception& e) {
    if (interrupt && interrupt->stopped()) {
      return Cancelled("model '" + model_name_ + "': every request of the batch was cancelled; its run was stopped");
    }
    return Internal("model '" + model_name_ + "': onnxruntime failed to run the batch: " + e.what());
  } catch (const std::exception& e) {
    return Internal("model '" + model_name_ + "': running the batch failed: " + e.what());
  }
  return Status::Ok();
}

}  // namespace quern
