#include "frontends/grpc/grpc_convert.h"

#include <google/protobuf/io/coded_stream.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstring>

#include "core/model_config_parser.h"
#include "protocol/kserve_codec.h"

namespace quern {
namespace {

Result<uint64_t> UnsignedParameter(const inference::InferParameter& p, const char* name, const char* what) {
  switch (p.parameter_choice_case()) {
    case inference::InferParameter::kInt64Param:
      if (p.int64_param() >= 0) return static_cast<uint64_t>(p.int64_param());
      break;
    case inference::InferParameter::kUint64Param: return p.uint64_param();
    default: break;
  }
  return std::unexpected(
      InvalidArgument(std::string("parameter '") + name + "' must be " + what + " as a non-negative integer"));
}

// The model's parameters of a request (InferRequest::parameters) as a JSON
// object, in key order; INVALID_ARGUMENT past kMaxRequestParametersBytes.
Result<std::string> ModelParameters(std::vector<std::pair<std::string_view, const inference::InferParameter*>>& own,
                                    const std::string& model) {
  std::sort(own.begin(), own.end());
  rapidjson::StringBuffer buffer;
  JsonWriter w(buffer);
  w.StartObject();
  for (const auto& [key, p] : own) {
    w.Key(key.data(), static_cast<rapidjson::SizeType>(key.size()));
    switch (p->parameter_choice_case()) {
      case inference::InferParameter::kBoolParam: w.Bool(p->bool_param()); break;
      case inference::InferParameter::kInt64Param: w.Int64(p->int64_param()); break;
      case inference::InferParameter::kUint64Param: w.Uint64(p->uint64_param()); break;
      case inference::InferParameter::kDoubleParam:
        if (!std::isfinite(p->double_param())) {
          return std::unexpected(
              InvalidArgument("model '" + model + "': parameter '" + std::string(key) + "' must be a finite number"));
        }
        w.Double(p->double_param());
        break;
      case inference::InferParameter::kStringParam:
        w.String(p->string_param().data(), static_cast<rapidjson::SizeType>(p->string_param().size()));
        break;
      default:  // set to nothing: refused, as HTTP refuses null
        return std::unexpected(InvalidArgument("model '" + model + "': parameter '" + std::string(key) +
                                               "' must be a bool, a number or a string"));
    }
  }
  w.EndObject();
  if (buffer.GetSize() > kMaxRequestParametersBytes) {
    return std::unexpected(InvalidArgument("model '" + model + "': the request's parameters take " +
                                           std::to_string(buffer.GetSize()) + " bytes; at most " +
                                           std::to_string(kMaxRequestParametersBytes) + " are accepted"));
  }
  return std::string(buffer.GetString(), buffer.GetSize());
}

// Copies typed contents into a tensor after checking the element count.
template <typename T, typename Field>
Result<Tensor> FromContents(DataType type, const Shape& shape, const Field& values, const std::string& where) {
  const int64_t n = ElementCount(shape);
  if (static_cast<int64_t>(values.size()) != n) {
    return std::unexpected(InvalidArgument(where + ": shape " + ShapeToString(shape) + " needs " + std::to_string(n) +
                                           " values, the contents hold " + std::to_string(values.size())));
  }
  Tensor t = Tensor::AllocateUninitialized(type, shape, static_cast<size_t>(n) * sizeof(T));
  T* out = reinterpret_cast<T*>(t.mutable_data());
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<T>(values[static_cast<int>(i)]);
  return t;
}

Result<Tensor> TypedTensor(DataType type, const Shape& shape, const inference::InferTensorContents& c,
                           const std::string& where) {
  switch (type) {
    case DataType::kBool: return FromContents<uint8_t>(type, shape, c.bool_contents(), where);
    case DataType::kUint8: return FromContents<uint8_t>(type, shape, c.uint_contents(), where);
    case DataType::kUint16: return FromContents<uint16_t>(type, shape, c.uint_contents(), where);
    case DataType::kUint32: return FromContents<uint32_t>(type, shape, c.uint_contents(), where);
    case DataType::kUint64: return FromContents<uint64_t>(type, shape, c.uint64_contents(), where);
    case DataType::kInt8: return FromContents<int8_t>(type, shape, c.int_contents(), where);
    case DataType::kInt16: return FromContents<int16_t>(type, shape, c.int_contents(), where);
    case DataType::kInt32: return FromContents<int32_t>(type, shape, c.int_contents(), where);
    case DataType::kInt64: return FromContents<int64_t>(type, shape, c.int64_contents(), where);
    case DataType::kFp32: return FromContents<float>(type, shape, c.fp32_contents(), where);
    case DataType::kFp64: return FromContents<double>(type, shape, c.fp64_contents(), where);
    case DataType::kBytes: {
      const int64_t n = ElementCount(shape);
      if (c.bytes_contents_size() != n) {
        return std::unexpected(InvalidArgument(where + ": shape " + ShapeToString(shape) + " needs " +
                                               std::to_string(n) + " values, bytes_contents holds " +
                                               std::to_string(c.bytes_contents_size())));
      }
      return Tensor::FromStrings(shape, {c.bytes_contents().begin(), c.bytes_contents().end()});
    }
    default:
      return std::unexpected(InvalidArgument(where + ": datatype " + std::string(DataTypeName(type)) +
                                             " cannot travel in typed contents; use raw_input_contents"));
  }
}

// Builds the engine request. Raw inputs are viewed in place: `msg` must
// outlive the request's execution.
void FillDuration(const DurationStat& d, inference::StatisticDuration* out) {
  out->set_count(d.count);
  out->set_ns(d.ns);
}

}  // namespace

// "" = the highest ready version.
Result<int64_t> ParseModelVersion(const std::string& model, const std::string& v) {
  if (v.empty()) return int64_t{-1};
  int64_t out = 0;
  auto [p, ec] = std::from_chars(v.data(), v.data() + v.size(), out);
  if (ec != std::errc() || p != v.data() + v.size() || out < 1) {
    return std::unexpected(InvalidArgument("model '" + model + "': version '" + v + "' is not a positive integer"));
  }
  return out;
}

Result<InferRequest> ToInferRequest(const inference::ModelInferRequest& msg) {
  InferRequest ir;
  ir.model = msg.model_name();
  if (ir.model.empty()) return std::unexpected(InvalidArgument("ModelInferRequest.model_name is empty"));
  QUERN_ASSIGN_OR_RETURN(ir.version, ParseModelVersion(ir.model, msg.model_version()));
  const bool raw = msg.raw_input_contents_size() > 0;
  if (raw && msg.raw_input_contents_size() != msg.inputs_size()) {
    return std::unexpected(
        InvalidArgument("model '" + ir.model + "': " + std::to_string(msg.inputs_size()) + " inputs but " +
                        std::to_string(msg.raw_input_contents_size()) +
                        " raw_input_contents entries; send one per input, or none and typed contents"));
  }
  ir.inputs.reserve(static_cast<size_t>(msg.inputs_size()));
  for (int i = 0; i < msg.inputs_size(); ++i) {
    const auto& in = msg.inputs(i);
    // Named in errors only: built when one is.
    auto where = [&] { return "model '" + ir.model + "', input '" + in.name() + "'"; };
    auto type = DataTypeFromName(in.datatype());
    if (!type) return std::unexpected(InvalidArgument(where() + ": unknown datatype '" + in.datatype() + "'"));
    if (static_cast<size_t>(in.shape_size()) > kMaxTensorRank) {
      return std::unexpected(InvalidArgument(where() + ": shape has " + std::to_string(in.shape_size()) +
                                             " dimensions; at most " + std::to_string(kMaxTensorRank) +
                                             " are accepted"));
    }
    Shape shape(in.shape().begin(), in.shape().end());
    for (int64_t d : shape) {
      if (d < 0)
        return std::unexpected(
            InvalidArgument(where() + ": shape " + ShapeToString(shape) + " has a negative dimension"));
    }
    if (ElementCount(shape) < 0) {
      return std::unexpected(
          InvalidArgument(where() + ": shape " + ShapeToString(shape) + " has more elements than fit in 64 bits"));
    }
    Tensor t;
    if (raw) {
      const std::string& bytes = msg.raw_input_contents(i);
      t = Tensor::Borrow(*type, shape, bytes.data(), bytes.size());
      if (Status st = t.Validate(); !st.ok()) {
        return std::unexpected(InvalidArgument(where() + ": raw_input_contents holds " + std::to_string(bytes.size()) +
                                               " bytes, which do not match datatype " + in.datatype() + " and shape " +
                                               ShapeToString(shape) + " (" + st.message() + ")"));
      }
    } else {
      QUERN_ASSIGN_OR_RETURN(t, TypedTensor(*type, shape, in.contents(), where()));
    }
    ir.inputs.push_back({in.name(), std::move(t)});
  }
  for (const auto& o : msg.outputs()) {
    ir.requested_outputs.push_back(o.name());
    if (auto it = o.parameters().find("classification"); it != o.parameters().end()) {
      QUERN_ASSIGN_OR_RETURN(uint64_t count, UnsignedParameter(it->second, "classification", "a count of classes"));
      if (count == 0) {
        return std::unexpected(InvalidArgument("model '" + msg.model_name() + "' output '" + o.name() +
                                               "': parameter 'classification' must be a positive count"));
      }
    }
  }
  std::vector<std::pair<std::string_view, const inference::InferParameter*>> own;  // the model's
  for (const auto& [key, value] : msg.parameters()) {
    if (key == "priority") {
      QUERN_ASSIGN_OR_RETURN(uint64_t p, UnsignedParameter(value, "priority", "a priority level"));
      ir.priority = static_cast<uint32_t>(std::min<uint64_t>(p, UINT32_MAX));
    } else if (key == "timeout") {
      QUERN_ASSIGN_OR_RETURN(ir.timeout_us, UnsignedParameter(value, "timeout", "microseconds"));
    } else if (!IsServerParameter(key)) {
      own.emplace_back(key, &value);
    }
  }
  if (!own.empty()) {
    QUERN_ASSIGN_OR_RETURN(ir.parameters, ModelParameters(own, ir.model));
  }
  return ir;
}

Status ApplyClassifications(const inference::ModelInferRequest& msg, const Engine& engine, InferResponse& r) {
  KServeOutputFormat format;
  for (const auto& o : msg.outputs()) {
    auto it = o.parameters().find("classification");
    if (it == o.parameters().end()) continue;
    const inference::InferParameter& p = it->second;
    const int64_t count = p.parameter_choice_case() == inference::InferParameter::kUint64Param
                              ? static_cast<int64_t>(std::min<uint64_t>(p.uint64_param(), INT64_MAX))
                              : p.int64_param();
    format.classifications.emplace_back(o.name(), count);
  }
  if (format.classifications.empty()) return Status::Ok();
  const OutputLabels labels = [&](const std::string& output) {
    return engine.OutputLabels(r.model, r.version, output);
  };
  return ApplyClassifications(r.outputs, format, r.model, labels);
}

// Writes the engine's response; every output travels in raw_output_contents.
void ToInferResponse(const InferResponse& r, const std::string& id, inference::ModelInferResponse* out) {
  out->set_model_name(r.model);
  out->set_model_version(std::to_string(r.version));
  if (!id.empty()) out->set_id(id);
  for (const auto& o : r.outputs) {
    auto* t = out->add_outputs();
    t->set_name(o.name);
    t->set_datatype(std::string(DataTypeName(o.tensor.dtype())));
    for (int64_t d : o.tensor.shape()) t->add_shape(d);
    out->add_raw_output_contents(reinterpret_cast<const char*>(o.tensor.data()), o.tensor.byte_size());
  }
}

void FillMetadata(const ModelStatus& m, inference::ModelMetadataResponse* out) {
  out->set_name(m.name);
  out->add_versions(std::to_string(m.version));
  out->set_platform(!m.config.platform.empty()     ? m.config.platform
                    : m.config.backend == "python" ? "python"
                                                   : "onnxruntime_onnx");
  const bool batched = m.config.max_batch_size > 0;
  auto add = [&](const TensorConfig& t, inference::ModelMetadataResponse::TensorMetadata* md) {
    md->set_name(t.name);
    md->set_datatype(std::string(DataTypeName(t.dtype)));
    if (batched) md->add_shape(-1);
    for (int64_t d : t.dims) md->add_shape(d);
  };
  for (const auto& t : m.config.inputs) add(t, out->add_inputs());
  for (const auto& t : m.config.outputs) add(t, out->add_outputs());
}

void FillStatistics(const ModelStatistics& s, inference::ModelStatistics* out) {
  out->set_name(s.name);
  out->set_version(std::to_string(s.version));
  out->set_last_inference(s.last_inference_ms);
  out->set_inference_count(s.inference_count);
  out->set_execution_count(s.execution_count);
  auto* is = out->mutable_inference_stats();
  FillDuration(s.success, is->mutable_success());
  FillDuration(s.fail, is->mutable_fail());
  FillDuration(s.queue, is->mutable_queue());
  FillDuration(s.compute_input, is->mutable_compute_input());
  FillDuration(s.compute_infer, is->mutable_compute_infer());
  FillDuration(s.compute_output, is->mutable_compute_output());
  is->mutable_cache_hit();
  is->mutable_cache_miss();
  for (const auto& b : s.batch_stats) {
    auto* bs = out->add_batch_stats();
    bs->set_batch_size(static_cast<uint64_t>(b.batch_size));
    FillDuration(b.compute_input, bs->mutable_compute_input());
    FillDuration(b.compute_infer, bs->mutable_compute_infer());
    FillDuration(b.compute_output, bs->mutable_compute_output());
  }
}

void PeekInferNames(google::protobuf::io::ZeroCopyInputStream* bytes, std::string* model, std::string* id) {
  google::protobuf::io::CodedInputStream in(bytes);
  for (int fields = 0; fields < 3; ++fields) {
    const uint32_t tag = in.ReadTag();
    const uint32_t number = tag >> 3;
    uint32_t size = 0;
    if ((tag & 7) != 2 || number < 1 || number > 3 || !in.ReadVarint32(&size) || size > INT32_MAX) return;
    const auto kept = static_cast<int>(std::min<uint32_t>(size, 256));
    std::string* into = number == 1 ? model : number == 3 ? id : nullptr;
    std::string value;
    if (into ? !(in.ReadString(&value, kept) && in.Skip(static_cast<int>(size) - kept))
             : !in.Skip(static_cast<int>(size))) {
      return;
    }
    if (into) *into = std::move(value);
  }
}

}  // namespace quern
