#include "backends/auto_backend.h"

#include <dlfcn.h>
#include <fcntl.h>
#include <openssl/evp.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <map>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "core/half.h"
#include "core/log.h"
#include "core/memory.h"
#include "engine/warmup.h"

namespace quern {
namespace {

// How long each candidate is measured (after one warm-up run), and how many
// runs at most.
constexpr double kMeasureSeconds = 0.6;
constexpr int kMaxRuns = 15;
// A candidate agrees when every output lies within this share of FP32's
// largest value (or of 1e-3, when all are smaller): at f32, rounding only
// (measured: 1e-6); at bf16 (8 bits of mantissa against 24) the check
// input's outputs move by a few percent (measured on a noise input: the
// classifier 4.2 %, the detector 3.5 %, whose boxes on photographs stay
// within IoU 0.9, tests/python/test_openvino.py).
constexpr double kAgreementF32 = 1e-3;
// A check input larger than this (elements per input) is not made up.
constexpr int64_t kMaxCheckElements = int64_t{1} << 24;
constexpr double kAgreementBf16 = 0.05;

// Whether the CPU computes bf16 natively (AVX512_BF16 or AMX), unless
// QUERN_NO_BF16 says to act as if not.
bool CpuHasBf16() {
  if (const char* off = std::getenv("QUERN_NO_BF16"); off && *off && std::strcmp(off, "0") != 0) return false;
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpuinfo, line)) {
    if (line.rfind("flags", 0) != 0) continue;
    return line.find(" avx512_bf16") != std::string::npos || line.find(" amx_bf16") != std::string::npos;
  }
  return false;
}

struct Candidate {
  std::string label;    // "openvino bf16"
  std::string backend;  // "openvino"
  Backend* runtime = nullptr;
  std::map<std::string, std::string> parameters;
  ModelConfig config;
  std::unique_ptr<OpenedModel> opened;
  std::vector<NamedTensor> outputs;
  double ms = std::numeric_limits<double>::infinity();  // what is compared (see Measure)
  double instance_ms = 0, wide_ms = 0;
  double error = 0;      // against FP32
  std::string meaning;   // what EngineOptions::compare_answers compared ("" = nothing)
  std::string left_out;  // why it was not a choice
};

// A check input for every configured input: batch 1, open dimensions 64,
// values in [0, 1) (whole numbers 0-9). Empty with `why` set when a type
// cannot be made up (strings).
std::vector<NamedTensor> CheckInputs(const ModelConfig& config, std::string& why) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> unit(0.f, 1.f);
  std::vector<NamedTensor> inputs;
  // The batch the model runs: 1, or its smallest fixed size.
  const int64_t batch = config.fixed_batch_sizes.empty()
                            ? 1
                            : *std::min_element(config.fixed_batch_sizes.begin(), config.fixed_batch_sizes.end());
  for (const auto& in : config.inputs) {
    Shape shape;
    if (config.max_batch_size > 0) shape.push_back(batch);
    // What the model receives: the configured reshape when there is one.
    for (int64_t d : in.reshape ? *in.reshape : in.dims) shape.push_back(d < 0 ? (shape.empty() ? 1 : 64) : d);
    int64_t n = 1;
    for (int64_t d : shape) n = d >= 0 && (d == 0 || n <= kMaxCheckElements / d) ? n * d : kMaxCheckElements + 1;
    const size_t size = DataTypeByteSize(in.dtype);
    if (size == 0) {
      why = "input '" + in.name + "' is " + std::string(DataTypeName(in.dtype));
      return {};
    }
    if (n > kMaxCheckElements) {
      why = "input '" + in.name + "' would take over 16M elements";
      return {};
    }
    Tensor t = Tensor::Allocate(in.dtype, shape, static_cast<size_t>(n) * size);
    std::byte* p = t.mutable_data();
    for (int64_t i = 0; i < n; ++i) {
      const float v = unit(rng);
      switch (in.dtype) {
        case DataType::kFp32: std::memcpy(p + i * 4, &v, 4); break;
        case DataType::kFp64: {
          const double d = v;
          std::memcpy(p + i * 8, &d, 8);
          break;
        }
        case DataType::kFp16: {
          const uint16_t h = FloatToHalf(v);
          std::memcpy(p + i * 2, &h, 2);
          break;
        }
        case DataType::kBf16: {
          uint32_t bits;
          std::memcpy(&bits, &v, 4);
          const auto h = static_cast<uint16_t>(bits >> 16);
          std::memcpy(p + i * 2, &h, 2);
          break;
        }
        case DataType::kBool: p[i] = std::byte{v < 0.5f}; break;
        default: {
          // Whole numbers 0-9 in the type's width (little-endian).
          const auto k = static_cast<uint64_t>(v * 10);
          std::memcpy(p + i * static_cast<int64_t>(size), &k, size);
        }
      }
    }
    inputs.push_back({in.name, std::move(t)});
  }
  return inputs;
}

