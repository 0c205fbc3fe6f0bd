// _quern: the engine for Python (the `quern` package in python/quern wraps
// it). Inputs are numpy arrays borrowed without copying while a call runs;
// outputs are numpy arrays over the engine's own buffers (no copy), kept
// alive by the array. The GIL is released while a request waits.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "quern/engine.h"

namespace py = pybind11;

namespace quern {
namespace {

// A failed Status, raised in Python as the quern exception for its code.
struct StatusError {
  Status status;
};

[[noreturn]] void Raise(Status st) {
  throw StatusError{std::move(st)};
}

// quern._error and quern.Result, handed over when the package is imported
// (kept for the process's life: answers and errors are made at any time,
// shutdown included).
py::object* g_error_factory = nullptr;
py::object* g_result_type = nullptr;

// The quern exception for a failed Status (quern._error picks its class).
py::object ErrorObject(const Status& st) {
  if (!g_error_factory) return py::reinterpret_borrow<py::object>(PyExc_RuntimeError)(st.ToString());
  return (*g_error_factory)(static_cast<int>(st.code()), std::string(StatusCodeName(st.code())), st.message());
}

// True on the engine's threads while they run Python (an answer's callback,
// a registered model): an engine must not be destroyed from there (it would
// join the thread it runs on).
thread_local bool t_in_engine_callback = false;
struct InEngineCallback {
  InEngineCallback() { t_in_engine_callback = true; }
  ~InEngineCallback() { t_in_engine_callback = false; }
};

// "ValueError: message" for the Python exception being handled; never throws.
std::string Describe(py::error_already_set& e) {
  try {
    return std::string(py::str(e.type().attr("__name__"))) + ": " + std::string(py::str(e.value()));
  } catch (...) {
    return "an exception that could not be printed";
  }
}

// The engine's type for a numpy dtype (native byte order, numeric or bool).
std::optional<DataType> FromNumpy(const py::dtype& dt) {
  const char order = dt.byteorder();
  if (order == '>' || order == '!') return std::nullopt;  // big-endian; the machine is little-endian
  const auto size = dt.itemsize();
  switch (dt.kind()) {
    case 'b': return size == 1 ? std::optional(DataType::kBool) : std::nullopt;
    case 'u':
      if (size == 1) return DataType::kUint8;
      if (size == 2) return DataType::kUint16;
      if (size == 4) return DataType::kUint32;
      if (size == 8) return DataType::kUint64;
      return std::nullopt;
    case 'i':
      if (size == 1) return DataType::kInt8;
      if (size == 2) return DataType::kInt16;
      if (size == 4) return DataType::kInt32;
      if (size == 8) return DataType::kInt64;
      return std::nullopt;
    case 'f':
      if (size == 2) return DataType::kFp16;
      if (size == 4) return DataType::kFp32;
      if (size == 8) return DataType::kFp64;
      return std::nullopt;
    default: return std::nullopt;
  }
}

// By numpy's type number: a built-in descriptor, no string to parse.
py::dtype ToNumpy(DataType t) {
  using api = py::detail::npy_api;
  constexpr int kNpyHalf = 23;  // NPY_HALF (pybind11 names no constant for it)
  switch (t) {
    case DataType::kBool: return py::dtype(api::NPY_BOOL_);
    case DataType::kUint8: return py::dtype(api::NPY_UBYTE_);
    case DataType::kUint16: return py::dtype(api::NPY_USHORT_);
    case DataType::kUint32: return py::dtype(api::NPY_UINT_);
    case DataType::kUint64: return py::dtype(api::NPY_ULONGLONG_);
    case DataType::kInt8: return py::dtype(api::NPY_BYTE_);
    case DataType::kInt16: return py::dtype(api::NPY_SHORT_);
    case DataType::kInt32: return py::dtype(api::NPY_INT_);
    case DataType::kInt64: return py::dtype(api::NPY_LONGLONG_);
    case DataType::kFp16: return py::dtype(kNpyHalf);
    case DataType::kFp32: return py::dtype(api::NPY_FLOAT_);
    case DataType::kFp64: return py::dtype(api::NPY_DOUBLE_);
    default:
      Raise(Unimplemented("outputs of type " + std::string(DataTypeName(t)) + " are not returned to Python yet"));
  }
}

// True for numpy arrays that go in as BYTES: objects (bytes or str), fixed
// bytes ('S') and fixed unicode ('U').
bool IsBytesKind(const py::dtype& dt) {
  const char k = dt.kind();
  return k == 'O' || k == 'S' || k == 'U';
}

// A BYTES tensor (KServe layout: 4-byte little-endian length, then the bytes)
// from an array of bytes or str (str as UTF-8), any layout; 'S' and 'U'
// elements lose their trailing NULs as numpy reads them. The GIL is held.
Tensor BytesTensor(const std::string& model, const std::string& what, const py::array& a) {
  const py::list items = a.attr("ravel")().attr("tolist")();
  std::vector<std::pair<const char*, size_t>> parts;
  parts.reserve(items.size());
  std::vector<py::object> encoded;  // str elements as UTF-8, alive until copied
  size_t total = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    PyObject* o = PyList_GET_ITEM(items.ptr(), static_cast<py::ssize_t>(i));
    char* data = nullptr;
    py::ssize_t size = 0;
    if (PyBytes_Check(o)) {
      data = PyBytes_AS_STRING(o);
      size = PyBytes_GET_SIZE(o);
    } else if (PyByteArray_Check(o)) {
      data = PyByteArray_AS_STRING(o);
      size = PyByteArray_GET_SIZE(o);
    } else if (PyUnicode_Check(o)) {
      PyObject* utf8 = PyUnicode_AsUTF8String(o);
      if (!utf8) {
        PyErr_Clear();
        Raise(InvalidArgument("model '" + model + "': " + what + " element " + std::to_string(i) +
                              " is a str that is not valid Unicode (a lone surrogate?)"));
      }
      encoded.push_back(py::reinterpret_steal<py::object>(utf8));
      data = PyBytes_AS_STRING(utf8);
      size = PyBytes_GET_SIZE(utf8);
    } else {
      Raise(InvalidArgument("model '" + model + "': " + what + " element " + std::to_string(i) + " is a " +
                            std::string(py::str(py::type::of(py::handle(o)).attr("__name__"))) +
                            "; BYTES elements are bytes or str"));
    }
    if (static_cast<uint64_t>(size) > UINT32_MAX) {
      Raise(InvalidArgument("model '" + model + "': " + what + " element " + std::to_string(i) + " has " +
                            std::to_string(size) + " bytes; at most 4294967295 fit a BYTES element"));
    }
    parts.emplace_back(data, static_cast<size_t>(size));
    total += 4 + static_cast<size_t>(size);
  }
  Tensor t = Tensor::AllocateUninitialized(DataType::kBytes, Shape(a.shape(), a.shape() + a.ndim()), total);
  std::byte* p = t.mutable_data();
  for (const auto& [data, size] : parts) {
    const auto len = static_cast<uint32_t>(size);
    std::memcpy(p, &len, 4);  // little-endian hosts only
    if (size) std::memcpy(p + 4, data, size);
    p += 4 + size;
  }
  return t;
}

// A numpy object array of bytes with `t`'s shape (the elements are copies).
py::array BytesArray(const Tensor& t) {
  auto strings = t.Strings();
  if (!strings) Raise(strings.error());
  std::vector<py::ssize_t> shape(t.shape().begin(), t.shape().end());
  py::array out(py::dtype("O"), shape);
  auto** cells = static_cast<PyObject**>(out.mutable_data());
  for (size_t i = 0; i < strings->size(); ++i) {
    const std::string_view v = (*strings)[i];
    PyObject* b = PyBytes_FromStringAndSize(v.data(), static_cast<py::ssize_t>(v.size()));
    if (!b) throw py::error_already_set();
    PyObject* old = cells[i];  // numpy fills a new object array with None
    cells[i] = b;
    Py_XDECREF(old);
  }
  return out;
}

// A numpy array over `t`'s bytes; the array owns the tensor. BYTES tensors
// come out as object arrays of bytes (copies, as tritonclient gives them).
py::array ToArray(Tensor&& t) {
  if (t.dtype() == DataType::kBytes) return BytesArray(t);
  py::dtype dt = ToNumpy(t.dtype());
  auto* held = new Tensor(std::move(t));
  py::capsule owner(held, [](void* p) { delete static_cast<Tensor*>(p); });
  // Through numpy's C API with the dimensions on the stack (pybind11's
  // array constructor allocates three vectors for them).
  constexpr size_t kMaxDims = 32;  // NPY_MAXDIMS
  const Shape& shape = held->shape();
  if (shape.size() > kMaxDims) {
    return py::array(dt, std::vector<py::ssize_t>(shape.begin(), shape.end()), held->data(), owner);
  }
  Py_intptr_t dims[kMaxDims], strides[kMaxDims];
  Py_intptr_t stride = dt.itemsize();
  for (size_t i = shape.size(); i-- > 0;) {
    dims[i] = static_cast<Py_intptr_t>(shape[i]);
    strides[i] = stride;
    stride *= std::max<Py_intptr_t>(dims[i], 1);
  }
  auto& api = py::detail::npy_api::get();
  auto array = py::reinterpret_steal<py::array>(api.PyArray_NewFromDescr_(
      api.PyArray_Type_, dt.release().ptr(), static_cast<int>(shape.size()), dims, strides,
      const_cast<std::byte*>(held->data()), py::detail::npy_api::NPY_ARRAY_WRITEABLE_, nullptr));
  if (!array) throw py::error_already_set();
  if (api.PyArray_SetBaseObject_(array.ptr(), owner.release().ptr()) != 0) throw py::error_already_set();
  return array;
}

// A model whose batches a Python function computes: fn({name: array}) ->
// {name: array}, every array batched along its first dimension. The inputs
// are read-only arrays over the batch's tensors (kept alive by the arrays);
// the outputs are copied into the engine's tensors. Runs with the GIL.
class PyModel : public Model {
 public:
  PyModel(std::shared_ptr<py::object> fn, ModelConfig config) : fn_(std::move(fn)), config_(std::move(config)) {}

