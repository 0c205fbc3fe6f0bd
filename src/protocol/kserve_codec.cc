#include "protocol/kserve_codec.h"

#include <rapidjson/document.h>

#include <charconv>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "core/json.h"

namespace quern {
namespace {

using Writer = JsonWriter;

void WriteShape(Writer& w, const Shape& s) {
  w.StartArray();
  for (int64_t d : s) w.Int64(d);
  w.EndArray();
}

// Flattens (possibly nested) JSON arrays into `out` in row-major order.
void Flatten(const rapidjson::Value& v, std::vector<const rapidjson::Value*>& out) {
  if (v.IsArray()) {
    for (const auto& e : v.GetArray()) Flatten(e, out);
  } else {
    out.push_back(&v);
  }
}

template <typename T>
Result<Tensor> Numbers(DataType type, Shape shape, const std::vector<const rapidjson::Value*>& vals,
                       const std::string& where) {
  std::vector<T> data;
  data.reserve(vals.size());
  for (const auto* v : vals) {
    if constexpr (std::is_floating_point_v<T>) {
      if (!v->IsNumber())
        return Err(InvalidArgument(where + ": expected numbers for " + std::string(DataTypeName(type))));
      data.push_back(static_cast<T>(v->GetDouble()));
    } else if constexpr (std::is_same_v<T, bool>) {
      if (!v->IsBool()) return Err(InvalidArgument(where + ": expected true/false for BOOL"));
      data.push_back(v->GetBool());
    } else if constexpr (std::is_signed_v<T>) {
      if (!v->IsInt64())
        return Err(InvalidArgument(where + ": expected integers for " + std::string(DataTypeName(type))));
      data.push_back(static_cast<T>(v->GetInt64()));
    } else {
      if (!v->IsUint64()) {
        return Err(InvalidArgument(where + ": expected non-negative integers for " + std::string(DataTypeName(type))));
      }
      data.push_back(static_cast<T>(v->GetUint64()));
    }
  }
  if constexpr (std::is_same_v<T, bool>) {
    std::vector<uint8_t> bytes(data.begin(), data.end());
    return Tensor::From<uint8_t>(type, std::move(shape), bytes);
  } else {
    return Tensor::From<T>(type, std::move(shape), data);
  }
}

// Where binary input data comes from: the bytes after the JSON header,
// consumed in input order (KServe binary tensor extension).
struct BinaryCursor {
  std::string_view data;
  std::shared_ptr<const void> owner;
  size_t offset = 0;
};

// The member `key` of `v` when `v` is an object that has it, else null: one
// lookup where HasMember and operator[] take two (or three).
const rapidjson::Value* Member(const rapidjson::Value& v, const char* key) {
  if (!v.IsObject()) return nullptr;
  const auto it = v.FindMember(key);
  return it == v.MemberEnd() ? nullptr : &it->value;
}

Result<Tensor> ParseJsonTensor(const rapidjson::Value& in, const std::string& model, std::string& name,
                               BinaryCursor& binary) {
  const rapidjson::Value* name_value = Member(in, "name");
  if (!name_value || !name_value->IsString()) {
    return Err(InvalidArgument("model '" + model + "': every input needs a string 'name'"));
  }
  name = name_value->GetString();
  // Named in errors only: built when one is.
  auto where = [&] { return "model '" + model + "' input '" + name + "'"; };
  const rapidjson::Value* datatype = Member(in, "datatype");
  if (!datatype || !datatype->IsString()) return Err(InvalidArgument(where() + ": 'datatype' is missing"));
  auto type = DataTypeFromName(datatype->GetString());
  if (!type) return Err(InvalidArgument(where() + ": unknown datatype '" + std::string(datatype->GetString()) + "'"));
  const rapidjson::Value* dims = Member(in, "shape");
  if (!dims || !dims->IsArray()) return Err(InvalidArgument(where() + ": 'shape' is missing"));
  if (dims->Size() > kMaxTensorRank) {
    return Err(InvalidArgument(where() + ": 'shape' has " + std::to_string(dims->Size()) + " dimensions; at most " +
                               std::to_string(kMaxTensorRank) + " are accepted"));
  }
  Shape shape;
  shape.reserve(dims->Size());
  for (const auto& d : dims->GetArray()) {
    if (!d.IsInt64() || d.GetInt64() < 0)
      return Err(InvalidArgument(where() + ": 'shape' must hold non-negative integers"));
    shape.push_back(d.GetInt64());
  }
  if (ElementCount(shape) < 0) {
    return Err(InvalidArgument(where() + ": shape " + ShapeToString(shape) + " has more elements than fit in 64 bits"));
  }
  const rapidjson::Value* parameters = Member(in, "parameters");
  if (const rapidjson::Value* size = parameters ? Member(*parameters, "binary_data_size") : nullptr) {
    if (!size->IsUint64()) return Err(InvalidArgument(where() + ": binary_data_size must be a non-negative integer"));
    const uint64_t n = size->GetUint64();
    const size_t left = binary.data.size() - binary.offset;
    if (n > left) {
      return Err(InvalidArgument(where() + ": binary_data_size " + std::to_string(n) + " but only " +
                                 std::to_string(left) + " bytes of binary data remain in the request"));
    }
    // Zero copy: the tensor views the request's bytes, which it keeps alive.
    Tensor t = Tensor::Borrow(*type, std::move(shape), binary.data.data() + binary.offset, n, binary.owner);
    binary.offset += n;
    return t;
  }
  const rapidjson::Value* data = Member(in, "data");
  if (!data) return Err(InvalidArgument(where() + ": neither 'data' nor parameters.binary_data_size is given"));
  std::vector<const rapidjson::Value*> vals;
  Flatten(*data, vals);
  if (static_cast<int64_t>(vals.size()) != ElementCount(shape)) {
    return Err(InvalidArgument(where() + ": shape " + ShapeToString(shape) + " needs " +
                               std::to_string(ElementCount(shape)) + " values, 'data' has " +
                               std::to_string(vals.size())));
  }
  switch (*type) {
    case DataType::kBool: return Numbers<bool>(*type, shape, vals, where());
    case DataType::kUint8: return Numbers<uint8_t>(*type, shape, vals, where());
    case DataType::kUint16: return Numbers<uint16_t>(*type, shape, vals, where());
    case DataType::kUint32: return Numbers<uint32_t>(*type, shape, vals, where());
    case DataType::kUint64: return Numbers<uint64_t>(*type, shape, vals, where());
    case DataType::kInt8: return Numbers<int8_t>(*type, shape, vals, where());
    case DataType::kInt16: return Numbers<int16_t>(*type, shape, vals, where());
    case DataType::kInt32: return Numbers<int32_t>(*type, shape, vals, where());
    case DataType::kInt64: return Numbers<int64_t>(*type, shape, vals, where());
    case DataType::kFp32: return Numbers<float>(*type, shape, vals, where());
    case DataType::kFp64: return Numbers<double>(*type, shape, vals, where());
    case DataType::kBytes: {
      std::vector<std::string> strs;
      for (const auto* v : vals) {
        if (!v->IsString()) return Err(InvalidArgument(where() + ": expected strings for BYTES"));
        strs.emplace_back(v->GetString(), v->GetStringLength());
      }
      return Tensor::FromStrings(shape, strs);
    }
    default:
      return Err(InvalidArgument(where() + ": datatype " + std::string(DataTypeName(*type)) +
                                 " cannot be sent as JSON; use binary tensor data"));
  }
}

template <typename T>
void WriteValues(Writer& w, const Tensor& t) {
  for (T v : t.values<T>()) {
    if constexpr (std::is_floating_point_v<T>) {
      if (!std::isfinite(v)) {
        // JSON has no infinities or NaN; written as JavaScript and Python's
        // json module write (and read) them, as Triton does.
        const char* text = std::isnan(v) ? "NaN" : v > 0 ? "Infinity" : "-Infinity";
        w.RawValue(text, std::strlen(text), rapidjson::kNumberType);
        continue;
      }
      w.Double(static_cast<double>(v));
    } else if constexpr (std::is_signed_v<T>) {
      w.Int64(static_cast<int64_t>(v));
    } else {
      w.Uint64(static_cast<uint64_t>(v));
    }
  }
}

}  // namespace

Status WriteKServeData(JsonWriter& w, const Tensor& t) {
  w.StartArray();
  switch (t.dtype()) {
    case DataType::kBool:
      for (uint8_t v : t.values<uint8_t>()) w.Bool(v != 0);
      break;
    case DataType::kUint8: WriteValues<uint8_t>(w, t); break;
    case DataType::kUint16: WriteValues<uint16_t>(w, t); break;
    case DataType::kUint32: WriteValues<uint32_t>(w, t); break;
    case DataType::kUint64: WriteValues<uint64_t>(w, t); break;
    case DataType::kInt8: WriteValues<int8_t>(w, t); break;
    case DataType::kInt16: WriteValues<int16_t>(w, t); break;
    case DataType::kInt32: WriteValues<int32_t>(w, t); break;
    case DataType::kInt64: WriteValues<int64_t>(w, t); break;
    case DataType::kFp32: WriteValues<float>(w, t); break;
    case DataType::kFp64: WriteValues<double>(w, t); break;
    case DataType::kBytes: {
      auto strs = t.Strings();
      if (!strs) return strs.error();
      for (auto s : *strs) w.String(s.data(), static_cast<rapidjson::SizeType>(s.size()));
      break;
    }
    default:
      return Unimplemented("output of type " + std::string(DataTypeName(t.dtype())) + " cannot be written as JSON yet");
  }
  w.EndArray();
  return Status::Ok();
}

bool KServeOutputFormat::WantsBinary(const std::string& name) const {
  for (const auto& [n, b] : binary_outputs) {
    if (n == name) return b;
  }
  return binary_default;
}

Result<KServeInfer> ParseKServeInfer(const std::string& model, int64_t version, std::string_view json,
                                     std::string_view binary_data, std::shared_ptr<const void> owner) {
  ScratchDocument scratch;
  rapidjson::Document& doc = scratch.doc();
  if (JsonParseError e; !ParseJson(doc, json.data(), json.size(), e)) {
    return Err(InvalidArgument("model '" + model + "': malformed JSON request at offset " + std::to_string(e.offset) +
                               ": " + e.message));
  }
  const rapidjson::Value* inputs = Member(doc, "inputs");
  if (!inputs || !inputs->IsArray()) {
    return Err(InvalidArgument("model '" + model + "': the request needs an 'inputs' array"));
  }
  KServeInfer out;
  InferRequest& ir = out.request;
  ir.model = model;
  ir.version = version;
  BinaryCursor binary{binary_data, std::move(owner)};
  for (const auto& in : inputs->GetArray()) {
    std::string name;
    auto t = ParseJsonTensor(in, model, name, binary);
    if (!t) return Err(t.error());
    ir.inputs.push_back({std::move(name), std::move(*t)});
  }
  if (binary.offset != binary.data.size()) {
    return Err(InvalidArgument("model '" + model + "': " + std::to_string(binary.data.size() - binary.offset) +
                               " bytes of binary data are not claimed by any input's binary_data_size"));
  }
  // Which outputs come back as binary: per output, else the request default.
  if (const rapidjson::Value* p = Member(doc, "parameters"); p && p->IsObject()) {
    if (const rapidjson::Value* priority = Member(*p, "priority")) {
      if (!priority->IsUint()) return Err(InvalidArgument("parameter 'priority' must be an unsigned integer"));
      ir.priority = priority->GetUint();
    }
    if (const rapidjson::Value* timeout = Member(*p, "timeout")) {
      if (!timeout->IsUint64()) {
        return Err(InvalidArgument("parameter 'timeout' must be microseconds as an unsigned integer"));
      }
      ir.timeout_us = timeout->GetUint64();
    }
    if (const rapidjson::Value* b = Member(*p, "binary_data_output"); b && b->IsBool()) {
      out.format.binary_default = b->GetBool();
    }
  }
  if (const rapidjson::Value* outputs = Member(doc, "outputs"); outputs && outputs->IsArray()) {
    for (const auto& o : outputs->GetArray()) {
      const rapidjson::Value* name = Member(o, "name");
      if (!name || !name->IsString()) {
        return Err(InvalidArgument("model '" + model + "': every requested output needs a string 'name'"));
      }
      bool bin = out.format.binary_default;
      const rapidjson::Value* parameters = Member(o, "parameters");
      if (const rapidjson::Value* b = parameters ? Member(*parameters, "binary_data") : nullptr; b && b->IsBool()) {
        bin = b->GetBool();
      }
      ir.requested_outputs.emplace_back(name->GetString());
      out.format.binary_outputs.emplace_back(name->GetString(), bin);
    }
  }
  if (const rapidjson::Value* id = Member(doc, "id"); id && id->IsString()) out.format.id = id->GetString();
  return out;
}

Status WriteKServeOutputs(JsonWriter& w, const std::vector<NamedTensor>& outputs, const KServeOutputFormat& format,
                          std::vector<const Tensor*>& binary_parts) {
  w.StartArray();
  for (const auto& o : outputs) {
    w.StartObject();
    w.Key("name");
    w.String(o.name.c_str());
    w.Key("datatype");
    const std::string_view datatype = DataTypeName(o.tensor.dtype());
    w.String(datatype.data(), static_cast<rapidjson::SizeType>(datatype.size()));
    w.Key("shape");
    WriteShape(w, o.tensor.shape());
    if (format.WantsBinary(o.name)) {
      w.Key("parameters");
      w.StartObject();
      w.Key("binary_data_size");
      w.Uint64(o.tensor.byte_size());
      w.EndObject();
      binary_parts.push_back(&o.tensor);
    } else {
      w.Key("data");
      QUERN_RETURN_IF_ERROR(WriteKServeData(w, o.tensor));
    }
    w.EndObject();
  }
  w.EndArray();
  return Status::Ok();
}

Result<KServeInfer> ParseKServeInferBody(const std::string& model, int64_t version, std::string body,
                                         std::string_view json_length) {
  auto owned = std::make_shared<const std::string>(std::move(body));
  size_t json_size = owned->size();
  if (!json_length.empty()) {
    auto [p, ec] = std::from_chars(json_length.data(), json_length.data() + json_length.size(), json_size);
    if (ec != std::errc() || p != json_length.data() + json_length.size() || json_size > owned->size()) {
      return Err(InvalidArgument("model '" + model + "': Inference-Header-Content-Length '" +
                                 std::string(json_length.substr(0, 64)) + "' is not a size within the " +
                                 std::to_string(owned->size()) + "-byte body"));
    }
  }
  const std::string_view all(*owned);
  return ParseKServeInfer(model, version, all.substr(0, json_size), all.substr(json_size), std::move(owned));
}

Status WriteKServeResult(JsonWriter& w, std::string_view id, std::string_view model, int64_t version,
                         const std::vector<NamedTensor>& outputs, const KServeOutputFormat& format,
                         std::vector<const Tensor*>& binary_parts) {
  w.StartObject();
  if (!id.empty()) {
    w.Key("id");
    w.String(id.data(), static_cast<rapidjson::SizeType>(id.size()));
  }
  w.Key("model_name");
  w.String(model.data(), static_cast<rapidjson::SizeType>(model.size()));
  w.Key("model_version");
  const std::string v = std::to_string(version);
  w.String(v.data(), static_cast<rapidjson::SizeType>(v.size()));
  w.Key("outputs");
  QUERN_RETURN_IF_ERROR(WriteKServeOutputs(w, outputs, format, binary_parts));
  w.EndObject();
  return Status::Ok();
}

KServeMessage JoinKServeMessage(const rapidjson::StringBuffer& json, const std::vector<const Tensor*>& binary_parts) {
  KServeMessage m;
  m.json_size = json.GetSize();
  m.binary = !binary_parts.empty();
  size_t total = m.json_size;
  for (const Tensor* t : binary_parts) total += t->byte_size();
  m.bytes.reserve(total);
  m.bytes.assign(json.GetString(), json.GetSize());
  for (const Tensor* t : binary_parts) m.bytes.append(reinterpret_cast<const char*>(t->data()), t->byte_size());
  return m;
}

}  // namespace quern