double AsDouble(const Tensor& t, int64_t i) {
  const std::byte* p = t.data() + i * static_cast<int64_t>(DataTypeByteSize(t.dtype()));
  switch (t.dtype()) {
    case DataType::kFp32: {
      float v;
      std::memcpy(&v, p, 4);
      return v;
    }
    case DataType::kFp64: {
      double v;
      std::memcpy(&v, p, 8);
      return v;
    }
    case DataType::kInt64: {
      int64_t v;
      std::memcpy(&v, p, 8);
      return static_cast<double>(v);
    }
    case DataType::kInt32: {
      int32_t v;
      std::memcpy(&v, p, 4);
      return v;
    }
    case DataType::kFp16: {
      uint16_t h;
      std::memcpy(&h, p, 2);
      return HalfToFloat(h);
    }
    case DataType::kBf16: {
      uint16_t h;
      std::memcpy(&h, p, 2);
      const uint32_t bits = static_cast<uint32_t>(h) << 16;
      float v;
      std::memcpy(&v, &bits, 4);
      return v;
    }
    case DataType::kInt16: {
      int16_t v;
      std::memcpy(&v, p, 2);
      return v;
    }
    case DataType::kUint16: {
      uint16_t v;
      std::memcpy(&v, p, 2);
      return v;
    }
    case DataType::kUint32: {
      uint32_t v;
      std::memcpy(&v, p, 4);
      return v;
    }
    case DataType::kUint64: {
      uint64_t v;
      std::memcpy(&v, p, 8);
      return static_cast<double>(v);
    }
    case DataType::kUint8:
    case DataType::kBool: return static_cast<double>(static_cast<uint8_t>(*p));
    case DataType::kInt8: return static_cast<double>(static_cast<int8_t>(*p));
    default: return std::numeric_limits<double>::quiet_NaN();  // BYTES: not compared (see Disagreement)
  }
}

// The largest difference from `want`, over the largest |want| (or 1e-3);
// infinity when the shapes or types differ, or a value is not a number.
double Disagreement(const std::vector<NamedTensor>& want, const std::vector<NamedTensor>& got) {
  double worst = 0;
  for (const auto& w : want) {
    auto it = std::find_if(got.begin(), got.end(), [&](const NamedTensor& g) { return g.name == w.name; });
    if (it == got.end() || it->tensor.shape() != w.tensor.shape() || it->tensor.dtype() != w.tensor.dtype() ||
        DataTypeByteSize(w.tensor.dtype()) == 0) {
      return std::numeric_limits<double>::infinity();  // BYTES outputs cannot be compared: left out
    }
    const DataType type = w.tensor.dtype();
    const bool real =
        type == DataType::kFp32 || type == DataType::kFp64 || type == DataType::kFp16 || type == DataType::kBf16;
    const int64_t n = static_cast<int64_t>(w.tensor.byte_size() / DataTypeByteSize(type));
    double scale = 1e-3, diff = 0;
    for (int64_t i = 0; i < n; ++i) {
      const double a = AsDouble(w.tensor, i), b = AsDouble(it->tensor, i);
      // Whole numbers (class ids, indices, counts) and what is not finite
      // (-inf masks, NaN) must be the same; NaN matches NaN.
      if (!real || !std::isfinite(a) || !std::isfinite(b)) {
        if (a != b && !(std::isnan(a) && std::isnan(b))) return std::numeric_limits<double>::infinity();
        continue;
      }
      scale = std::max(scale, std::fabs(a));
      diff = std::max(diff, std::fabs(a - b));
    }
    worst = std::max(worst, diff / scale);
  }
  return worst;
}