  Status Execute(const std::vector<NamedTensor>& inputs, int64_t batch_size,
                 std::vector<NamedTensor>& outputs) override {
    py::gil_scoped_acquire gil;
    InEngineCallback in_callback;
    try {
      py::dict args;
      for (const auto& in : inputs) {
        if (in.tensor.dtype() == DataType::kBytes) {
          args[py::str(in.name)] = BytesArray(in.tensor);
          continue;
        }
        // A copy the function may keep (a batch of one may be a caller's own
        // array, borrowed only while its request runs), read-only.
        py::array a(ToNumpy(in.tensor.dtype()),
                    std::vector<py::ssize_t>(in.tensor.shape().begin(), in.tensor.shape().end()));
        std::memcpy(a.mutable_data(), in.tensor.data(), in.tensor.byte_size());
        a.attr("setflags")(py::arg("write") = false);
        args[py::str(in.name)] = a;
      }
      py::object result = (*fn_)(args);
      if (!py::isinstance<py::dict>(result)) {
        return Internal("model '" + config_.name + "': the function returned a " +
                        std::string(py::str(py::type::of(result).attr("__name__"))) +
                        ", not a dict of output name -> numpy array");
      }
      const auto answer = py::reinterpret_borrow<py::dict>(result);
      for (const auto& oc : config_.outputs) {
        if (!answer.contains(oc.name)) {
          return Internal("model '" + config_.name + "': the function returned no output '" + oc.name + "'");
        }
        auto a = py::array::ensure(answer[py::str(oc.name)], py::array::c_style);
        const auto type = !a                       ? std::nullopt
                          : IsBytesKind(a.dtype()) ? std::optional(DataType::kBytes)
                                                   : FromNumpy(a.dtype());
        if (!a || type != oc.dtype) {
          return Internal("model '" + config_.name + "': output '" + oc.name + "' must be a numpy array of " +
                          std::string(DataTypeName(oc.dtype)));
        }
        Shape shape(a.shape(), a.shape() + a.ndim());
        Shape want = oc.dims;  // -1: any size
        if (config_.max_batch_size > 0) want.insert(want.begin(), batch_size);
        bool fits = shape.size() == want.size();
        for (size_t i = 0; fits && i < want.size(); ++i) fits = want[i] == -1 || want[i] == shape[i];
        if (!fits) {
          return Internal(
              "model '" + config_.name + "': output '" + oc.name + "' has shape " + ShapeToString(shape) +
              "; expected " + ShapeToString(want) +
              (config_.max_batch_size > 0 ? " (the batch of " + std::to_string(batch_size) + " first)" : ""));
        }
        if (oc.dtype == DataType::kBytes) {
          outputs.push_back({oc.name, BytesTensor(config_.name, "output '" + oc.name + "'", a)});
          continue;
        }
        Tensor t = Tensor::AllocateUninitialized(oc.dtype, std::move(shape), static_cast<size_t>(a.nbytes()));
        std::memcpy(t.mutable_data(), a.data(), static_cast<size_t>(a.nbytes()));
        outputs.push_back({oc.name, std::move(t)});
      }
      return Status::Ok();
    } catch (py::error_already_set& e) {
      // The exception's own line ("ValueError: ..."), as a traceback ends.
      return Internal("model '" + config_.name + "': " + Describe(e));
    } catch (const StatusError& e) {
      return Internal("model '" + config_.name + "': " + e.status.message());
    } catch (const std::exception& e) {
      return Internal("model '" + config_.name + "': " + e.what());
    }
  }

