#include "backends/onnxruntime/ort_shared_weights.h"

#include <onnxruntime_session_options_config_keys.h>
#include <stdlib.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <fstream>
#include <new>
#include <set>
#include <string_view>
#include <system_error>

#include "backends/onnxruntime/ort_internal.h"
#include "onnx_subset.pb.h"

namespace quern {
namespace {

constexpr char kOptimizedModel[] = "model.onnx";
constexpr char kWeightsFile[] = "weights.bin";
// Initializers smaller than this stay inside the optimized graph, one copy
// per session (shapes, scalars, biases of a few values).
constexpr char kExternalMinBytes[] = "1024";
constexpr size_t kAlignment = 64;

size_t AlignUp(size_t n) {
  return (n + kAlignment - 1) / kAlignment * kAlignment;
}

bool ParseSize(std::string_view s, size_t& out) {
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), out);
  return ec == std::errc() && p == s.data() + s.size();
}

// A private directory for the optimized model (mode 0700).
Result<std::filesystem::path> MakeTempDir() {
  std::error_code ec;
  std::filesystem::path base = std::filesystem::temp_directory_path(ec);
  if (ec) return Err(Internal("no temporary directory: " + ec.message()));
  std::string templ = (base / "quern-model-XXXXXX").string();
  if (!mkdtemp(templ.data())) {
    return Err(Internal("cannot create a directory in " + base.string() + ": " +
                        std::error_code(errno, std::generic_category()).message()));
  }
  return std::filesystem::path(templ);
}

// One initializer of the optimized graph whose data is in the weights file.
struct ExternalTensor {
  std::string name;
  ONNXTensorElementDataType type = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  std::vector<int64_t> dims;
  size_t offset = 0;
  size_t length = 0;
};

// The initializers of `graph` that can be shared: data in the weights file,
// a fixed-size element type, a length that matches the shape, not a graph
// input.
std::vector<ExternalTensor> Shareable(const onnx::GraphProto& graph, size_t file_size) {
  std::set<std::string> inputs;
  for (const auto& in : graph.input()) inputs.insert(in.name());
  std::vector<ExternalTensor> out;
  for (const auto& t : graph.initializer()) {
    if (t.data_location() != onnx::TensorProto::EXTERNAL || inputs.count(t.name())) continue;
    ExternalTensor e;
    e.name = t.name();
    e.type = static_cast<ONNXTensorElementDataType>(t.data_type());
    const DataType dtype = FromOrt(e.type);
    if (dtype == DataType::kInvalid || dtype == DataType::kBytes) continue;
    std::string location;
    bool ok = true;
    for (const auto& kv : t.external_data()) {
      if (kv.key() == "location") location = kv.value();
      if (kv.key() == "offset") ok = ok && ParseSize(kv.value(), e.offset);
      if (kv.key() == "length") ok = ok && ParseSize(kv.value(), e.length);
    }
    size_t elements = 1;
    for (int64_t d : t.dims()) {
      if (d < 0) ok = false;
      elements *= static_cast<size_t>(std::max<int64_t>(d, 0));
      e.dims.push_back(d);
    }
    if (!ok || location != kWeightsFile || e.length == 0 || e.length != elements * DataTypeByteSize(dtype) ||
        e.offset > file_size || e.length > file_size - e.offset) {
      continue;
    }
    out.push_back(std::move(e));
  }
  return out;
}

}  // namespace

void SharedOnnxWeights::AlignedFree::operator()(std::byte* p) const {
  ::operator delete[](p, std::align_val_t(kAlignment));
}