// The median time (ms) of `model` running `inputs`, after the run whose
// outputs are `first`.
Result<double> MedianMs(Model& model, const std::vector<NamedTensor>& inputs, int64_t batch,
                        std::vector<NamedTensor>& first) {
  QUERN_RETURN_IF_ERROR(model.Execute(inputs, batch, first));  // warm-up
  std::vector<double> ms;
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(kMeasureSeconds);
  // One timed run at least, then as many as fit in the time (a model that
  // runs for seconds is timed once).
  while (static_cast<int>(ms.size()) < kMaxRuns && (ms.empty() || std::chrono::steady_clock::now() < until)) {
    std::vector<NamedTensor> out;
    const auto start = std::chrono::steady_clock::now();
    QUERN_RETURN_IF_ERROR(model.Execute(inputs, batch, out));
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

// Runs `c` on `inputs` as the engine would serve it: on one instance (a
// request among others, the instance's share of the cores) and, where the
// layout has one, on the wide instance (a lone request on every core). Its
// outputs (the instance's), and its time: the geometric mean of the two.
Status Measure(Candidate& c, const std::vector<NamedTensor>& inputs, bool with_wide) {
  const int64_t batch = c.config.max_batch_size > 0 && !inputs.empty() ? inputs.front().tensor.shape().front() : 1;
  {
    QUERN_ASSIGN_OR_RETURN(auto model, c.opened->NewInstance(c.config, InstanceDevice{}));
    QUERN_ASSIGN_OR_RETURN(c.instance_ms, MedianMs(*model, inputs, batch, c.outputs));
  }
  c.ms = c.instance_ms;
  if (with_wide) {
    QUERN_ASSIGN_OR_RETURN(auto wide, c.opened->NewWideInstance(c.config));
    if (wide) {
      std::vector<NamedTensor> out;
      QUERN_ASSIGN_OR_RETURN(c.wide_ms, MedianMs(*wide, inputs, batch, out));
      c.ms = std::sqrt(c.instance_ms * c.wide_ms);
    }
  }
  return Status::Ok();
}

std::string DescribeCandidate(const Candidate& c) {
  char buf[96];
  if (!c.left_out.empty()) {
    // One line, and no "; " (the table's separator): runtimes' messages span lines.
    std::string why = c.left_out;
    for (char& ch : why) {
      if (ch == '\n' || ch == '\r' || ch == ';') ch = ' ';
    }
    return c.label + ": " + why;
  }
  std::string out = c.label;
  std::snprintf(buf, sizeof buf, ": %.3g ms", c.ms);
  out += buf;
  if (c.wide_ms > 0) {
    std::snprintf(buf, sizeof buf, " (one instance %.3g ms, every core %.3g ms)", c.instance_ms, c.wide_ms);
    out += buf;
  }
  std::snprintf(buf, sizeof buf, ", outputs within %.2g of ONNX Runtime's", c.error);
  out += buf;
  if (!c.meaning.empty()) {
    std::string what = c.meaning;
    for (char& ch : what) {
      if (ch == '\n' || ch == '\r' || ch == ';') ch = ' ';
    }
    out += ", " + what;
  }
  return out;
}

// Why a run of ONNX Runtime this short is not measured against the others:
// what another runtime could save is lost in a request's own cost, and
// times this short are mostly noise.
constexpr double kWorthMeasuringMs = 1.0;
// Another runtime replaces the best so far only when it is this much
// faster (a share of the best's time), so that measurement noise does not
// flip the choice between runtimes that are as fast.
constexpr double kMargin = 0.9;

// The first line of /proc/cpuinfo that starts with `field`, or "".
std::string CpuInfoLine(const char* field) {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpuinfo, line)) {
    if (line.rfind(field, 0) == 0) return line;
  }
  return "";
}

// What a cached choice records.
struct CachedChoice {
  std::string label;     // "openvino bf16"
  std::string openvino;  // OpenVINO's version when it was measured
  std::string measured;  // the table, as logged then
};