 private:
  std::shared_ptr<py::object> fn_;
  const ModelConfig config_;
};

// Tensor specs from Python: [(name, "FP32", [dims...]), ...].
std::vector<TensorConfig> Specs(const std::string& model, const char* what,
                                const std::vector<std::tuple<std::string, std::string, std::vector<int64_t>>>& specs) {
  std::vector<TensorConfig> out;
  for (const auto& [name, type, dims] : specs) {
    const auto dt = DataTypeFromName(type);
    if (!dt || *dt == DataType::kBf16) {
      Raise(InvalidArgument("model '" + model + "': " + what + " '" + name + "' has datatype '" + type +
                            "'; expected FP32, INT64, BOOL, BYTES or another KServe type"));
    }
    TensorConfig t;
    t.name = name;
    t.dtype = *dt;
    t.dims = Shape(dims.begin(), dims.end());
    out.push_back(std::move(t));
  }
  return out;
}

class PyEngine {
 public:
  PyEngine(const std::string& model_repository, int64_t max_queue_wait_ms, int cores) {
    EngineOptions o;
    o.model_repository = model_repository;
    o.max_queue_wait_ms = max_queue_wait_ms;
    o.cores = cores;
    auto e = Engine::Create(std::move(o));
    if (!e) Raise(e.error());
    engine_ = std::move(*e);
  }