Result<std::shared_ptr<SharedOnnxWeights>> SharedOnnxWeights::Create(const std::string& model_name,
                                                                     const std::filesystem::path& file,
                                                                     int graph_optimization_level) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(file, ec)) {
    return Err(NotFound("model '" + model_name + "': model file " + file.string() + " does not exist"));
  }
  std::shared_ptr<SharedOnnxWeights> w(new SharedOnnxWeights());
  auto dir = MakeTempDir();
  if (!dir) return Err(Internal("model '" + model_name + "': sharing weights: " + dir.error().message()));
  w->dir_ = std::move(*dir);
  w->optimized_file_ = w->dir_ / kOptimizedModel;
  try {
    Ort::SessionOptions so;
    so.SetIntraOpNumThreads(1);
    so.SetInterOpNumThreads(1);
    so.SetGraphOptimizationLevel(OrtOptimizationLevel(graph_optimization_level));
    so.SetOptimizedModelFilePath(w->optimized_file_.c_str());
    so.AddConfigEntry(kOrtSessionOptionsOptimizedModelExternalInitializersFileName, kWeightsFile);
    so.AddConfigEntry(kOrtSessionOptionsOptimizedModelExternalInitializersMinSizeInBytes, kExternalMinBytes);
    // Saving a graph optimized for this machine's instructions draws a
    // warning meant for files shipped elsewhere; this one never leaves.
    so.SetLogSeverityLevel(ORT_LOGGING_LEVEL_ERROR);
    Ort::Session optimizer(OrtEnv(), file.c_str(), so);
    w->io_ = DescribeModel(optimizer);
  } catch (const Ort::Exception& e) {
    return Err(
        InvalidArgument("model '" + model_name + "': onnxruntime cannot load " + file.string() + ": " + e.what()));
  } catch (const std::exception& e) {
    return Err(Internal("model '" + model_name + "': optimizing " + file.string() + " failed: " + e.what()));
  }
  try {
    QUERN_RETURN_IF_ERROR(w->Read(model_name));
    Ort::ThrowOnError(Ort::GetApi().CreatePrepackedWeightsContainer(&w->container_));
  } catch (const std::exception& e) {
    return Err(Internal("model '" + model_name + "': sharing weights: " + e.what()));
  }
  return w;
}

Status SharedOnnxWeights::Read(const std::string& model_name) {
  const std::string what = "model '" + model_name + "': sharing weights: ";
  onnx::ModelProto model;
  {
    std::ifstream in(optimized_file_, std::ios::binary);
    if (!in || !model.ParseFromIstream(&in)) {
      return Internal(what + "cannot read the optimized model " + optimized_file_.string());
    }
  }
  const std::filesystem::path weights_file = dir_ / kWeightsFile;
  std::error_code ec;
  const auto file_size = std::filesystem::file_size(weights_file, ec);
  if (ec) return Status::Ok();  // every initializer is small: nothing to share
  std::vector<ExternalTensor> tensors = Shareable(model.graph(), file_size);
  size_t total = 0;
  for (const auto& t : tensors) total += AlignUp(t.length);
  if (total == 0) return Status::Ok();
  buffer_.reset(static_cast<std::byte*>(::operator new[](total, std::align_val_t(kAlignment), std::nothrow)));
  if (!buffer_) return ResourceExhausted(what + "cannot allocate " + std::to_string(total) + " bytes");
  std::ifstream in(weights_file, std::ios::binary);
  if (!in) return Internal(what + "cannot open " + weights_file.string());
  const Ort::MemoryInfo cpu = Ort::MemoryInfo::CreateCpu(OrtDeviceAllocator, OrtMemTypeDefault);
  size_t at = 0;
  for (const auto& t : tensors) {
    std::byte* dst = buffer_.get() + at;
    in.seekg(static_cast<std::streamoff>(t.offset));
    in.read(reinterpret_cast<char*>(dst), static_cast<std::streamsize>(t.length));
    if (!in) return Internal(what + "cannot read '" + t.name + "' from " + weights_file.string());
    values_.push_back(Ort::Value::CreateTensor(cpu, dst, t.length, t.dims.data(), t.dims.size(), t.type));
    names_.push_back(t.name);
    at += AlignUp(t.length);
    shared_bytes_ += t.length;
  }
  return Status::Ok();
}

SharedOnnxWeights::~SharedOnnxWeights() {
  RemoveFiles();
  values_.clear();
  if (container_) Ort::GetApi().ReleasePrepackedWeightsContainer(container_);
}

Ort::Session SharedOnnxWeights::NewSession(Ort::SessionOptions& options) const {
  options.SetGraphOptimizationLevel(ORT_DISABLE_ALL);  // optimized once, in Create
  for (size_t i = 0; i < names_.size(); ++i) options.AddInitializer(names_[i].c_str(), values_[i]);
  if (container_ && !unshareable_packing_.load(std::memory_order_relaxed)) {
    try {
      return Ort::Session(OrtEnv(), optimized_file_.c_str(), options, container_);
    } catch (const Ort::Exception& e) {
      // Some kernels cannot hand their packed weights to a container (the
      // quantized convolutions a QDQ model's graph is fused into): such a
      // model's sessions share the weights but each packs its own.
      if (std::string_view(e.what()).find("pre-packed") == std::string_view::npos) throw;
      unshareable_packing_.store(true, std::memory_order_relaxed);
    }
  }
  return Ort::Session(OrtEnv(), optimized_file_.c_str(), options);
}

void SharedOnnxWeights::RemoveFiles() {
  if (dir_.empty()) return;
  std::error_code ec;
  std::filesystem::remove_all(dir_, ec);
  dir_.clear();
}

}  // namespace quern