// A kept choice: a regular file of this user's, at most 4 KiB (a link, a
// FIFO, another user's file or anything larger is not read).
std::optional<CachedChoice> ReadChoice(const std::filesystem::path& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return std::nullopt;
  struct stat st {};
  std::string text(4096, '\0');
  ssize_t n = -1;
  if (::fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_uid == ::geteuid() && st.st_size <= 4096) {
    n = ::read(fd, text.data(), text.size());
  }
  ::close(fd);
  if (n <= 0) return std::nullopt;
  text.resize(static_cast<size_t>(n));
  CachedChoice c;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    const auto eq = line.find('=');
    if (eq == std::string::npos) continue;
    const std::string key = line.substr(0, eq), value = line.substr(eq + 1);
    if (key == "choice") c.label = value;
    if (key == "openvino") c.openvino = value;
    if (key == "measured") c.measured = value;
  }
  if (c.label.empty()) return std::nullopt;
  return c;
}

// Whether any of the model's instances is placed on a GPU.
bool AnyOnGpu(const ModelConfig& config) {
  return std::any_of(config.instance_groups.begin(), config.instance_groups.end(),
                     [](const InstanceGroup& g) { return g.kind == InstanceGroup::Kind::kGpu; });
}

// The file holding this code (the quern binary, or libquern): a rebuilt or
// upgraded Quern measures again.
std::string OwnBuild() {
  Dl_info info{};
  struct stat st {};
  if (::dladdr(reinterpret_cast<const void*>(&CpuHasBf16), &info) == 0 || !info.dli_fname ||
      ::stat(info.dli_fname, &st) != 0) {
    return "";
  }
  return std::to_string(st.st_size) + " " + std::to_string(st.st_mtim.tv_sec) + "." +
         std::to_string(st.st_mtim.tv_nsec) + " " + std::to_string(st.st_ino);
}

// Why the configuration's first warm-up sample cannot be the check input ("" when it can): it must
// hold a file's data (a sample of zeros or noise says less than the made-up input), be of batch 1
// (the measurement's), give every input the model requires and none other, each of its configured
// type and dims (any size where a dimension is open), and stay under kMaxCheckElements per input.
std::string UnsuitableSample(const ModelConfig& config, const WarmupSample& w) {
  if (w.batch_size != 1 && config.max_batch_size > 0) return "its batch_size is not 1";
  bool from_file = false;
  for (const auto& [name, in] : w.inputs) {
    const TensorConfig* tc = config.FindInput(name);
    if (!tc) return "it names '" + name + "', which is no input of the model";
    // Its dims are the configured ones, a number where the configuration leaves one open.
    bool fits = in.dtype == tc->dtype && in.dims.size() == tc->dims.size();
    for (size_t i = 0; fits && i < in.dims.size(); ++i) fits = tc->dims[i] < 0 || tc->dims[i] == in.dims[i];
    if (!fits) return "its input '" + name + "' is not of the configured type and dims";
    int64_t n = 1;
    for (int64_t d : in.dims) n = d >= 0 && (d == 0 || n <= kMaxCheckElements / d) ? n * d : kMaxCheckElements + 1;
    if (n > kMaxCheckElements || DataTypeByteSize(in.dtype) == 0)
      return "its input '" + name + "' is too large or of strings";
    from_file = from_file || in.fill == WarmupInput::Fill::kFile;
  }
  for (const TensorConfig& tc : config.inputs) {
    if (!tc.optional && !w.inputs.contains(tc.name)) return "it lacks input '" + tc.name + "'";
  }
  return from_file ? "" : "it holds no file's data";
}