  ~PyEngine() { Close(); }

  // Drains and stops the engine (its models' queued requests are answered
  // first). From one of its own threads the engine is stopped by another.
  void Close() {
    if (!engine_) return;
    if (t_in_engine_callback) {
      std::thread([engine = std::move(engine_)]() mutable { engine.reset(); }).detach();
      return;
    }
    // Engine threads may be waiting for the GIL to deliver an answer: let
    // them, while the engine drains.
    py::gil_scoped_release release;
    engine_.reset();
  }

  // One request's quern.Result.
  py::object Infer(const std::string& model, const py::dict& inputs, std::optional<int64_t> version,
                   std::optional<uint32_t> priority, std::optional<double> timeout_s) {
    std::vector<py::array> held;  // alive until the answer: the engine reads them in place
    InferRequest r = MakeRequest(model, inputs, version, priority, timeout_s, held);
    Engine& engine = Open();
    InferResponse resp;
    {
      py::gil_scoped_release release;
      resp = engine.Run(std::move(r));
    }
    if (!resp.status.ok()) Raise(resp.status);
    return Answer(std::move(resp));
  }

  // Submits one request; `done(result, error)` is called once, on an engine
  // thread holding the GIL (one of them None: a quern.Result, or the
  // exception).
  // Returns the request's cancellation token.
  std::shared_ptr<CancellationToken> InferAsync(const std::string& model, const py::dict& inputs, py::function done,
                                                std::optional<int64_t> version, std::optional<uint32_t> priority,
                                                std::optional<double> timeout_s) {
    // The inputs and the callback live until the answer; they are let go
    // while the GIL is held (the engine destroys its callback without it).
    struct Pending {
      std::vector<py::array> arrays;
      py::function done;
    };
    auto pending = std::make_shared<Pending>();
    InferRequest r = MakeRequest(model, inputs, version, priority, timeout_s, pending->arrays);
    pending->done = std::move(done);
    auto token = std::make_shared<CancellationToken>();
    r.cancel = token;
    InferCallback callback = [pending](InferResponse&& resp) {
      py::gil_scoped_acquire gil;
      InEngineCallback in_callback;
      py::function f = std::move(pending->done);
      pending->arrays.clear();
      try {
        try {
          if (!resp.status.ok()) Raise(resp.status);
          f(Answer(std::move(resp)), py::none());
        } catch (const StatusError& e) {  // failed, or an output Python cannot take
          f(py::none(), ErrorObject(e.status));
        }
      } catch (py::error_already_set& e) {
        e.discard_as_unraisable("quern: an infer_async callback");
      } catch (const std::exception& e) {
        std::fprintf(stderr, "quern: an infer_async callback failed: %s\n", e.what());
      }
    };
    if (Status st = Open().InferAsync(std::move(r), callback); !st.ok()) Raise(st);
    return token;
  }

