#include "core/model_config_parser.h"

#include <google/protobuf/io/tokenizer.h>
#include <google/protobuf/struct.pb.h>
#include <google/protobuf/text_format.h>
#include <google/protobuf/util/json_util.h>

#include <algorithm>
#include <charconv>
#include <set>

namespace quern {
namespace {

class CollectErrors : public google::protobuf::io::ErrorCollector {
 public:
  explicit CollectErrors(const std::string& file) : file_(file) {}
  void AddError(int line, google::protobuf::io::ColumnNumber column, const std::string& message) override {
    if (!first_.empty()) return;
    first_ = file_ + ":" + std::to_string(line + 1) + ":" + std::to_string(column + 1) + ": " + message;
  }
  const std::string& first() const { return first_; }

 private:
  std::string file_;
  std::string first_;
};

DataType FromProtoType(inference::DataType t) {
  // Text format takes any integer for an enum field ("data_type: 32").
  const int v = static_cast<int>(t);
  return v >= 0 && v <= static_cast<int>(DataType::kBf16) ? static_cast<DataType>(v) : DataType::kInvalid;
}
inference::DataType ToProtoType(DataType t) {
  return static_cast<inference::DataType>(static_cast<int>(t));
}

QueuePolicy ConvertQueuePolicy(const inference::ModelQueuePolicy& p) {
  QueuePolicy q;
  q.timeout_action = p.timeout_action() == inference::ModelQueuePolicy::DELAY ? QueuePolicy::TimeoutAction::kDelay
                                                                              : QueuePolicy::TimeoutAction::kReject;
  q.default_timeout_us = p.default_timeout_microseconds();
  q.allow_timeout_override = p.allow_timeout_override();
  q.max_queue_size = p.max_queue_size();
  return q;
}

inference::ModelQueuePolicy QueuePolicyToProto(const QueuePolicy& q) {
  inference::ModelQueuePolicy p;
  p.set_timeout_action(q.timeout_action == QueuePolicy::TimeoutAction::kDelay ? inference::ModelQueuePolicy::DELAY
                                                                              : inference::ModelQueuePolicy::REJECT);
  p.set_default_timeout_microseconds(q.default_timeout_us);
  p.set_allow_timeout_override(q.allow_timeout_override);
  p.set_max_queue_size(q.max_queue_size);
  return p;
}

Result<std::vector<int>> ParseIntList(std::string_view text, const std::string& what) {
  std::vector<int> out;
  size_t pos = 0;
  while (pos <= text.size()) {
    size_t comma = text.find(',', pos);
    if (comma == std::string_view::npos) comma = text.size();
    std::string_view item = text.substr(pos, comma - pos);
    while (!item.empty() && item.front() == ' ') item.remove_prefix(1);
    while (!item.empty() && item.back() == ' ') item.remove_suffix(1);
    int v = 0;
    auto [p, ec] = std::from_chars(item.data(), item.data() + item.size(), v);
    if (item.empty() || ec != std::errc() || p != item.data() + item.size()) {
      return Err(InvalidArgument(what + ": '" + std::string(text) + "' is not a comma-separated list of integers"));
    }
    out.push_back(v);
    pos = comma + 1;
  }
  return out;
}

TensorConfig ConvertInput(const inference::ModelInput& in) {
  TensorConfig t;
  t.name = in.name();
  t.dtype = FromProtoType(in.data_type());
  t.dims.assign(in.dims().begin(), in.dims().end());
  if (in.has_reshape()) t.reshape = Shape(in.reshape().shape().begin(), in.reshape().shape().end());
  t.optional = in.optional();
  return t;
}

TensorConfig ConvertOutput(const inference::ModelOutput& out) {
  TensorConfig t;
  t.name = out.name();
  t.dtype = FromProtoType(out.data_type());
  t.dims.assign(out.dims().begin(), out.dims().end());
  if (out.has_reshape()) t.reshape = Shape(out.reshape().shape().begin(), out.reshape().shape().end());
  t.label_filename = out.label_filename();
  return t;
}

Status ValidateTensors(const ModelConfig& c, const std::vector<TensorConfig>& tensors, const char* kind) {
  std::set<std::string> names;
  for (const auto& t : tensors) {
    const std::string where = "model '" + c.name + "' " + kind + " '" + t.name + "'";
    if (t.name.empty()) return InvalidArgument("model '" + c.name + "': an " + kind + " has no name");
    if (!names.insert(t.name).second) return InvalidArgument(where + " is declared twice");
    if (t.dtype == DataType::kInvalid) return InvalidArgument(where + ": data_type is missing or TYPE_INVALID");
    if (t.dims.size() > kMaxTensorRank) {
      return InvalidArgument(where + ": dims has more than " + std::to_string(kMaxTensorRank) + " dimensions");
    }
    for (int64_t d : t.dims) {
      if (d < -1) return InvalidArgument(where + ": dims " + ShapeToString(t.dims) + " has a dimension below -1");
      if (d > kMaxDim) {
        return InvalidArgument(where + ": dims " + ShapeToString(t.dims) + " has a dimension above " +
                               std::to_string(kMaxDim));
      }
    }
    if (t.reshape) {
      int64_t a = ElementCount(t.dims), b = ElementCount(*t.reshape);
      if (a >= 0 && b >= 0 && a != b) {
        return InvalidArgument(where + ": reshape " + ShapeToString(*t.reshape) + " has " + std::to_string(b) +
                               " elements but dims " + ShapeToString(t.dims) + " has " + std::to_string(a));
      }
    }
  }
  return Status::Ok();
}

}  // namespace

std::vector<int64_t> VersionPolicy::Select(std::vector<int64_t> available) const {
  std::sort(available.begin(), available.end());
  switch (kind) {
    case Kind::kAll: return available;
    case Kind::kSpecific: {
      std::vector<int64_t> out;
      for (int64_t v : available) {
        if (std::find(versions.begin(), versions.end(), v) != versions.end()) out.push_back(v);
      }
      return out;
    }
    case Kind::kLatest: {
      size_t n = std::min<size_t>(std::max<uint32_t>(num_versions, 1), available.size());
      return std::vector<int64_t>(available.end() - static_cast<std::ptrdiff_t>(n), available.end());
    }
  }
  return {};
}

Result<inference::ModelConfig> ParseModelConfigText(std::string_view text, const std::string& file) {
  inference::ModelConfig proto;
  google::protobuf::TextFormat::Parser parser;
  CollectErrors errors(file);
  parser.RecordErrorsTo(&errors);
  if (!parser.ParseFromString(std::string(text), &proto)) {
    return Err(InvalidArgument(errors.first().empty() ? file + ": malformed configuration" : errors.first()));
  }
  return proto;
}

VersionPolicy ConvertVersionPolicy(const inference::ModelConfig& proto) {
  VersionPolicy v;
  if (!proto.has_version_policy()) return v;
  const auto& p = proto.version_policy();
  if (p.has_all()) {
    v.kind = VersionPolicy::Kind::kAll;
  } else if (p.has_specific()) {
    v.kind = VersionPolicy::Kind::kSpecific;
    v.versions.assign(p.specific().versions().begin(), p.specific().versions().end());
  } else if (p.has_latest()) {
    v.num_versions = std::max<uint32_t>(1, p.latest().num_versions());
  }
  return v;
}

namespace {

// A parameter that is "on"/"true" or "off"/"false", when present.
Status OnOffParameter(const ModelConfig& c, std::string_view key, const std::string& source, std::optional<bool>& out) {
  auto it = c.parameters.find(std::string(key));
  if (it == c.parameters.end()) return Status::Ok();
  if (it->second == "on" || it->second == "true") {
    out = true;
  } else if (it->second == "off" || it->second == "false") {
    out = false;
  } else {
    return InvalidArgument(source + ": parameter " + it->first + " must be \"on\" or \"off\", got \"" + it->second +
                           "\"");
  }
  return Status::Ok();
}

// A parameter of milliseconds in [0, 3600000], when present.
Status MillisecondsParameter(const ModelConfig& c, std::string_view key, const std::string& source,
                             std::optional<int64_t>& out) {
  auto it = c.parameters.find(std::string(key));
  if (it == c.parameters.end()) return Status::Ok();
  int64_t ms = -1;
  auto [ptr, ec] = std::from_chars(it->second.data(), it->second.data() + it->second.size(), ms);
  if (ec != std::errc() || ptr != it->second.data() + it->second.size() || ms < 0 || ms > 3'600'000) {
    return InvalidArgument(source + ": parameter " + it->first + " must be milliseconds in [0, 3600000], got \"" +
                           it->second + "\"");
  }
  out = ms;
  return Status::Ok();
}

// An ensemble's steps; what only the loaded step models can tell (their
// inputs, outputs, types) is checked when the ensemble loads.
Status ConvertEnsemble(const inference::ModelConfig& p, const std::string& source, ModelConfig& c) {
  // Fields that configure instances or a batcher have nothing to act on:
  // the ensemble's steps run in their own models' instances and batchers.
  if (p.instance_group_size() > 0 || p.model_warmup_size() > 0 || p.has_optimization() ||
      !p.default_model_filename().empty()) {
    return InvalidArgument(source +
                           ": an ensemble has no instance_group, model_warmup, optimization or "
                           "default_model_filename of its own; its step models have them");
  }
  const auto& steps = p.ensemble_scheduling().step();
  if (steps.empty()) return InvalidArgument(source + ": ensemble_scheduling has no step");
  if (static_cast<size_t>(steps.size()) > kMaxEnsembleSteps) {
    return InvalidArgument(source + ": ensemble_scheduling has more than " + std::to_string(kMaxEnsembleSteps) +
                           " steps");
  }
  for (int i = 0; i < steps.size(); ++i) {
    const auto& s = steps[i];
    const std::string where = source + ": ensemble_scheduling step " + std::to_string(i);
    if (s.model_name().empty()) return InvalidArgument(where + " has no model_name");
    if (!s.model_namespace().empty()) return InvalidArgument(where + ": model_namespace is not supported");
    if (s.model_version() < -1) {
      return InvalidArgument(where + ": model_version " + std::to_string(s.model_version()) +
                             " is not a version (-1 = the highest ready one)");
    }
    if (static_cast<size_t>(s.input_map_size()) > kMaxConfigTensors ||
        static_cast<size_t>(s.output_map_size()) > kMaxConfigTensors) {
      return InvalidArgument(where + " maps more than " + std::to_string(kMaxConfigTensors) + " tensors");
    }
    EnsembleStep step;
    step.model_name = s.model_name();
    // 0 (the field left out) is no version a repository can hold: the
    // highest ready one, as -1.
    step.model_version = s.model_version() > 0 ? s.model_version() : -1;
    for (const auto& [k, v] : s.input_map()) {
      if (k.empty() || v.empty()) return InvalidArgument(where + ": input_map has an empty name");
      step.input_map[k] = v;
    }
    for (const auto& [k, v] : s.output_map()) {
      if (k.empty() || v.empty()) return InvalidArgument(where + ": output_map has an empty name");
      step.output_map[k] = v;
    }
    c.ensemble_steps.push_back(std::move(step));
  }
  return Status::Ok();
}

// backend and platform: which runs the model (ONNX Runtime unless said).
Status ConvertBackend(const inference::ModelConfig& p, const std::string& source, ModelConfig& c) {
  const bool ensemble = c.platform == "ensemble";
  // An ONNX model that names neither: the runtime measured fastest (backend
  // "auto"); platform "onnxruntime_onnx" alone pins ONNX Runtime.
  if (c.backend.empty() && c.platform.empty()) c.backend = "auto";
  if (c.backend.empty() && c.platform == "onnxruntime_onnx") c.backend = "onnxruntime";
  if (c.backend.empty() && c.platform == "pytorch_libtorch") c.backend = "pytorch";
  if (ensemble && c.backend.empty()) {
    // An ensemble: steps run by the ensemble scheduler (below).
  } else if ((c.backend == "python" || c.backend == "quern") && c.platform.empty()) {
    // A Python model (model.py), run in processes of its own, or a built-in stage.
  } else if (c.backend == "pytorch" && (c.platform.empty() || c.platform == "pytorch_libtorch")) {
    c.platform = "pytorch_libtorch";  // a TorchScript model.pt, run by LibTorch
  } else if (c.backend == "openvino" && (c.platform.empty() || c.platform == "openvino")) {
    c.platform = "openvino";  // model.xml (OpenVINO IR) or model.onnx, run by OpenVINO
  } else if (c.backend == "auto" && (c.platform.empty() || c.platform == "onnxruntime_onnx")) {
    c.platform = "onnxruntime_onnx";  // model.onnx, run by the runtime measured fastest at load
  } else if (c.backend != "onnxruntime" || (!c.platform.empty() && c.platform != "onnxruntime_onnx")) {
    return InvalidArgument(
        source + ": backend '" + p.backend() + "' / platform '" + p.platform() +
        "' is not supported; Quern serves ONNX models (backend \"onnxruntime\" or "
        "platform \"onnxruntime_onnx\"; backend \"auto\": the runtime measured fastest), OpenVINO models "
        "(backend \"openvino\"), PyTorch "
        "models (backend \"pytorch\" or platform \"pytorch_libtorch\"), Python models "
        "(backend \"python\"), built-in stages "
        "(backend \"quern\") and ensembles "
        "(platform \"ensemble\")");
  } else {
    c.platform = "onnxruntime_onnx";
  }
  return Status::Ok();
}

// A tensor's dims: a bounded rank, each in [-1, kMaxDim], a product in 64 bits.
template <typename Dims>
Status CheckDims(const std::string& source, const std::string& field, const Dims& dims) {
  if (static_cast<size_t>(dims.size()) > kMaxTensorRank) {
    return InvalidArgument(source + ": " + field + " has " + std::to_string(dims.size()) + " dimensions; at most " +
                           std::to_string(kMaxTensorRank));
  }
  int64_t elements = 1;
  for (int64_t d : dims) {
    if (d < -1 || d > kMaxDim) {
      return InvalidArgument(source + ": " + field + " dimension " + std::to_string(d) + " is outside [-1, " +
                             std::to_string(kMaxDim) + "]");
    }
    if (d > 0 && __builtin_mul_overflow(elements, d, &elements)) {
      return InvalidArgument(source + ": " + field + " has more elements than fit in 64 bits");
    }
  }
  return Status::Ok();
}

// instance_group: kinds, devices and counts, bounded in all.
Status ConvertInstanceGroups(const inference::ModelConfig& p, const std::string& source, ModelConfig& c) {
  for (int gi = 0; gi < p.instance_group_size(); ++gi) {
    const auto& g = p.instance_group(gi);
    const std::string which = source + ": instance_group " + std::to_string(gi);
    InstanceGroup group;
    switch (g.kind()) {
      case inference::ModelInstanceGroup::KIND_AUTO: group.kind = InstanceGroup::Kind::kAuto; break;
      case inference::ModelInstanceGroup::KIND_CPU:
      case inference::ModelInstanceGroup::KIND_MODEL:  // the model places its work: its instances, on the CPU
        group.kind = InstanceGroup::Kind::kCpu;
        break;
      case inference::ModelInstanceGroup::KIND_GPU: group.kind = InstanceGroup::Kind::kGpu; break;
      default:
        return InvalidArgument(which + ": kind " + std::to_string(g.kind()) +
                               " is not one of KIND_AUTO, KIND_GPU, KIND_CPU, KIND_MODEL");
    }
    group.count = g.count() > 0 ? g.count() : 1;  // as Triton: below 1 means 1
    if (g.gpus_size() > 0 && g.kind() == inference::ModelInstanceGroup::KIND_CPU) {
      return InvalidArgument(which + ": kind KIND_CPU lists gpus; use KIND_GPU to run on them");
    }
    for (int32_t d : g.gpus()) {
      if (d < 0 || d >= kMaxGpus) {
        return InvalidArgument(which + ": gpus lists device " + std::to_string(d) +
                               "; a device is a CUDA ordinal in [0, " + std::to_string(kMaxGpus) + ")");
      }
      if (std::find(group.gpus.begin(), group.gpus.end(), d) != group.gpus.end()) {
        return InvalidArgument(which + ": gpus lists device " + std::to_string(d) + " twice");
      }
      group.gpus.push_back(d);
    }
    if (group.kind == InstanceGroup::Kind::kCpu) group.gpus.clear();  // KIND_MODEL's list: not ours to place
    // Instances on each listed device (at least one device: how many an
    // empty list means is known when the model loads).
    const int64_t count = int64_t{group.count} * std::max<int64_t>(1, static_cast<int64_t>(group.gpus.size()));
    if (count > kMaxInstances - c.instance_count) {
      return InvalidArgument(which + ": count " + std::to_string(g.count()) +
                             " brings the model's instances above the limit of " + std::to_string(kMaxInstances));
    }
    c.instance_count += static_cast<int>(count);
    c.instance_groups.push_back(std::move(group));
  }
  return Status::Ok();
}

// dynamic_batching, with bounds on delays, levels and timeouts.
Status ConvertDynamicBatching(const inference::ModelDynamicBatching& db, const std::string& source, ModelConfig& c) {
  if (db.preferred_batch_size_size() > 64) {
    return InvalidArgument(source + ": dynamic_batching lists more than 64 preferred_batch_size values");
  }
  if (db.max_queue_delay_microseconds() > kMaxQueueDelayUs) {
    return InvalidArgument(source + ": dynamic_batching.max_queue_delay_microseconds " +
                           std::to_string(db.max_queue_delay_microseconds()) + " is above the limit of " +
                           std::to_string(kMaxQueueDelayUs) + " (1 hour)");
  }
  if (db.priority_levels() > kMaxPriorityLevels) {
    return InvalidArgument(source + ": dynamic_batching.priority_levels " + std::to_string(db.priority_levels()) +
                           " is above the limit of " + std::to_string(kMaxPriorityLevels));
  }
  auto check_policy = [&](const inference::ModelQueuePolicy& q, const std::string& field) -> Status {
    if (q.default_timeout_microseconds() > kMaxQueueTimeoutUs) {
      return InvalidArgument(source + ": " + field + ".default_timeout_microseconds " +
                             std::to_string(q.default_timeout_microseconds()) + " is above the limit of " +
                             std::to_string(kMaxQueueTimeoutUs) + " (30 days)");
    }
    return Status::Ok();
  };
  QUERN_RETURN_IF_ERROR(check_policy(db.default_queue_policy(), "dynamic_batching.default_queue_policy"));
  for (const auto& [level, policy] : db.priority_queue_policy()) {
    QUERN_RETURN_IF_ERROR(
        check_policy(policy, "dynamic_batching.priority_queue_policy[" + std::to_string(level) + "]"));
  }
  BatchingConfig b;
  b.preferred_batch_sizes.assign(db.preferred_batch_size().begin(), db.preferred_batch_size().end());
  b.max_queue_delay_us = db.max_queue_delay_microseconds();
  b.preserve_ordering = db.preserve_ordering();
  b.priority_levels = static_cast<uint32_t>(db.priority_levels());
  b.default_priority_level = static_cast<uint32_t>(db.default_priority_level());
  if (db.has_default_queue_policy()) b.default_queue_policy = ConvertQueuePolicy(db.default_queue_policy());
  for (const auto& [level, policy] : db.priority_queue_policy()) {
    b.priority_queue_policy[static_cast<uint32_t>(level)] = ConvertQueuePolicy(policy);
  }
  c.batching = std::move(b);
  return Status::Ok();
}

// parameters: Quern's own (quern.*) checked by name and read.
Status ConvertParameters(const inference::ModelConfig& p, const std::string& source, ModelConfig& c) {
  for (const auto& [key, value] : p.parameters()) {
    c.parameters[key] = value.string_value();
    if (key.starts_with("quern.") && key != kFixedBatchSizesParam && key != kBatchSizeTuningParam &&
        key != kMaxQueueWaitParam && key != kLatencyTargetParam && key != kWideInstanceParam &&
        key != kMemoryBudgetParam && key != "quern.task" &&
        !(c.backend == "quern" && (key == "quern.stage" || key.starts_with("quern.ocr."))) &&
        !(c.backend == "python" &&
          (key == "quern.python" || key == "quern.execute_timeout_ms" || key == "quern.initialize_timeout_ms" ||
           key == "quern.same_core" || key == "quern.same_core_below_us" || key == "quern.python.max_memory_mb")) &&
        !key.starts_with("quern.image.") && !key.starts_with("quern.detection.") &&
        !key.starts_with("quern.classification.") && !key.starts_with("quern.embedding.")) {
      return InvalidArgument(source + ": unknown parameter " + key);
    }
  }
  if (auto it = c.parameters.find(std::string(kFixedBatchSizesParam)); it != c.parameters.end()) {
    auto sizes = ParseIntList(it->second, source + ": parameter " + it->first);
    if (!sizes) return sizes.error();
    c.fixed_batch_sizes = std::move(*sizes);
  }
  QUERN_RETURN_IF_ERROR(OnOffParameter(c, kBatchSizeTuningParam, source, c.batch_size_tuning));
  QUERN_RETURN_IF_ERROR(OnOffParameter(c, kWideInstanceParam, source, c.wide_instance));
  QUERN_RETURN_IF_ERROR(MillisecondsParameter(c, kMaxQueueWaitParam, source, c.max_queue_wait_ms));
  std::optional<int64_t> target_ms;
  QUERN_RETURN_IF_ERROR(MillisecondsParameter(c, kLatencyTargetParam, source, target_ms));
  c.latency_target_ms = target_ms.value_or(0);
  if (auto it = c.parameters.find(std::string(kMemoryBudgetParam)); it != c.parameters.end()) {
    int64_t mb = -1;
    auto [ptr, ec] = std::from_chars(it->second.data(), it->second.data() + it->second.size(), mb);
    if (ec != std::errc() || ptr != it->second.data() + it->second.size() || mb < 0 || mb > kMaxMemoryBudgetMb) {
      return InvalidArgument(source + ": parameter " + it->first + " must be MiB in [0, " +
                             std::to_string(kMaxMemoryBudgetMb) + "] (0: no bound), got \"" + it->second + "\"");
    }
    c.memory_budget_mb = mb;
  }
  return Status::Ok();
}

// model_warmup: samples, bounded.
Status ConvertWarmup(const inference::ModelConfig& p, const std::string& source, ModelConfig& c) {
  for (const auto& w : p.model_warmup()) {
    if (w.count() > kMaxWarmupCount) {
      return InvalidArgument(source + ": model_warmup '" + w.name() + "' count " + std::to_string(w.count()) +
                             " is above the limit of " + std::to_string(kMaxWarmupCount));
    }
    for (const auto& [name, in] : w.inputs()) {
      QUERN_RETURN_IF_ERROR(CheckDims(source, "model_warmup '" + w.name() + "' input '" + name + "' dims", in.dims()));
    }
    WarmupSample s;
    s.name = w.name();
    s.batch_size = w.batch_size() == 0 ? 1 : w.batch_size();
    s.count = w.count() == 0 ? 1 : w.count();
    for (const auto& [name, in] : w.inputs()) {
      WarmupInput wi;
      wi.dtype = FromProtoType(in.data_type());
      wi.dims.assign(in.dims().begin(), in.dims().end());
      if (in.has_random_data()) {
        wi.fill = WarmupInput::Fill::kRandom;
      } else if (in.has_input_data_file()) {
        wi.fill = WarmupInput::Fill::kFile;
        wi.file = in.input_data_file();
      }
      s.inputs[name] = std::move(wi);
    }
    c.warmup.push_back(std::move(s));
  }
  return Status::Ok();
}

}  // namespace

Result<ModelConfig> ConvertModelConfig(const inference::ModelConfig& p, const std::string& source) {
  ModelConfig c;
  c.name = p.name();
  c.platform = p.platform();
  c.backend = p.backend();
  const bool ensemble = c.platform == "ensemble";
  if (ensemble != p.has_ensemble_scheduling()) {
    return Err(InvalidArgument(source + (ensemble ? ": platform \"ensemble\" needs ensemble_scheduling { step [ ... ] }"
                                                  : ": ensemble_scheduling is for platform \"ensemble\" only")));
  }
  QUERN_RETURN_IF_ERROR(ConvertBackend(p, source, c));
  if (p.max_batch_size() < 0 || p.max_batch_size() > kMaxBatchSize) {
    return Err(InvalidArgument(source + ": max_batch_size must be in [0, " + std::to_string(kMaxBatchSize) + "], got " +
                               std::to_string(p.max_batch_size())));
  }
  if (static_cast<size_t>(p.input_size()) > kMaxConfigTensors ||
      static_cast<size_t>(p.output_size()) > kMaxConfigTensors) {
    return Err(InvalidArgument(source + ": more than " + std::to_string(kMaxConfigTensors) + " inputs or outputs"));
  }
  auto check_dims = [&](const std::string& field, const auto& dims) { return CheckDims(source, field, dims); };
  for (const auto& in : p.input()) {
    QUERN_RETURN_IF_ERROR(check_dims("input '" + in.name() + "' dims", in.dims()));
    QUERN_RETURN_IF_ERROR(check_dims("input '" + in.name() + "' reshape", in.reshape().shape()));
  }
  for (const auto& out : p.output()) {
    QUERN_RETURN_IF_ERROR(check_dims("output '" + out.name() + "' dims", out.dims()));
    QUERN_RETURN_IF_ERROR(check_dims("output '" + out.name() + "' reshape", out.reshape().shape()));
  }
  c.max_batch_size = p.max_batch_size();
  for (const auto& in : p.input()) c.inputs.push_back(ConvertInput(in));
  for (const auto& out : p.output()) c.outputs.push_back(ConvertOutput(out));

  c.instance_count = 0;  // automatic unless instance_group says otherwise
  if (ensemble) {
    QUERN_RETURN_IF_ERROR(ConvertEnsemble(p, source, c));
  } else {
    QUERN_RETURN_IF_ERROR(ConvertInstanceGroups(p, source, c));
  }

  if (p.has_dynamic_batching()) QUERN_RETURN_IF_ERROR(ConvertDynamicBatching(p.dynamic_batching(), source, c));
  c.decoupled = p.model_transaction_policy().decoupled();
  // An ensemble may say it is decoupled; one with a decoupled step is, whatever it says
  // (EnsembleModel).
  if (c.decoupled && c.batching && c.batching->preserve_ordering) {
    return Err(InvalidArgument(source + ": a decoupled model's requests end when it closes them: "
                                        "dynamic_batching { preserve_ordering: true } cannot hold their order"));
  }
  if (c.decoupled && !ensemble && c.backend != "python" && c.backend != "custom") {
    return Err(InvalidArgument(source +
                               ": model_transaction_policy { decoupled: true } is for Python models (and "
                               "models registered in code); backend '" +
                               c.backend + "' answers each request once"));
  }

  QUERN_RETURN_IF_ERROR(ConvertParameters(p, source, c));
  if (p.has_optimization() && p.optimization().has_graph()) {
    c.graph_optimization_level = p.optimization().graph().level();
    if (c.graph_optimization_level < -1 || c.graph_optimization_level > 2) {
      return Err(InvalidArgument(source + ": optimization.graph.level " + std::to_string(c.graph_optimization_level) +
                                 " is outside [-1, 2]"));
    }
  }
  c.default_model_filename = p.default_model_filename();

  QUERN_RETURN_IF_ERROR(ConvertWarmup(p, source, c));
  return c;
}

Status ValidateModelConfig(const ModelConfig& c) {
  if (c.name.empty()) return InvalidArgument("model configuration has no name");
  const std::string m = "model '" + c.name + "': ";
  if (c.max_batch_size < 0 || c.max_batch_size > kMaxBatchSize) {
    return InvalidArgument(m + "max_batch_size must be in [0, " + std::to_string(kMaxBatchSize) + "]");
  }
  if (c.inputs.empty()) return InvalidArgument(m + "no inputs are configured");
  if (c.outputs.empty()) return InvalidArgument(m + "no outputs are configured");
  QUERN_RETURN_IF_ERROR(ValidateTensors(c, c.inputs, "input"));
  QUERN_RETURN_IF_ERROR(ValidateTensors(c, c.outputs, "output"));
  if (c.instance_count < 0 || c.instance_count > kMaxInstances) {
    return InvalidArgument(m + "instance count must be in [0, " + std::to_string(kMaxInstances) +
                           "] (0 = one per core)");
  }
  if (c.memory_budget_mb && (*c.memory_budget_mb < 0 || *c.memory_budget_mb > kMaxMemoryBudgetMb)) {
    return InvalidArgument(m + "the memory budget must be MiB in [0, " + std::to_string(kMaxMemoryBudgetMb) +
                           "] (0: no bound)");
  }
  if (c.batching) {
    const BatchingConfig& b = *c.batching;
    if (b.priority_levels > kMaxPriorityLevels || b.max_queue_delay_us > kMaxQueueDelayUs) {
      return InvalidArgument(m + "dynamic_batching.priority_levels must be <= " + std::to_string(kMaxPriorityLevels) +
                             " and max_queue_delay_microseconds <= " + std::to_string(kMaxQueueDelayUs));
    }
    if (c.max_batch_size == 0) {
      return InvalidArgument(m + "dynamic_batching needs max_batch_size > 0");
    }
    for (int s : b.preferred_batch_sizes) {
      if (s < 1 || s > c.max_batch_size) {
        return InvalidArgument(m + "dynamic_batching.preferred_batch_size " + std::to_string(s) + " is outside [1, " +
                               std::to_string(c.max_batch_size) + "] (max_batch_size)");
      }
    }
    const uint32_t levels = std::max<uint32_t>(b.priority_levels, 1);
    if (b.priority_levels > 0 && b.default_priority_level > b.priority_levels) {
      return InvalidArgument(m + "dynamic_batching.default_priority_level " + std::to_string(b.default_priority_level) +
                             " is outside [1, " + std::to_string(b.priority_levels) + "] (priority_levels)");
    }
    for (const auto& [level, policy] : b.priority_queue_policy) {
      if (level < 1 || level > levels) {
        return InvalidArgument(m + "dynamic_batching.priority_queue_policy key " + std::to_string(level) +
                               " is outside [1, " + std::to_string(levels) + "]");
      }
    }
  }
  if (!c.fixed_batch_sizes.empty()) {
    if (c.max_batch_size == 0)
      return InvalidArgument(m + std::string(kFixedBatchSizesParam) + " needs max_batch_size > 0");
    for (int s : c.fixed_batch_sizes) {
      if (s < 1 || s > c.max_batch_size) {
        return InvalidArgument(m + std::string(kFixedBatchSizesParam) + " entry " + std::to_string(s) +
                               " is outside [1, " + std::to_string(c.max_batch_size) + "] (max_batch_size)");
      }
    }
    if (*std::max_element(c.fixed_batch_sizes.begin(), c.fixed_batch_sizes.end()) != c.max_batch_size) {
      return InvalidArgument(m + "the largest of " + std::string(kFixedBatchSizesParam) +
                             " must equal max_batch_size " + std::to_string(c.max_batch_size));
    }
  }
  for (const auto& w : c.warmup) {
    if (c.max_batch_size > 0 && w.batch_size > static_cast<uint32_t>(c.max_batch_size)) {
      return InvalidArgument(m + "model_warmup '" + w.name + "' batch_size " + std::to_string(w.batch_size) +
                             " exceeds max_batch_size " + std::to_string(c.max_batch_size));
    }
    for (const auto& [name, in] : w.inputs) {
      if (!c.FindInput(name))
        return InvalidArgument(m + "model_warmup '" + w.name + "' names unknown input '" + name + "'");
    }
  }
  return Status::Ok();
}

inference::ModelConfig ToProto(const ModelConfig& c) {
  inference::ModelConfig p;
  p.set_name(c.name);
  p.set_platform(c.platform.empty() && c.backend == "onnxruntime" ? "onnxruntime_onnx" : c.platform);
  p.set_backend(c.backend);
  p.set_max_batch_size(c.max_batch_size);
  for (const auto& t : c.inputs) {
    auto* in = p.add_input();
    in->set_name(t.name);
    in->set_data_type(ToProtoType(t.dtype));
    for (int64_t d : t.dims) in->add_dims(d);
    if (t.reshape)
      for (int64_t d : *t.reshape) in->mutable_reshape()->add_shape(d);
    in->set_optional(t.optional);
  }
  for (const auto& t : c.outputs) {
    auto* out = p.add_output();
    out->set_name(t.name);
    out->set_data_type(ToProtoType(t.dtype));
    for (int64_t d : t.dims) out->add_dims(d);
    if (t.reshape)
      for (int64_t d : *t.reshape) out->mutable_reshape()->add_shape(d);
    out->set_label_filename(t.label_filename);
  }
  if (c.is_ensemble()) {
    auto* e = p.mutable_ensemble_scheduling();
    for (const EnsembleStep& s : c.ensemble_steps) {
      auto* step = e->add_step();
      step->set_model_name(s.model_name);
      step->set_model_version(s.model_version);
      for (const auto& [k, v] : s.input_map) (*step->mutable_input_map())[k] = v;
      for (const auto& [k, v] : s.output_map) (*step->mutable_output_map())[k] = v;
    }
  } else if (c.instance_groups.empty()) {
    auto* g = p.add_instance_group();
    g->set_kind(inference::ModelInstanceGroup::KIND_CPU);
    g->set_count(c.instance_count);
  } else {
    for (const InstanceGroup& group : c.instance_groups) {
      auto* g = p.add_instance_group();
      g->set_kind(group.kind == InstanceGroup::Kind::kGpu   ? inference::ModelInstanceGroup::KIND_GPU
                  : group.kind == InstanceGroup::Kind::kCpu ? inference::ModelInstanceGroup::KIND_CPU
                                                            : inference::ModelInstanceGroup::KIND_AUTO);
      g->set_count(group.count);
      for (int d : group.gpus) g->add_gpus(d);
    }
  }
  if (c.batching) {
    auto* db = p.mutable_dynamic_batching();
    for (int s : c.batching->preferred_batch_sizes) db->add_preferred_batch_size(s);
    db->set_max_queue_delay_microseconds(c.batching->max_queue_delay_us);
    db->set_preserve_ordering(c.batching->preserve_ordering);
    db->set_priority_levels(c.batching->priority_levels);
    db->set_default_priority_level(c.batching->default_priority_level);
    *db->mutable_default_queue_policy() = QueuePolicyToProto(c.batching->default_queue_policy);
    for (const auto& [level, policy] : c.batching->priority_queue_policy) {
      (*db->mutable_priority_queue_policy())[level] = QueuePolicyToProto(policy);
    }
  }
  for (const auto& [k, v] : c.parameters) (*p.mutable_parameters())[k].set_string_value(v);
  if (c.graph_optimization_level != 0) p.mutable_optimization()->mutable_graph()->set_level(c.graph_optimization_level);
  p.set_default_model_filename(c.default_model_filename);
  if (c.decoupled) p.mutable_model_transaction_policy()->set_decoupled(true);
  return p;
}

}  // namespace quern