// The check input: the configuration's first warm-up sample (Triton's model_warmup: an input its
// author chose, such as a real photograph's tensor) when it suits (UnsuitableSample), else one made
// up (CheckInputs). `rows` is the batch it holds (0 when the model does not batch); `source` names
// it for the log.
std::vector<NamedTensor> CheckInputsFor(const ModelConfig& config, const std::filesystem::path& model_dir,
                                        int64_t& rows, std::string& why, std::string& source) {
  // The log line's parentheses enclose `source`: none inside it.
  auto unparenthesized = [](std::string text) {
    for (char& ch : text) {
      if (ch == '(' || ch == ')') ch = ' ';
    }
    return text;
  };
  source = "the check input";
  if (!config.warmup.empty()) {
    const WarmupSample& w = config.warmup.front();
    if (const std::string unsuitable = UnsuitableSample(config, w); !unsuitable.empty()) {
      source = unparenthesized(source + ", not warm-up sample '" + w.name + "': " + unsuitable);
    } else if (auto sample = WarmupInputs(config, w, model_dir, rows); !sample) {
      source = unparenthesized(source + ", not warm-up sample '" + w.name + "': " + sample.error().message());
    } else {
      source = unparenthesized("its warm-up sample '" + w.name + "'");
      return std::move(*sample);
    }
  }
  auto inputs = CheckInputs(config, why);
  rows = config.max_batch_size > 0 && !inputs.empty() ? inputs.front().tensor.shape().front() : 0;
  return inputs;
}

// Whether the opened candidate `c` runs its check input once (a kept choice is opened so: what
// the measurement did for it).
bool RunsTheCheckInput(Candidate& c, const std::filesystem::path& model_dir) {
  std::string why, source;
  int64_t rows = 0;
  const auto inputs = CheckInputsFor(c.config, model_dir, rows, why, source);
  auto model = c.opened->NewInstance(c.config, InstanceDevice{});
  std::vector<NamedTensor> out;
  return model && (inputs.empty() || (*model)->Execute(inputs, std::max<int64_t>(rows, 1), out).ok());
}

class AutoBackend final : public Backend {
 public:
  AutoBackend(std::shared_ptr<Backend> ort, std::shared_ptr<Backend> ov, std::filesystem::path cache_dir, bool measure)
      : ort_(std::move(ort)), ov_(std::move(ov)), cache_dir_(std::move(cache_dir)), measure_(measure) {}

  void SetServices(const ModelServices& services) override { compare_answers_ = services.compare_answers; }

  // The candidate a choice kept at `path` names, opened with `open` and
  // its check input run once (what the measurement did for it), or null:
  // no such choice, another OpenVINO, or a failure (measured again then).
  template <typename OpenFn>
  Candidate* OpenKept(const std::filesystem::path& path, std::vector<Candidate>& cs, OpenFn& open,
                      const std::filesystem::path& model_dir, const std::string& model) {
    auto cached = ReadChoice(path);
    if (!cached) return nullptr;
    auto it = std::find_if(cs.begin(), cs.end(), [&](const Candidate& c) { return c.label == cached->label; });
    if (it == cs.end() || cached->openvino != ov_->RuntimeVersion()) return nullptr;
    if (auto opened = open(*it); opened) {
      it->opened = std::move(*opened);
      if (!RunsTheCheckInput(*it, model_dir)) it->opened.reset();
    }
    if (!it->opened) return nullptr;
    Log(LogLevel::kInfo, "runtime chosen by measurement (kept in " + path.string() + "): " + cached->measured,
        {{"model", model}});
    return &*it;
  }