  // Serves `fn` as model `name` with dynamic batching and `instances`
  // instances (Python runs one batch at a time: the GIL).
  void Register(const std::string& name, py::function fn,
                const std::vector<std::tuple<std::string, std::string, std::vector<int64_t>>>& inputs,
                const std::vector<std::tuple<std::string, std::string, std::vector<int64_t>>>& outputs,
                int max_batch_size, int instances, int64_t max_queue_delay_us) {
    ModelConfig c;
    c.name = name;
    c.backend = "custom";
    c.max_batch_size = max_batch_size;
    c.inputs = Specs(name, "input", inputs);
    c.outputs = Specs(name, "output", outputs);
    c.instance_count = instances;
    if (max_queue_delay_us < 0) Raise(InvalidArgument("model '" + name + "': max_queue_delay_us is negative"));
    if (max_batch_size > 0) {
      c.batching = BatchingConfig{.max_queue_delay_us = static_cast<uint64_t>(max_queue_delay_us)};
    }
    // The function goes with the last instance, under the GIL.
    auto shared = std::shared_ptr<py::object>(new py::object(std::move(fn)), [](py::object* p) {
      py::gil_scoped_acquire gil;
      delete p;
    });
    ModelFactory factory = [shared, c] { return std::make_unique<PyModel>(shared, c); };
    Engine& engine = Open();
    Status st;
    {
      py::gil_scoped_release release;  // instances load (and may warm up) on engine threads
      st = engine.RegisterModel(std::move(c), std::move(factory));
    }
    if (!st.ok()) Raise(st);
  }

  py::list Models() {
    py::list out;
    for (const auto& m : Open().ListModels()) {
      py::dict d;
      d["name"] = m.name;
      d["version"] = m.version;
      d["state"] = std::string(ModelStateName(m.state));
      d["reason"] = m.reason;
      py::list inputs, outputs;
      for (const auto& t : m.config.inputs)
        inputs.append(py::make_tuple(t.name, std::string(DataTypeName(t.dtype)), t.dims));
      for (const auto& t : m.config.outputs) {
        outputs.append(py::make_tuple(t.name, std::string(DataTypeName(t.dtype)), t.dims));
      }
      d["inputs"] = inputs;
      d["outputs"] = outputs;
      d["max_batch_size"] = m.config.max_batch_size;
      out.append(d);
    }
    return out;
  }

