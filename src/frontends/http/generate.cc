#include "frontends/http/generate.h"

#include <rapidjson/document.h>
#include <rapidjson/stringbuffer.h>
#include <rapidjson/writer.h>

#include <cstring>
#include <limits>
#include <vector>

#include "core/json.h"
#include "protocol/kserve_codec.h"

namespace quern {
namespace {

using Value = rapidjson::Value;

// A member's shape (a scalar: [1]) and its elements in order; an array must be
// rectangular.
Status Flatten(const Value& v, const std::string& where, Shape& shape, std::vector<const Value*>& leaves) {
  if (!v.IsArray()) {
    shape = {1};
    leaves.push_back(&v);
    return Status::Ok();
  }
  shape.clear();
  for (const Value* at = &v; at->IsArray(); at = &(*at)[0]) {
    shape.push_back(at->Size());
    if (at->Empty()) break;
  }
  // Each array at depth d has shape[d] elements, arrays down to the last dimension, leaves there.
  struct Frame {
    const Value* array;
    size_t depth;
  };
  std::vector<Frame> stack = {{&v, 0}};
  while (!stack.empty()) {
    const Frame f = stack.back();
    stack.pop_back();
    if (static_cast<int64_t>(f.array->Size()) != shape[f.depth]) {
      return InvalidArgument(where + ": the arrays are not all the same length at depth " +
                             std::to_string(f.depth + 1) + " (a tensor is rectangular)");
    }
    const bool last = f.depth + 1 == shape.size();
    for (rapidjson::SizeType i = f.array->Size(); i-- > 0;) {
      const Value& e = (*f.array)[i];
      if (last != !e.IsArray()) return InvalidArgument(where + ": the arrays are not all nested equally deep");
      if (!last) stack.push_back({&e, f.depth + 1});
    }
    if (last) {
      // (The arrays of the last dimension come off the stack in order: pushed in reverse.)
      for (const Value& e : f.array->GetArray()) leaves.push_back(&e);
    }
  }
  return Status::Ok();
}

template <typename T>
Status FillIntegers(const std::vector<const Value*>& leaves, const std::string& where, std::byte* out) {
  for (size_t i = 0; i < leaves.size(); ++i) {
    const Value& e = *leaves[i];
    T v{};
    if constexpr (std::is_signed_v<T>) {
      if (!e.IsInt64() || e.GetInt64() < std::numeric_limits<T>::min() || e.GetInt64() > std::numeric_limits<T>::max())
        return InvalidArgument(where + ": element " + std::to_string(i) + " is not an integer that fits");
      v = static_cast<T>(e.GetInt64());
    } else {
      if (!e.IsUint64() || e.GetUint64() > std::numeric_limits<T>::max())
        return InvalidArgument(where + ": element " + std::to_string(i) + " is not an integer that fits");
      v = static_cast<T>(e.GetUint64());
    }
    std::memcpy(out + i * sizeof(T), &v, sizeof(T));
  }
  return Status::Ok();
}

template <typename T>
Status FillFloats(const std::vector<const Value*>& leaves, const std::string& where, std::byte* out) {
  for (size_t i = 0; i < leaves.size(); ++i) {
    if (!leaves[i]->IsNumber()) return InvalidArgument(where + ": element " + std::to_string(i) + " is not a number");
    const T v = static_cast<T>(leaves[i]->GetDouble());
    std::memcpy(out + i * sizeof(T), &v, sizeof(T));
  }
  return Status::Ok();
}

Result<Tensor> ToTensor(const std::string& model, const TensorConfig& tc, const Value& v, bool batched) {
  const std::string where = "model '" + model + "' input '" + tc.name + "'";
  Shape shape;
  std::vector<const Value*> leaves;
  QUERN_RETURN_IF_ERROR(Flatten(v, where, shape, leaves));
  if (batched) shape.insert(shape.begin(), 1);
  if (tc.dtype == DataType::kBytes) {
    std::vector<std::string> values;
    values.reserve(leaves.size());
    for (size_t i = 0; i < leaves.size(); ++i) {
      if (!leaves[i]->IsString()) {
        return Err(InvalidArgument(where + " is BYTES: element " + std::to_string(i) + " is not a string"));
      }
      values.emplace_back(leaves[i]->GetString(), leaves[i]->GetStringLength());
    }
    return Tensor::FromStrings(std::move(shape), values);
  }
  const size_t size = DataTypeByteSize(tc.dtype);
  if (size == 0 || tc.dtype == DataType::kFp16 || tc.dtype == DataType::kBf16) {
    return Err(InvalidArgument(where + " is " + std::string(DataTypeName(tc.dtype)) +
                               ", which generate's JSON does not carry: POST .../infer with binary data"));
  }
  Tensor t = Tensor::Allocate(tc.dtype, shape, leaves.size() * size);
  std::byte* out = t.mutable_data();
  Status st;
  switch (tc.dtype) {
    case DataType::kBool:
      for (size_t i = 0; i < leaves.size() && st.ok(); ++i) {
        if (!leaves[i]->IsBool()) {
          st = InvalidArgument(where + " is BOOL: element " + std::to_string(i) + " is not true or false");
        } else {
          out[i] = std::byte{leaves[i]->GetBool() ? uint8_t{1} : uint8_t{0}};
        }
      }
      break;
    case DataType::kUint8: st = FillIntegers<uint8_t>(leaves, where, out); break;
    case DataType::kUint16: st = FillIntegers<uint16_t>(leaves, where, out); break;
    case DataType::kUint32: st = FillIntegers<uint32_t>(leaves, where, out); break;
    case DataType::kUint64: st = FillIntegers<uint64_t>(leaves, where, out); break;
    case DataType::kInt8: st = FillIntegers<int8_t>(leaves, where, out); break;
    case DataType::kInt16: st = FillIntegers<int16_t>(leaves, where, out); break;
    case DataType::kInt32: st = FillIntegers<int32_t>(leaves, where, out); break;
    case DataType::kInt64: st = FillIntegers<int64_t>(leaves, where, out); break;
    case DataType::kFp32: st = FillFloats<float>(leaves, where, out); break;
    case DataType::kFp64: st = FillFloats<double>(leaves, where, out); break;
    default: st = InvalidArgument(where + ": a type generate's JSON does not carry");
  }
  if (!st.ok()) return Err(st);
  return t;
}

}  // namespace

Result<InferRequest> ParseGenerateBody(const ModelConfig& config, int64_t version, std::string_view body) {
  rapidjson::Document doc;
  JsonParseError error;
  if (!ParseJson(doc, body.data(), body.size(), error)) {
    return Err(InvalidArgument("model '" + config.name + "': the generate request is not JSON (" + error.message +
                               " at byte " + std::to_string(error.offset) + ")"));
  }
  if (!doc.IsObject()) {
    return Err(InvalidArgument("model '" + config.name +
                               "': the generate request must be a JSON object whose members are its inputs"));
  }
  InferRequest request;
  request.model = config.name;
  request.version = version;
  for (const auto& m : doc.GetObject()) {
    const std::string name(m.name.GetString(), m.name.GetStringLength());
    const TensorConfig* tc = config.FindInput(name);
    if (!tc && name == "parameters" && m.value.IsObject()) {  // the model's (request.parameters())
      QUERN_ASSIGN_OR_RETURN(request.parameters, KServeModelParameters(m.value, config.name));
      continue;
    }
    if (!tc) continue;  // members that name no input
    auto tensor = ToTensor(config.name, *tc, m.value, config.max_batch_size > 0);
    if (!tensor) return Err(tensor.error());
    request.inputs.push_back({name, std::move(*tensor)});
  }
  return request;
}

Result<std::string> GenerateAnswerJson(const InferResponse& response) {
  rapidjson::StringBuffer buf;
  JsonWriter w(buf, SharedCrtAllocator());
  w.StartObject();
  w.Key("model_name");
  w.String(response.model.c_str(), static_cast<rapidjson::SizeType>(response.model.size()));
  w.Key("model_version");
  const std::string version = std::to_string(response.version);
  w.String(version.c_str(), static_cast<rapidjson::SizeType>(version.size()));
  for (const NamedTensor& out : response.outputs) {
    w.Key(out.name.c_str(), static_cast<rapidjson::SizeType>(out.name.size()));
    const Tensor& t = out.tensor;
    if (t.element_count() == 1 && t.dtype() == DataType::kBytes) {
      auto strings = t.Strings();
      if (!strings) return Err(strings.error());
      const std::string text = ValidUtf8((*strings)[0]);
      w.String(text.c_str(), static_cast<rapidjson::SizeType>(text.size()));
      continue;
    }
    if (t.element_count() == 1 && t.dtype() != DataType::kFp16 && t.dtype() != DataType::kBf16) {
      // The one element, not an array of it: what WriteKServeData writes, unwrapped.
      rapidjson::StringBuffer one;
      JsonWriter inner(one, SharedCrtAllocator());
      QUERN_RETURN_IF_ERROR(WriteKServeData(inner, t));
      std::string_view text(one.GetString(), one.GetSize());
      text = text.substr(1, text.size() - 2);  // "[...]"
      w.RawValue(text.data(), text.size(), rapidjson::kNumberType);
      continue;
    }
    QUERN_RETURN_IF_ERROR(WriteKServeData(w, t));
  }
  w.EndObject();
  return std::string(buf.GetString(), buf.GetSize());
}

}  // namespace quern