  Result<std::unique_ptr<OpenedModel>> Open(ModelConfig& config, const std::filesystem::path& file,
                                            bool has_config_file, int cores, int instances) override {
    // The model's folder (its warm-up files): the repository's name for it; else the file's
    // (<folder>/<version>/model.onnx).
    const std::filesystem::path model_dir =
        !config.model_dir.empty() ? std::filesystem::path(config.model_dir) : file.parent_path().parent_path();
    // ONNX Runtime's CUDA: the only runtime here that runs on a GPU.
    if (AnyOnGpu(config) || !measure_) {
      config.backend = "onnxruntime";
      config.platform = "onnxruntime_onnx";
      Log(LogLevel::kInfo,
          std::string("runtime: onnxruntime, not measured (") +
              (measure_ ? "instances on a GPU" : "this command does not measure runtimes") + ")",
          {{"model", config.name}});
      return ort_->Open(config, file, has_config_file, cores, instances);
    }
    std::vector<Candidate> cs;
    cs.push_back({"onnxruntime", "onnxruntime", ort_.get(), {}});
    cs.push_back({"openvino f32", "openvino", ov_.get(), {{"INFERENCE_PRECISION_HINT", "f32"}}});
    if (CpuHasBf16()) cs.push_back({"openvino bf16", "openvino", ov_.get(), {{"INFERENCE_PRECISION_HINT", "bf16"}}});
    auto open = [&](Candidate& c) {
      c.config = config;
      c.config.backend = c.backend;
      c.config.platform = c.backend == "openvino" ? "openvino" : "onnxruntime_onnx";
      for (const auto& [k, v] : c.parameters) c.config.parameters[k] = v;
      return c.runtime->Open(c.config, file, has_config_file, cores, instances);
    };

    // A choice measured before for these files, this configuration and
    // this machine.
    std::filesystem::path cached_path;
    if (!cache_dir_.empty()) {
      if (auto key = ChoiceKey(config, file, model_dir, cs, cores, instances); !key.empty()) {
        cached_path = cache_dir_ / (key + ".choice");
        if (Candidate* kept = OpenKept(cached_path, cs, open, model_dir, config.name)) {
          config = kept->config;
          return std::move(kept->opened);
        }
      }
    }

    // One candidate open at a time beside the best so far: the reference
    // (ONNX Runtime) is measured first and closed while the others run (its
    // outputs kept to compare theirs with), and opened again if it stays
    // the choice, so the load's peak is about the largest candidate's
    // memory, not the sum of two runtimes' (the default detector: 274 MB
    // against 345 MB).
    Candidate* best = nullptr;
    std::vector<NamedTensor> inputs;
    std::string source = "the check input";
    bool compared = false;  // whether another runtime was measured against ONNX Runtime
    for (auto& c : cs) {
      const bool reference = &c == &cs.front();
      auto opened = open(c);
      if (!opened) {
        if (reference) return Err(opened.error());
        c.left_out = "cannot open it: " + opened.error().message();
        continue;
      }
      c.opened = std::move(*opened);
      if (reference) {
        best = &c;
        std::string why;
        int64_t rows = 0;
        inputs = CheckInputsFor(c.config, model_dir, rows, why, source);
        if (inputs.empty() && !c.config.inputs.empty()) {
          c.left_out = "served without a measurement: " + why;
          break;  // nothing to compare the others on
        }
      }
      // The engine adds a wide instance to an automatic layout of several.
      if (Status st = Measure(c, inputs, instances > c.config.instance_count); !st.ok()) {
        if (reference) {  // the made-up input does not suit the model: ONNX Runtime serves it
          c.left_out = "served without a measurement: " + source + " failed: " + st.message();
          break;
        }
        c.left_out = "cannot run it: " + st.message();
        c.opened.reset();
        c.outputs.clear();
        continue;
      }
      if (reference && c.ms < kWorthMeasuringMs) {
        for (auto& other : cs) {
          if (&other != &c) other.left_out = "not measured: ONNX Runtime's run takes under 1 ms";
        }
        break;
      }
      compared = compared || !reference;
      if (reference && &c != &cs.back()) {
        c.opened.reset();
        ort_->ReturnIdleMemory();  // its runs' buffers too, before another runtime compiles
        continue;
      }
      c.error = reference ? 0 : Disagreement(cs.front().outputs, c.outputs);
      const auto hint = c.parameters.find("INFERENCE_PRECISION_HINT");
      const bool bf16 = hint != c.parameters.end() && hint->second == "bf16";
      if (c.error > (bf16 ? kAgreementBf16 : kAgreementF32)) {
        char buf[64];
        std::snprintf(buf, sizeof buf, "outputs differ from ONNX Runtime's by %.2g", c.error);
        c.left_out = buf;
        c.opened.reset();
        c.outputs.clear();
        continue;
      }
      if (!reference && compare_answers_) {
        const AnswerAgreement same = compare_answers_(c.config, model_dir, cs.front().outputs, c.outputs);
        if (!same.agree) {
          c.left_out = "answers differ from ONNX Runtime's: " + same.detail;
          c.opened.reset();
          c.outputs.clear();
          continue;
        }
        c.meaning = same.detail;
      }
      if (c.ms < best->ms * kMargin) {
        if (best != &cs.front()) {  // the reference stays: its outputs are compared
          best->opened.reset();
          best->outputs.clear();
        }
        best = &c;
      } else if (!reference) {
        c.opened.reset();
        c.outputs.clear();
      }
    }
    if (best != &cs.front()) cs.front().opened.reset();
    if (!best->opened) {    // the reference, closed while the others were measured
      ReturnFreedMemory();  // what the others' compiles left in the C library's lists
      auto again = open(*best);
      if (!again) return Err(again.error());
      best->opened = std::move(*again);
    }
    for (auto& c : cs) {  // after a break: those the loop never reached
      if (&c != best && c.left_out.empty() && !std::isfinite(c.ms)) c.left_out = "not measured";
    }
    std::string table;
    for (const auto& c : cs) {
      if (&c != best) table += (table.empty() ? "" : "; ") + DescribeCandidate(c);
    }
    const std::string measured = DescribeCandidate(*best) + (table.empty() ? "" : "; over " + table);
    Log(LogLevel::kInfo, "runtime chosen by measurement (" + source + "): " + measured, {{"model", config.name}});
    if (compared && !cached_path.empty()) Keep(cached_path, best->label, measured, config.name);
    config = best->config;
    return std::move(best->opened);
  }