 private:
  Engine& Open() {
    if (!engine_) Raise(Unavailable("the engine is closed"));
    return *engine_;
  }

  static InferRequest MakeRequest(const std::string& model, const py::dict& inputs, std::optional<int64_t> version,
                                  std::optional<uint32_t> priority, std::optional<double> timeout_s,
                                  std::vector<py::array>& held) {
    InferRequest r;
    r.model = model;
    if (version) r.version = *version;
    if (priority) r.priority = *priority;
    if (timeout_s) {
      constexpr double kMaxSeconds = 365.0 * 86400;
      if (!(*timeout_s > 0) || !(*timeout_s <= kMaxSeconds)) {
        Raise(InvalidArgument("model '" + model + "': timeout must be a number of seconds above 0 and at most a year"));
      }
      r.timeout_us = std::max<uint64_t>(1, static_cast<uint64_t>(std::ceil(*timeout_s * 1e6)));
    }
    // A snapshot of the items (references held): reading them below runs
    // no Python that could change the dict underneath.
    std::vector<std::pair<py::object, py::object>> items;
    items.reserve(static_cast<size_t>(PyDict_Size(inputs.ptr())));
    {
      Py_ssize_t pos = 0;
      PyObject *k = nullptr, *v = nullptr;
      while (PyDict_Next(inputs.ptr(), &pos, &k, &v)) {
        items.emplace_back(py::reinterpret_borrow<py::object>(k), py::reinterpret_borrow<py::object>(v));
      }
    }
    r.inputs.reserve(items.size());
    for (const auto& [key, value] : items) {
      if (!py::isinstance<py::str>(key)) {
        Raise(InvalidArgument("model '" + model + "': input names are strings; got a " +
                              std::string(py::str(py::type::of(key).attr("__name__")))));
      }
      const std::string name = key.cast<std::string>();
      if (!py::isinstance<py::array>(value)) {
        Raise(InvalidArgument("model '" + model + "': input '" + name + "' is a " +
                              std::string(py::str(py::type::of(value).attr("__name__"))) + ", not a numpy array"));
      }
      auto a = py::reinterpret_borrow<py::array>(value);
      if (IsBytesKind(a.dtype())) {  // copied into the KServe layout
        r.inputs.push_back({name, BytesTensor(model, "input '" + name + "'", a)});
        continue;
      }
      const auto type = FromNumpy(a.dtype());
      if (!type) {
        Raise(InvalidArgument("model '" + model + "': input '" + name + "' has dtype " +
                              std::string(py::str(a.dtype())) + ", which the engine does not take"));
      }
      if (!(a.flags() & py::array::c_style)) {
        Raise(InvalidArgument("model '" + model + "': input '" + name +
                              "' is not C-contiguous (a slice or a transpose?); pass np.ascontiguousarray(x)"));
      }
      Shape shape(a.shape(), a.shape() + a.ndim());
      r.inputs.push_back({name, Tensor::Borrow(*type, std::move(shape), a.data(), static_cast<size_t>(a.nbytes()))});
      held.push_back(std::move(a));
    }
    return r;
  }