namespace quern {
namespace {

// The fields whose 64-bit integers protobuf's JSON writes as strings.
bool Int64Field(const std::string& key) {
  static const std::set<std::string> kFields = {"dims",
                                                "shape",
                                                "versions",
                                                "model_version",
                                                "priority_levels",
                                                "default_priority_level",
                                                "max_queue_delay_microseconds",
                                                "default_timeout_microseconds"};
  return kFields.contains(key);
}

// A decimal integer string ("-3", "4") as a number, in place.
void ToNumber(google::protobuf::Value& v) {
  if (v.kind_case() != google::protobuf::Value::kStringValue) return;
  const std::string& s = v.string_value();
  int64_t n = 0;
  const auto r = std::from_chars(s.data(), s.data() + s.size(), n);
  // Beyond 2^53 a JSON number (a double to most readers) would lose digits: left a string.
  constexpr int64_t kExact = int64_t{1} << 53;
  if (r.ec == std::errc() && r.ptr == s.data() + s.size() && n <= kExact && n >= -kExact) {
    v.set_number_value(static_cast<double>(n));
  }
}

void FixInt64s(google::protobuf::Value& v) {
  if (v.kind_case() == google::protobuf::Value::kListValue) {
    for (auto& item : *v.mutable_list_value()->mutable_values()) FixInt64s(item);
    return;
  }
  if (v.kind_case() != google::protobuf::Value::kStructValue) return;
  for (auto& [key, field] : *v.mutable_struct_value()->mutable_fields()) {
    // Maps of names (an ensemble step's input_map and output_map, parameters): their keys are
    // tensor and parameter names, never fields.
    if (key == "input_map" || key == "output_map" || key == "parameters") continue;
    if (Int64Field(key)) {
      if (field.kind_case() == google::protobuf::Value::kListValue) {
        for (auto& item : *field.mutable_list_value()->mutable_values()) ToNumber(item);
      } else {
        ToNumber(field);
      }
    } else {
      FixInt64s(field);
    }
  }
}

}  // namespace

Result<std::string> ToTritonJson(const ModelConfig& config) {
  google::protobuf::util::JsonPrintOptions opts;
  opts.preserve_proto_field_names = true;
  opts.always_print_primitive_fields = true;
  std::string json;
  if (!google::protobuf::util::MessageToJsonString(ToProto(config), &json, opts).ok()) {
    return Err(Internal("model '" + config.name + "': cannot write its configuration as JSON"));
  }
  google::protobuf::Value value;
  if (!google::protobuf::util::JsonStringToMessage(json, &value).ok()) {
    return Err(Internal("model '" + config.name + "': cannot read its configuration's JSON back"));
  }
  FixInt64s(value);
  std::string out;
  google::protobuf::util::JsonPrintOptions plain;
  if (!google::protobuf::util::MessageToJsonString(value, &out, plain).ok()) {
    return Err(Internal("model '" + config.name + "': cannot write its configuration as JSON"));
  }
  return out;
}

Result<inference::ModelConfig> ParseModelConfigJson(std::string_view json, const std::string& source) {
  inference::ModelConfig proto;
  google::protobuf::util::JsonParseOptions opts;
  opts.ignore_unknown_fields = false;
  const auto st = google::protobuf::util::JsonStringToMessage(std::string(json), &proto, opts);
  if (!st.ok()) return Err(InvalidArgument(source + ": " + std::string(st.message().substr(0, 512))));
  return proto;
}

}  // namespace quern