  // Instances on a GPU run on ONNX Runtime's CUDA (see Open), as a model
  // without a configuration always has.
  std::string WhyNoGpu() const override { return ort_->WhyNoGpu(); }
  bool GpuByDefault() const override { return ort_->GpuByDefault(); }
  bool RunsOnCallerThreads() const override { return true; }

 private:
  // SHA-256 (hex) of what a measurement depends on: every file of the
  // model's version folder, the configuration's shapes and parameters, the
  // cores and instances, the candidates, ONNX Runtime's version and this
  // CPU. "" when a file cannot be read.
  std::string ChoiceKey(const ModelConfig& config, const std::filesystem::path& file,
                        const std::filesystem::path& model_dir, const std::vector<Candidate>& cs, int cores,
                        int instances) const {
    std::unique_ptr<EVP_MD_CTX, void (*)(EVP_MD_CTX*)> ctx(EVP_MD_CTX_new(), EVP_MD_CTX_free);
    if (!ctx || EVP_DigestInit_ex(ctx.get(), EVP_sha256(), nullptr) != 1) return "";
    auto add = [&](const std::string& s) {
      const uint64_t n = s.size();
      EVP_DigestUpdate(ctx.get(), &n, sizeof n);
      EVP_DigestUpdate(ctx.get(), s.data(), s.size());
    };
    add("quern runtime choice 3");  // 3: a detector's boxes compared too
    add(OwnBuild());
    for (const char* field : {"model name", "flags", "CPU implementer", "CPU part", "Features"})
      add(CpuInfoLine(field));
    add(std::to_string(cores) + " cores, " + std::to_string(instances) + " instances, " +
        std::to_string(config.instance_count) + " configured");
    for (const auto& c : cs) add(c.label);
    add(ort_->RuntimeVersion());
    add(file.filename().string());
    add(std::to_string(config.max_batch_size));
    for (int64_t b : config.fixed_batch_sizes) add(std::to_string(b));
    for (const auto& in : config.inputs) {
      add(in.name + " " + std::string(DataTypeName(in.dtype)));
      for (int64_t d : in.dims) add(std::to_string(d));
      if (in.reshape) {
        add("reshape");
        for (int64_t d : *in.reshape) add(std::to_string(d));
      }
      add(in.optional ? "optional" : "required");
    }
    for (const auto& out : config.outputs) add("output " + out.name);
    for (const auto& [k, v] : config.parameters) add(k + "=" + v);
    // Whether answers are compared by meaning too, and the check input's sample, when the
    // configuration names one (what it is, and its files' sizes and times, not their bytes).
    add(compare_answers_ ? "answers compared" : "numbers compared");
    if (!config.warmup.empty()) {
      const WarmupSample& w = config.warmup.front();
      add("warm-up " + w.name + " " + std::to_string(w.batch_size));
      for (const auto& [name, in] : w.inputs) {
        add(name + " " + std::string(DataTypeName(in.dtype)) + " " + std::to_string(static_cast<int>(in.fill)) + " " +
            in.file);
        for (int64_t d : in.dims) add(std::to_string(d));
        struct stat st {};
        if (in.fill == WarmupInput::Fill::kFile && ::stat((model_dir / "warmup" / in.file).c_str(), &st) == 0) {
          add(std::to_string(st.st_size) + " " + std::to_string(st.st_mtim.tv_sec) + "." +
              std::to_string(st.st_mtim.tv_nsec));
        }
      }
    }
    // The model file's bytes (the file the runtimes read, inside the
    // repository), and the other plain files beside it (external weights)
    // by name, size and time: links are not followed, nothing else read.
    {
      const int fd = ::open(file.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
      struct stat st {};
      if (fd < 0) return "";
      if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        ::close(fd);
        return "";
      }
      std::vector<char> buf(1 << 20);
      ssize_t n;
      while ((n = ::read(fd, buf.data(), buf.size())) > 0)
        EVP_DigestUpdate(ctx.get(), buf.data(), static_cast<size_t>(n));
      ::close(fd);
      if (n < 0) return "";
    }
    std::error_code ec;
    std::vector<std::string> beside;
    for (const auto& entry : std::filesystem::directory_iterator(file.parent_path(), ec)) {
      std::error_code st_ec;
      const auto status = entry.symlink_status(st_ec);
      if (st_ec || !std::filesystem::is_regular_file(status) || entry.path().filename() == file.filename()) continue;
      struct stat st {};
      if (::lstat(entry.path().c_str(), &st) != 0) continue;
      beside.push_back(entry.path().filename().string() + " " + std::to_string(st.st_size) + " " +
                       std::to_string(st.st_mtim.tv_sec) + "." + std::to_string(st.st_mtim.tv_nsec));
      if (beside.size() > 1024) return "";  // not a model's folder
    }
    if (ec) return "";
    std::sort(beside.begin(), beside.end());
    for (const auto& b : beside) add(b);
    unsigned char digest[EVP_MAX_MD_SIZE];
    unsigned int len = 0;
    if (EVP_DigestFinal_ex(ctx.get(), digest, &len) != 1) return "";
    std::string hex;
    for (unsigned int i = 0; i < len; ++i) {
      char h[3];
      std::snprintf(h, sizeof h, "%02x", digest[i]);
      hex += h;
    }
    return hex;
  }

