#include "protocol/kserve_codec.h"

#include <rapidjson/document.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstring>
#include <limits>
#include <set>
#include <type_traits>

#include "core/json.h"
#include "core/memory.h"

namespace quern {
namespace {

using Writer = JsonWriter;

// An object key known when compiling, with nothing to escape, kept quoted:
// written as is (no length to count, no character to check).
template <size_t N>
struct JsonKey {
  char quoted[N + 1] = {};                   // '"', the key's N - 1 characters, '"'
  constexpr JsonKey(const char (&key)[N]) {  // NOLINT: implicit, for Key<"name">
    quoted[0] = '"';
    for (size_t i = 0; i + 1 < N; ++i) quoted[i + 1] = key[i];
    quoted[N] = '"';
  }
};

template <JsonKey K>
void Key(Writer& w) {
  static_assert([] {  // nothing JSON would escape between the quotes
    for (size_t i = 1; i + 1 < sizeof K.quoted; ++i) {
      const char c = K.quoted[i];
      if (c == '"' || c == '\\' || static_cast<unsigned char>(c) < 0x20) return false;
    }
    return true;
  }());
  w.RawValue(K.quoted, sizeof K.quoted, rapidjson::kStringType);
}

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
// The value of member `key` (a literal: its length is known, so no strlen
// and no temporary value per look-up) of object `v`; the first if repeated.
template <size_t N>
const rapidjson::Value* Member(const rapidjson::Value& v, const char (&key)[N]) {
  if (!v.IsObject()) return nullptr;
  constexpr rapidjson::SizeType n = N - 1;
  for (auto it = v.MemberBegin(); it != v.MemberEnd(); ++it) {
    if (it->name.GetStringLength() == n && std::memcmp(it->name.GetString(), key, n) == 0) return &it->value;
  }
  return nullptr;
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

bool IsServerParameter(std::string_view key) {
  return key == "priority" || key == "timeout" || key == "binary_data_output" || key == "sequence_id" ||
         key == "sequence_start" || key == "sequence_end" || key == "headers" || key.starts_with("triton_");
}

Result<std::string> KServeModelParameters(const rapidjson::Value& p, const std::string& model) {
  rapidjson::StringBuffer buffer;
  JsonWriter w(buffer);
  w.StartObject();
  bool any = false;
  std::set<std::string_view> seen;
  for (const auto& m : p.GetObject()) {
    const std::string_view key(m.name.GetString(), m.name.GetStringLength());
    // The reader takes any bytes in a string; a model's JSON reader refuses what is not UTF-8.
    if (!IsUtf8(key)) return Err(InvalidArgument("model '" + model + "': a parameter's name is not valid UTF-8"));
    if (IsServerParameter(key)) continue;
    if (!seen.insert(key).second) {
      return Err(InvalidArgument("model '" + model + "': parameter '" + std::string(key) + "' is given twice"));
    }
    const rapidjson::Value& v = m.value;
    if (!v.IsBool() && !v.IsNumber() && !v.IsString()) {
      return Err(InvalidArgument("model '" + model + "': parameter '" + std::string(key) +
                                 "' must be a bool, a number or a string"));
    }
    if (v.IsString() && !IsUtf8(std::string_view(v.GetString(), v.GetStringLength()))) {
      return Err(InvalidArgument("model '" + model + "': parameter '" + std::string(key) + "' is not valid UTF-8"));
    }
    if (v.IsDouble() && !std::isfinite(v.GetDouble())) {
      return Err(
          InvalidArgument("model '" + model + "': parameter '" + std::string(key) + "' must be a finite number"));
    }
    w.Key(key.data(), static_cast<rapidjson::SizeType>(key.size()));
    v.Accept(w);
    any = true;
    if (buffer.GetSize() > kMaxRequestParametersBytes) break;  // refused below, however many follow
  }
  w.EndObject();
  if (!any) return std::string();
  if (buffer.GetSize() > kMaxRequestParametersBytes) {
    return Err(InvalidArgument("model '" + model + "': the request's parameters take at least " +
                               std::to_string(buffer.GetSize()) + " bytes; at most " +
                               std::to_string(kMaxRequestParametersBytes) + " are accepted"));
  }
  return std::string(buffer.GetString(), buffer.GetSize());
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
    QUERN_ASSIGN_OR_RETURN(ir.parameters, KServeModelParameters(*p, model));
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
      if (const rapidjson::Value* c = parameters ? Member(*parameters, "classification") : nullptr) {
        if (!c->IsInt64() || c->GetInt64() < 1) {
          return Err(InvalidArgument("model '" + model + "' output '" + name->GetString() +
                                     "': parameter 'classification' must be a positive integer (the number of "
                                     "classes to return)"));
        }
        out.format.classifications.emplace_back(name->GetString(), c->GetInt64());
      }
      ir.requested_outputs.emplace_back(name->GetString());
      out.format.binary_outputs.emplace_back(name->GetString(), bin);
    }
  }
  if (const rapidjson::Value* id = Member(doc, "id"); id && id->IsString()) out.format.id = id->GetString();
  return out;
}

namespace {

// At most this many classes in one answer (rows x k): a count beyond the
// output's size means all of it, and an output of millions of values would
// otherwise become as many strings.
constexpr int64_t kMaxClassifications = int64_t{1} << 20;

template <typename T>
T Load(const Tensor& t, int64_t i) {
  T v;
  std::memcpy(&v, reinterpret_cast<const char*>(t.data()) + i * static_cast<int64_t>(sizeof(T)), sizeof(T));
  return v;
}

// IEEE half bits to double.
double HalfToDouble(uint16_t h) {
  const int exp = (h >> 10) & 0x1f;
  const int mant = h & 0x3ff;
  const double sign = (h & 0x8000) ? -1.0 : 1.0;
  if (exp == 0) return sign * std::ldexp(mant, -24);
  if (exp == 31) return mant ? std::numeric_limits<double>::quiet_NaN() : sign * HUGE_VAL;
  return sign * std::ldexp(mant + 1024, exp - 25);
}

float Bf16ToFloat(uint16_t b) {
  const uint32_t bits = uint32_t{b} << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// The k best of a row's n values key(0..n-1), best first: highest, equal
// values by index, NaN after every number. Keys compare in their own type
// (64-bit integers exactly); memory O(k): a heap of the best so far.
template <typename K, typename KeyAt>
void TopK(int64_t n, int64_t k, const KeyAt& key, std::vector<int64_t>& best) {
  const auto before = [&](int64_t a, int64_t b) {  // a ranks before b
    const K va = key(a), vb = key(b);
    if constexpr (std::is_floating_point_v<K>) {
      const bool na = std::isnan(va), nb = std::isnan(vb);
      if (na != nb) return nb;
      if (!na && va != vb) return va > vb;
    } else {
      if (va != vb) return va > vb;
    }
    return a < b;
  };
  best.clear();
  for (int64_t i = 0; i < n; ++i) {  // the heap's top is the worst kept
    if (static_cast<int64_t>(best.size()) < k) {
      best.push_back(i);
      std::push_heap(best.begin(), best.end(), before);
    } else if (before(i, best.front())) {
      std::pop_heap(best.begin(), best.end(), before);
      best.back() = i;
      std::push_heap(best.begin(), best.end(), before);
    }
  }
  std::sort_heap(best.begin(), best.end(), before);
}

// Ranks each row of `t` by K keys read with `load(element index)` and
// writes "<text of the value>:<index>[:<label>]" for the k best.
template <typename K, typename LoadAt>
void ClassifyRows(int64_t rows, int64_t per_row, int64_t k, const LoadAt& load, const std::vector<std::string>* labels,
                  std::vector<std::string>& out) {
  std::vector<int64_t> best;
  best.reserve(static_cast<size_t>(k));
  char num[64];
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t base = r * per_row;
    TopK<K>(
        per_row, k, [&](int64_t i) { return static_cast<K>(load(base + i)); }, best);
    for (const int64_t idx : best) {
      const auto v = load(base + idx);
      std::string s(num, std::to_chars(num, num + sizeof num, v).ptr);
      s += ':';
      s += std::to_string(idx);
      if (labels && idx < static_cast<int64_t>(labels->size()) && !(*labels)[static_cast<size_t>(idx)].empty()) {
        s += ':';
        s += (*labels)[static_cast<size_t>(idx)];
      }
      out.push_back(std::move(s));
    }
  }
}

}  // namespace

Result<Tensor> ClassifyOutput(const Tensor& output, int64_t count, const std::vector<std::string>* labels,
                              std::string_view where) {
  if (count < 1) {
    return Err(InvalidArgument(std::string(where) + ": parameter 'classification' must be a positive count, got " +
                               std::to_string(count)));
  }
  const DataType type = output.dtype();
  if (type == DataType::kBytes || type == DataType::kInvalid) {
    return Err(InvalidArgument(std::string(where) + ": classification needs a numeric output, this one is " +
                               std::string(DataTypeName(type))));
  }
  if (Status st = output.Validate(); !st.ok()) {
    return Err(InvalidArgument(std::string(where) + ": cannot classify: " + st.message()));
  }
  const Shape& shape = output.shape();
  const int64_t total = output.element_count();
  const int64_t rows = shape.size() >= 2 ? shape[0] : 1;
  const int64_t per_row = rows > 0 ? total / rows : 0;
  const int64_t k = std::min(count, per_row);
  // No values (a dimension of 0): nothing to rank, however many rows.
  if (k == 0) return Tensor::FromStrings(shape.size() >= 2 ? Shape{rows, 0} : Shape{0}, {});
  if (rows * k > kMaxClassifications) {  // rows * k <= total: no overflow
    return Err(InvalidArgument(std::string(where) + ": classification of " + std::to_string(k) + " classes in " +
                               std::to_string(rows) + " rows would return " + std::to_string(rows * k) +
                               " strings; at most " + std::to_string(kMaxClassifications) + " are returned"));
  }
  std::vector<std::string> out;
  out.reserve(static_cast<size_t>(rows * k));
  const auto rank = [&](auto key_type, const auto& load) {
    ClassifyRows<decltype(key_type)>(rows, per_row, k, load, labels, out);
  };
  const Tensor& t = output;
  switch (type) {
    case DataType::kBool: rank(uint64_t{}, [&](int64_t i) { return uint64_t{Load<uint8_t>(t, i) != 0}; }); break;
    case DataType::kUint8: rank(uint64_t{}, [&](int64_t i) { return Load<uint8_t>(t, i); }); break;
    case DataType::kUint16: rank(uint64_t{}, [&](int64_t i) { return Load<uint16_t>(t, i); }); break;
    case DataType::kUint32: rank(uint64_t{}, [&](int64_t i) { return Load<uint32_t>(t, i); }); break;
    case DataType::kUint64: rank(uint64_t{}, [&](int64_t i) { return Load<uint64_t>(t, i); }); break;
    case DataType::kInt8: rank(int64_t{}, [&](int64_t i) { return Load<int8_t>(t, i); }); break;
    case DataType::kInt16: rank(int64_t{}, [&](int64_t i) { return Load<int16_t>(t, i); }); break;
    case DataType::kInt32: rank(int64_t{}, [&](int64_t i) { return Load<int32_t>(t, i); }); break;
    case DataType::kInt64: rank(int64_t{}, [&](int64_t i) { return Load<int64_t>(t, i); }); break;
    case DataType::kFp32: rank(double{}, [&](int64_t i) { return Load<float>(t, i); }); break;
    case DataType::kFp64: rank(double{}, [&](int64_t i) { return Load<double>(t, i); }); break;
    case DataType::kFp16:
      rank(double{}, [&](int64_t i) { return static_cast<float>(HalfToDouble(Load<uint16_t>(t, i))); });
      break;
    case DataType::kBf16: rank(double{}, [&](int64_t i) { return Bf16ToFloat(Load<uint16_t>(t, i)); }); break;
    default: break;
  }
  Shape result = shape.size() >= 2 ? Shape{rows, k} : Shape{k};
  return Tensor::FromStrings(std::move(result), out);
}

Status ApplyClassifications(std::vector<NamedTensor>& outputs, const KServeOutputFormat& format, std::string_view model,
                            const OutputLabels& labels) {
  // An output asked for twice is classified once (by the first count).
  std::vector<bool> classified(outputs.size(), false);
  for (const auto& [name, count] : format.classifications) {
    for (size_t i = 0; i < outputs.size(); ++i) {
      NamedTensor& o = outputs[i];
      if (o.name != name || classified[i]) continue;
      const std::string where = "model '" + std::string(model) + "' output '" + name + "'";
      const auto names = labels ? labels(name) : nullptr;
      auto top = ClassifyOutput(o.tensor, count, names.get(), where);
      if (!top) return top.error();
      o.tensor = std::move(*top);
      classified[i] = true;
    }
  }
  return Status::Ok();
}

Status WriteKServeOutputs(JsonWriter& w, const std::vector<NamedTensor>& outputs, const KServeOutputFormat& format,
                          std::vector<const Tensor*>& binary_parts) {
  w.StartArray();
  for (const auto& o : outputs) {
    w.StartObject();
    Key<"name">(w);
    w.String(o.name.c_str());
    Key<"datatype">(w);
    const std::string_view datatype = DataTypeName(o.tensor.dtype());
    w.String(datatype.data(), static_cast<rapidjson::SizeType>(datatype.size()));
    Key<"shape">(w);
    WriteShape(w, o.tensor.shape());
    if (format.WantsBinary(o.name)) {
      Key<"parameters">(w);
      w.StartObject();
      Key<"binary_data_size">(w);
      w.Uint64(o.tensor.byte_size());
      w.EndObject();
      binary_parts.push_back(&o.tensor);
    } else {
      Key<"data">(w);
      QUERN_RETURN_IF_ERROR(WriteKServeData(w, o.tensor));
    }
    w.EndObject();
  }
  w.EndArray();
  return Status::Ok();
}

std::shared_ptr<const std::string> ShareBody(std::string body) {
  struct PooledBody {
    explicit PooledBody(std::string&& b) : bytes(std::move(b)) {}
    ~PooledBody() { GiveBodyBuffer(std::move(bytes)); }
    PooledBody(const PooledBody&) = delete;
    PooledBody& operator=(const PooledBody&) = delete;
    std::string bytes;
  };
  auto holder = std::make_shared<PooledBody>(std::move(body));
  return std::shared_ptr<const std::string>(holder, &holder->bytes);
}

Result<KServeInfer> ParseKServeInferBody(const std::string& model, int64_t version, std::string body,
                                         std::string_view json_length) {
  // The body outlives the request's input views.
  return ParseKServeInferBody(model, version, ShareBody(std::move(body)), json_length);
}

Result<KServeInfer> ParseKServeInferBody(const std::string& model, int64_t version,
                                         std::shared_ptr<const std::string> owned, std::string_view json_length) {
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
    Key<"id">(w);
    w.String(id.data(), static_cast<rapidjson::SizeType>(id.size()));
  }
  Key<"model_name">(w);
  w.String(model.data(), static_cast<rapidjson::SizeType>(model.size()));
  Key<"model_version">(w);
  const std::string v = std::to_string(version);
  w.String(v.data(), static_cast<rapidjson::SizeType>(v.size()));
  Key<"outputs">(w);
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
