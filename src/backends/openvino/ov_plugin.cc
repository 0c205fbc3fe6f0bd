// Quern's OpenVINO plugin (libquern_openvino.so): the C interface of
// ov_plugin_api.h over OpenVINO's C++ API. Every OpenVINO exception is
// caught here and becomes an error string; nothing throws across the
// interface.
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <openvino/openvino.hpp>
#include <openvino/runtime/exception.hpp>
#include <string>
#include <vector>

#include "backends/openvino/ov_plugin_api.h"
#include "quern/tensor.h"

namespace {

// quern::DataType's values, from its header only (the plugin links none of
// Quern's code).
constexpr uint8_t kInvalid = static_cast<uint8_t>(quern::DataType::kInvalid);
constexpr uint8_t kBool = static_cast<uint8_t>(quern::DataType::kBool);
constexpr uint8_t kUint8 = static_cast<uint8_t>(quern::DataType::kUint8);
constexpr uint8_t kUint16 = static_cast<uint8_t>(quern::DataType::kUint16);
constexpr uint8_t kUint32 = static_cast<uint8_t>(quern::DataType::kUint32);
constexpr uint8_t kUint64 = static_cast<uint8_t>(quern::DataType::kUint64);
constexpr uint8_t kInt8 = static_cast<uint8_t>(quern::DataType::kInt8);
constexpr uint8_t kInt16 = static_cast<uint8_t>(quern::DataType::kInt16);
constexpr uint8_t kInt32 = static_cast<uint8_t>(quern::DataType::kInt32);
constexpr uint8_t kInt64 = static_cast<uint8_t>(quern::DataType::kInt64);
constexpr uint8_t kFp16 = static_cast<uint8_t>(quern::DataType::kFp16);
constexpr uint8_t kFp32 = static_cast<uint8_t>(quern::DataType::kFp32);
constexpr uint8_t kFp64 = static_cast<uint8_t>(quern::DataType::kFp64);
constexpr uint8_t kBf16 = static_cast<uint8_t>(quern::DataType::kBf16);

uint8_t ToQuern(const ov::element::Type& t) {
  switch (ov::element::Type_t(t)) {
    case ov::element::Type_t::boolean: return kBool;
    case ov::element::Type_t::u8: return kUint8;
    case ov::element::Type_t::u16: return kUint16;
    case ov::element::Type_t::u32: return kUint32;
    case ov::element::Type_t::u64: return kUint64;
    case ov::element::Type_t::i8: return kInt8;
    case ov::element::Type_t::i16: return kInt16;
    case ov::element::Type_t::i32: return kInt32;
    case ov::element::Type_t::i64: return kInt64;
    case ov::element::Type_t::f16: return kFp16;
    case ov::element::Type_t::f32: return kFp32;
    case ov::element::Type_t::f64: return kFp64;
    case ov::element::Type_t::bf16: return kBf16;
    default: return kInvalid;
  }
}

ov::element::Type FromQuern(uint8_t t) {
  switch (t) {
    case kBool: return ov::element::boolean;
    case kUint8: return ov::element::u8;
    case kUint16: return ov::element::u16;
    case kUint32: return ov::element::u32;
    case kUint64: return ov::element::u64;
    case kInt8: return ov::element::i8;
    case kInt16: return ov::element::i16;
    case kInt32: return ov::element::i32;
    case kInt64: return ov::element::i64;
    case kFp16: return ov::element::f16;
    case kFp32: return ov::element::f32;
    case kFp64: return ov::element::f64;
    case kBf16: return ov::element::bf16;
    default: return ov::element::dynamic;
  }
}

char* Copy(const std::string& s) {
  char* out = static_cast<char*>(std::malloc(s.size() + 1));
  if (out) std::memcpy(out, s.c_str(), s.size() + 1);
  return out;
}

void SetError(char** error, const std::string& message) {
  if (error) *error = Copy(message);
}

// body()'s value, or `failed` with *error set when it throws (no exception
// crosses the plugin's C interface).
template <typename T, typename Body>
T Guarded(char** error, T failed, Body&& body) {
  try {
    return body();
  } catch (const std::exception& e) {
    SetError(error, e.what());
  } catch (...) {
    SetError(error, "an unknown OpenVINO error");
  }
  return failed;
}

// One process-wide Core: it holds the CPU plugin, loaded once.
ov::Core& TheCore() {
  static ov::Core* core = [] {
    auto* c = new ov::Core();  // never destroyed: compiled models may outlive static destruction
    // Weights read into memory, not mapped from model.bin: a file replaced in
    // place while its version serves cannot take the process down (SIGBUS).
    c->set_property(ov::enable_mmap(false));
    return c;
  }();
  return *core;
}

struct Model {
  ov::CompiledModel compiled;
  std::vector<std::string> names[2];
  std::vector<QuernOvPort> ports[2];
};

struct Request {
  ov::InferRequest request;
  Model* model;
};

void Describe(Model& m) {
  for (int side = 0; side < 2; ++side) {
    const auto& list = side == 0 ? m.compiled.inputs() : m.compiled.outputs();
    m.names[side].clear();
    for (const auto& port : list) {
      std::string name;
      try {
        name = port.get_any_name();
      } catch (const std::exception&) {
        name = "";  // an unnamed port: addressed by position
      }
      m.names[side].push_back(name);
    }
    m.ports[side].assign(list.size(), QuernOvPort{});
    for (size_t i = 0; i < list.size(); ++i) {
      QuernOvPort& p = m.ports[side][i];
      p.name = m.names[side][i].c_str();
      p.dtype = ToQuern(list[i].get_element_type());
      const ov::PartialShape& shape = list[i].get_partial_shape();
      if (shape.rank().is_dynamic()) {
        p.rank = -1;
        continue;
      }
      if (shape.rank().get_length() > 8) {
        p.rank = -2;
        continue;
      }
      p.rank = static_cast<int32_t>(shape.rank().get_length());
      for (int32_t d = 0; d < p.rank; ++d) p.dims[d] = shape[d].is_static() ? shape[d].get_length() : -1;
    }
  }
}

struct Read {
  std::shared_ptr<ov::Model> model;
};

void* ReadModel(const char* path, int batch_dynamic, char** error) {
  return Guarded<void*>(error, nullptr, [&] {
    auto read = std::make_unique<Read>();
    read->model = TheCore().read_model(path);
    if (batch_dynamic) {
      std::map<ov::Output<ov::Node>, ov::PartialShape> shapes;
      for (auto& input : read->model->inputs()) {
        ov::PartialShape shape = input.get_partial_shape();
        if (shape.rank().is_static() && shape.rank().get_length() >= 1 && shape[0].is_static()) {
          shape[0] = ov::Dimension::dynamic();
          shapes[input] = shape;
        }
      }
      if (!shapes.empty()) read->model->reshape(shapes);
    }
    return static_cast<void*>(read.release());
  });
}

void ReleaseRead(void* read) {
  delete static_cast<Read*>(read);
}

void* Compile(void* read, const char* const* keys, const char* const* values, int n, char** error) {
  return Guarded<void*>(error, nullptr, [&] {
    ov::AnyMap properties;
    for (int i = 0; i < n; ++i) properties[keys[i]] = std::string(values[i]);
    auto m = std::make_unique<Model>();
    m->compiled = TheCore().compile_model(static_cast<Read*>(read)->model, "CPU", properties);
    Describe(*m);
    return static_cast<void*>(m.release());
  });
}

void ReleaseModel(void* model) {
  delete static_cast<Model*>(model);
}

int Ports(void* model, int outputs, const QuernOvPort** ports) {
  auto& list = static_cast<Model*>(model)->ports[outputs ? 1 : 0];
  *ports = list.data();
  return static_cast<int>(list.size());
}

char* Property(void* model, const char* key) {
  try {
    return Copy(static_cast<Model*>(model)->compiled.get_property(key).as<std::string>());
  } catch (...) {
    return nullptr;
  }
}

void* NewRequest(void* model, char** error) {
  return Guarded<void*>(error, nullptr, [&] {
    auto* m = static_cast<Model*>(model);
    return static_cast<void*>(new Request{m->compiled.create_infer_request(), m});
  });
}

void ReleaseRequest(void* request) {
  delete static_cast<Request*>(request);
}

int Run(void* request, const char* const* names, const QuernOvTensor* inputs, int n, char** error) {
  auto* r = static_cast<Request*>(request);
  try {
    const auto& ports = r->model->compiled.inputs();
    const auto& known = r->model->names[0];
    // Every input, every run: a port left unset would read the last run's
    // (freed) buffer.
    std::vector<bool> given(known.size(), false);
    for (int i = 0; i < n; ++i) {
      const QuernOvTensor& t = inputs[i];
      size_t at = known.size();
      for (size_t k = 0; k < known.size(); ++k) {
        if (known[k] == names[i]) at = k;
      }
      if (at == known.size()) {
        SetError(error, std::string("the model has no input '") + names[i] + "'");
        return -1;
      }
      const ov::element::Type type = FromQuern(t.dtype);
      if (type != ports[at].get_element_type()) {
        SetError(error, std::string("input '") + names[i] + "' is " + type.get_type_name() + ", the model takes " +
                            ports[at].get_element_type().get_type_name());
        return -1;
      }
      if (t.rank < 0 || t.rank > 8) {
        SetError(error, std::string("input '") + names[i] + "' has a rank over 8");
        return -1;
      }
      ov::Shape shape(t.dims, t.dims + t.rank);
      if (ov::shape_size(shape) * type.size() != t.bytes) {
        SetError(error, std::string("input '") + names[i] + "' has " + std::to_string(t.bytes) +
                            " bytes, not those of its shape");
        return -1;
      }
      // OpenVINO reads the bytes in place: it does not write inputs.
      r->request.set_tensor(ports[at], ov::Tensor(type, shape, t.data));
      given[at] = true;
    }
    for (size_t k = 0; k < given.size(); ++k) {
      if (!given[k]) {
        SetError(error, "input '" + known[k] + "' is missing (OpenVINO models take every input)");
        return -1;
      }
    }
    r->request.start_async();
    r->request.wait();
    return 0;
  } catch (const ov::Cancelled&) {
    return 1;
  } catch (const std::exception& e) {
    SetError(error, e.what());
  } catch (...) {
    SetError(error, "an unknown OpenVINO error");
  }
  return -1;
}

int Output(void* request, int index, QuernOvTensor* out, char** error) {
  auto* r = static_cast<Request*>(request);
  return Guarded(error, -1, [&] {
    ov::Tensor t = r->request.get_output_tensor(static_cast<size_t>(index));
    const ov::Shape shape = t.get_shape();
    if (shape.size() > 8) {
      SetError(error, "an output has more than 8 dimensions");
      return -1;
    }
    out->dtype = ToQuern(t.get_element_type());
    out->rank = static_cast<int32_t>(shape.size());
    for (size_t d = 0; d < shape.size(); ++d) out->dims[d] = static_cast<int64_t>(shape[d]);
    out->data = t.data();
    out->bytes = t.get_byte_size();
    return 0;
  });
}

void Cancel(void* request) {
  try {
    static_cast<Request*>(request)->request.cancel();
  } catch (...) {
  }
}

void FreeString(char* s) {
  std::free(s);
}

int SaveIr(const char* path, const char* xml_path, int compress_f16, char** error) {
  return Guarded(error, -1, [&] {
    ov::save_model(TheCore().read_model(path), xml_path, compress_f16 != 0);
    return 0;
  });
}

int ReleaseMemory(void* model, char** error) {
  return Guarded(error, -1, [&] {
    static_cast<Model*>(model)->compiled.release_memory();
    return 0;
  });
}

}  // namespace

extern "C" __attribute__((visibility("default"))) const QuernOvApi* quern_openvino_api(void) {
  static const std::string version = ov::get_openvino_version().buildNumber;
  static const QuernOvApi api = {
      QUERN_OV_PLUGIN_ABI, version.c_str(), ReadModel, ReleaseRead, Compile, ReleaseModel, Ports,  Property,
      NewRequest,          ReleaseRequest,  Run,       Output,      Cancel,  FreeString,   SaveIr, ReleaseMemory,
  };
  return &api;
}