  // Writes a choice (a whole file or none: written aside, then renamed);
  // a cache that cannot be written is said and otherwise ignored.
  void Keep(const std::filesystem::path& path, const std::string& label, const std::string& measured,
            const std::string& model) const {
    std::error_code ec;
    std::filesystem::create_directories(path.parent_path(), ec);
    // A file of its own (created, never opened through a link), renamed
    // over the choice when whole.
    std::string tmp_name = path.string() + ".XXXXXX";
    const int fd = ec ? -1 : ::mkstemp(tmp_name.data());
    const std::filesystem::path tmp = tmp_name;
    if (fd < 0) {
      ec = std::make_error_code(std::errc::io_error);
    } else {
      const std::string text =
          "choice=" + label + "\nopenvino=" + ov_->RuntimeVersion() + "\nmeasured=" + measured + "\n";
      const bool whole =
          ::fchmod(fd, 0644) == 0 && ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size());
      if (::close(fd) != 0 || !whole) ec = std::make_error_code(std::errc::io_error);
    }
    if (!ec) std::filesystem::rename(tmp, path, ec);
    if (ec) {
      if (fd >= 0) std::filesystem::remove(tmp, ec);
      Log(LogLevel::kWarning,
          "cannot keep the runtime chosen in " + path.string() + " (measured again at the next load)",
          {{"model", model}});
    }
  }

  decltype(ModelServices::compare_answers) compare_answers_;
  std::shared_ptr<Backend> ort_, ov_;
  std::filesystem::path cache_dir_;
  bool measure_;
};

}  // namespace

std::shared_ptr<Backend> NewAutoBackend(std::shared_ptr<Backend> onnxruntime, std::shared_ptr<Backend> openvino,
                                        std::filesystem::path cache_dir, bool measure) {
  return std::make_shared<AutoBackend>(std::move(onnxruntime), std::move(openvino), std::move(cache_dir), measure);
}

}  // namespace quern