  // A quern.Result (the GIL held), made without running its __init__ (no
  // Python frame per answer): the outputs are its items, and the telemetry
  // raw numbers that Result.telemetry turns into a dict when it is read
  // (request_id, model_version, batch_size, queue, compute and total ns);
  // an ensemble's, with its steps, is the dict itself.
  static py::object Answer(InferResponse&& resp) {
    if (!g_result_type) Raise(Internal("the quern package did not hand its Result type to the extension"));
    auto* type = reinterpret_cast<PyTypeObject*>(g_result_type->ptr());
    py::object result = py::reinterpret_steal<py::object>(type->tp_new(type, EmptyTuple(), nullptr));
    if (!result) throw py::error_already_set();
    for (auto& o : resp.outputs) {
      const py::str name(o.name);
      const py::array value = ToArray(std::move(o.tensor));
      if (PyDict_SetItem(result.ptr(), name.ptr(), value.ptr()) != 0) throw py::error_already_set();
    }
    const Telemetry& t = resp.telemetry;
    py::object telemetry;
    if (resp.steps.empty()) {
      telemetry =
          py::make_tuple(resp.request_id, resp.version, t.batch_size, t.queue_ns(), t.compute_ns(), t.total_ns());
    } else {
      py::dict d;
      d["request_id"] = resp.request_id;
      d["model_version"] = resp.version;
      d["batch_size"] = t.batch_size;
      d["queue_ms"] = static_cast<double>(t.queue_ns()) / 1e6;
      d["compute_ms"] = static_cast<double>(t.compute_ns()) / 1e6;
      d["total_ms"] = static_cast<double>(t.total_ns()) / 1e6;
      // An ensemble's steps, in the order they finished.
      py::list steps;
      for (const StepTelemetry& s : resp.steps) {
        py::dict step;
        step["step"] = s.step;
        step["model"] = s.model;
        step["model_version"] = s.version;
        step["batch_size"] = s.telemetry.batch_size;
        step["queue_ms"] = static_cast<double>(s.telemetry.queue_ns()) / 1e6;
        step["compute_ms"] = static_cast<double>(s.telemetry.compute_ns()) / 1e6;
        step["total_ms"] = static_cast<double>(s.telemetry.total_ns()) / 1e6;
        steps.append(std::move(step));
      }
      d["steps"] = std::move(steps);
      telemetry = std::move(d);
    }
    static PyObject* const kSlot = PyUnicode_InternFromString("_telemetry");
    if (PyObject_SetAttr(result.ptr(), kSlot, telemetry.ptr()) != 0) throw py::error_already_set();
    return result;
  }

  static PyObject* EmptyTuple() {
    static PyObject* const empty = PyTuple_New(0);
    return empty;
  }

  std::unique_ptr<Engine> engine_;
};

}  // namespace
}  // namespace quern

PYBIND11_MODULE(_quern, m) {
  m.doc() = "Quern's engine (use the quern package)";
  m.attr("__version__") = quern::Version();
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const quern::StatusError& e) {
      py::object error = quern::ErrorObject(e.status);
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(error.ptr())), error.ptr());
    }
  });
  py::class_<quern::PyEngine>(m, "Engine")
      .def(py::init<const std::string&, int64_t, int>(), py::arg("model_repository"), py::arg("max_queue_wait_ms") = 0,
           py::arg("cores") = 0)
      .def("infer", &quern::PyEngine::Infer, py::arg("model"), py::arg("inputs"), py::kw_only(),
           py::arg("version") = py::none(), py::arg("priority") = py::none(), py::arg("timeout") = py::none())
      .def("infer_async", &quern::PyEngine::InferAsync, py::arg("model"), py::arg("inputs"), py::arg("done"),
           py::kw_only(), py::arg("version") = py::none(), py::arg("priority") = py::none(),
           py::arg("timeout") = py::none())
      .def("register", &quern::PyEngine::Register, py::arg("name"), py::arg("fn"), py::arg("inputs"),
           py::arg("outputs"), py::arg("max_batch_size"), py::arg("instances"), py::arg("max_queue_delay_us"))
      .def("models", &quern::PyEngine::Models)
      .def("close", &quern::PyEngine::Close);
  m.def("_set_error_factory", [](py::object f) { quern::g_error_factory = new py::object(std::move(f)); });
  m.def("_set_result_type", [](py::type t) {
    if (!PyType_IsSubtype(reinterpret_cast<PyTypeObject*>(t.ptr()), &PyDict_Type)) {
      throw py::type_error("the result type must be a dict subclass");
    }
    quern::g_result_type = new py::object(std::move(t));
  });
  py::class_<quern::CancellationToken, std::shared_ptr<quern::CancellationToken>>(m, "Cancellation")
      .def("cancel", &quern::CancellationToken::Cancel)
      .def_property_readonly("cancelled", &quern::CancellationToken::cancelled);
}
