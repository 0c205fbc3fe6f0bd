# triton_python_backend_utils as Quern's Python models see it (import it as
# pb_utils): the common subset of Triton's Python backend API, so that a
# model.py written for Triton runs unchanged. Tensors are numpy arrays; an
# input tensor's array views the shared memory the server wrote the batch
# into and is valid while execute() runs (copy it to keep it).
import bisect
import json
import os
import sys

import numpy as np

__all__ = [
    "Tensor", "InferenceRequest", "InferenceResponse", "TritonError", "TritonModelException", "Logger",
    "get_input_tensor_by_name", "get_output_tensor_by_name", "get_input_config_by_name",
    "get_output_config_by_name", "triton_string_to_numpy", "numpy_to_triton_type", "serialize_byte_tensor",
    "deserialize_bytes_tensor", "ModelConfig", "using_decoupled_model_transaction_policy",
    "TRITONSERVER_RESPONSE_COMPLETE_FINAL", "MetricFamily", "Metric", "ResponseIterator",
]

TRITONSERVER_REQUEST_FLAG_SEQUENCE_START = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_END = 2
TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
TRITONSERVER_REQUEST_RELEASE_ALL = 1
TRITONSERVER_REQUEST_RELEASE_RESCHEDULE = 2

_TRITON_TO_NUMPY = {
    "TYPE_BOOL": np.bool_, "TYPE_UINT8": np.uint8, "TYPE_UINT16": np.uint16, "TYPE_UINT32": np.uint32,
    "TYPE_UINT64": np.uint64, "TYPE_INT8": np.int8, "TYPE_INT16": np.int16, "TYPE_INT32": np.int32,
    "TYPE_INT64": np.int64, "TYPE_FP16": np.float16, "TYPE_FP32": np.float32, "TYPE_FP64": np.float64,
    "TYPE_STRING": np.object_,
}


def triton_string_to_numpy(triton_type_string):
    """numpy type of a configuration data type ("TYPE_FP32" -> np.float32)."""
    return _TRITON_TO_NUMPY[triton_type_string]


def numpy_to_triton_type(data_type):
    """Configuration data type of a numpy type (np.float32 -> "TYPE_FP32")."""
    t = np.dtype(data_type)
    if t.kind in "OSU":
        return "TYPE_STRING"
    for name, np_type in _TRITON_TO_NUMPY.items():
        if np_type is not np.object_ and np.dtype(np_type) == t:
            return name
    return None


# Set by the process that runs the model (stub.py): sends a BLS request to the server and returns its
# InferenceResponse.
_bls_call = None


class TritonError(Exception):
    """An error for one request (InferenceResponse(error=...)); may also be raised."""
    UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE, UNSUPPORTED, ALREADY_EXISTS, CANCELLED = range(8)

    def __init__(self, message, code=UNKNOWN):
        super().__init__(message)
        self._message = str(message)
        self._code = code

    def message(self):
        return self._message

    def code(self):
        return self._code


class TritonModelException(Exception):
    """Raised from execute(): every request of the batch fails with its message."""

    def message(self):
        return str(self)


class Tensor:
    """A named tensor holding a numpy array."""
    __slots__ = ("_name", "_array")

    def __init__(self, name, array):
        if not isinstance(array, np.ndarray):
            array = np.asarray(array)
        self._name = str(name)
        self._array = array

    def name(self):
        return self._name

    def as_numpy(self):
        return self._array

    def shape(self):
        return list(self._array.shape)

    def is_cpu(self):
        return True

    def to_dlpack(self):
        return self._array.__dlpack__()

    @staticmethod
    def from_dlpack(name, capsule):
        return Tensor(name, np.from_dlpack(capsule))

    def __repr__(self):
        return f"Tensor({self._name!r}, shape={self._array.shape}, dtype={self._array.dtype})"


def _parameters_json(parameters):
    """A request's parameters (None, a dict of str to bool, int, float or str, or such a dict's JSON
    text) as JSON text."""
    if parameters is None or parameters == "" or parameters == {}:
        return "{}"
    try:
        value = json.loads(parameters) if isinstance(parameters, (str, bytes)) else parameters
        if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, (bool, int, float, str))
                                                  for k, v in value.items()):
            raise ValueError("not a dict of str to bool, int, float or str")
        # Written again: valid JSON whatever was given (a NaN refused, a key given twice once).
        return json.dumps(value, separators=(",", ":"), allow_nan=False)
    except ValueError as e:
        raise TritonModelException(f"parameters must be a dict of str to bool, int, float or str (or its JSON): {e}")


class InferenceRequest:
    """One request of a batch, as execute() receives it."""
    __slots__ = ("_inputs", "_by_name", "_request_id", "_correlation_id", "_requested_output_names",
                 "_model_name", "_model_version", "_timeout", "_response_sender", "_parameters")

    def __init__(self, inputs=None, request_id="", correlation_id=0, requested_output_names=(), model_name="",
                 model_version=-1, flags=0, timeout=0, parameters=None, **_ignored):
        self._inputs = list(inputs or [])
        self._by_name = None
        self._request_id = request_id
        self._correlation_id = correlation_id
        self._requested_output_names = ([requested_output_names] if isinstance(requested_output_names, str)
                                        else list(requested_output_names))
        self._model_name = model_name.decode() if isinstance(model_name, bytes) else model_name
        self._model_version = model_version
        self._timeout = timeout
        self._response_sender = None  # a decoupled model's requests: set by the server's process
        self._parameters = _parameters_json(parameters)

    def inputs(self):
        return self._inputs

    def input(self, name):
        if self._by_name is None:
            self._by_name = {t.name(): t for t in self._inputs}
        return self._by_name.get(name)

    def request_id(self):
        return self._request_id

    def correlation_id(self):
        return self._correlation_id

    def requested_output_names(self):
        return self._requested_output_names

    def model_name(self):
        return self._model_name

    def flags(self):
        return 0

    def parameters(self):
        """The request's parameters (its caller's `parameters`, those the server reads left out) as a
        JSON object's text; "{}" when it has none."""
        return self._parameters

    def is_cancelled(self):
        """Whether the caller has gone (a decoupled model's request: it may stop sending)."""
        return self._response_sender is not None and self._response_sender.is_cancelled()

    def get_response_sender(self):
        """A decoupled model's way to answer this request: send(response, flags) any number of times,
        from any thread, the last with flags=TRITONSERVER_RESPONSE_COMPLETE_FINAL."""
        if self._response_sender is None:
            raise TritonModelException("get_response_sender() is for decoupled models (model_transaction_policy "
                                       "{ decoupled: true }); this model answers with what execute() returns")
        return self._response_sender

    def exec(self, decoupled=False):
        """Runs this request on model_name (BLS: a model calling another model) and returns its
        InferenceResponse; a failure is the response's error(), not an exception. Served while the
        calling model's execute() runs (from its thread or any other). decoupled=True (a decoupled
        model's many responses): a ResponseIterator over every response, the last one included
        (which may hold no tensors), returned once the called model has sent its last."""
        if _bls_call is None:
            raise TritonModelException("calling other models (BLS) works only inside a served model's execute()")
        return _bls_call(self, bool(decoupled))

    async def async_exec(self, decoupled=False):
        """exec() for an `async def execute`: awaitable; calls awaited together run one after another."""
        import asyncio
        return await asyncio.get_running_loop().run_in_executor(None, self.exec, decoupled)


class ResponseIterator:
    """exec(decoupled=True)'s answer: the called model's responses, in the order it sent them."""

    def __init__(self, responses):
        self._responses = list(responses)
        self._next = 0

    def __iter__(self):
        return self

    def __next__(self):
        if self._next >= len(self._responses):
            raise StopIteration
        self._next += 1
        return self._responses[self._next - 1]

    def cancel(self):
        """Nothing to stop: every response has arrived when the iterator is returned."""


class InferenceResponse:
    """The answer to one request: output tensors, or an error."""
    __slots__ = ("_output_tensors", "_error")

    def __init__(self, output_tensors=None, error=None, **_ignored):
        self._output_tensors = list(output_tensors or [])
        self._error = error

    def output_tensors(self):
        return self._output_tensors

    def has_error(self):
        return self._error is not None

    def error(self):
        return self._error


def get_input_tensor_by_name(inference_request, name):
    """The request's input `name` as a Tensor, or None."""
    return inference_request.input(name)


def get_output_tensor_by_name(inference_response, name):
    for t in inference_response.output_tensors():
        if t.name() == name:
            return t
    return None


def _config_entry(model_config, key, name):
    if isinstance(model_config, str):
        model_config = json.loads(model_config)
    for entry in model_config.get(key, []):
        if entry.get("name") == name:
            return entry
    return {}


def get_input_config_by_name(model_config, name):
    return _config_entry(model_config, "input", name)


def get_output_config_by_name(model_config, name):
    """The output's entry of the model configuration (a dict; {} when absent)."""
    return _config_entry(model_config, "output", name)


def serialize_byte_tensor(input_tensor):
    """A BYTES tensor's elements as length-prefixed bytes (uint8 array), the wire layout."""
    if input_tensor.size == 0:
        return np.empty([0], dtype=np.uint8)
    parts = []
    for item in input_tensor.flat:
        b = item if isinstance(item, bytes) else str(item).encode("utf-8")
        parts.append(len(b).to_bytes(4, "little"))
        parts.append(b)
    return np.frombuffer(b"".join(parts), dtype=np.uint8)


def deserialize_bytes_tensor(encoded_tensor):
    """The elements of length-prefixed bytes, as an object array."""
    data = bytes(encoded_tensor)
    out, pos = [], 0
    while pos < len(data):
        n = int.from_bytes(data[pos:pos + 4], "little")
        out.append(data[pos + 4:pos + 4 + n])
        pos += 4 + n
    return np.array(out, dtype=np.object_)


class Logger:
    """Lines go to the server's log, tagged with the model's name."""

    @staticmethod
    def log(message, level="INFO"):
        sys.stderr.write(f"{level}: {message}\n")

    @staticmethod
    def log_info(message):
        Logger.log(message, "INFO")

    @staticmethod
    def log_warn(message):
        Logger.log(message, "WARNING")

    @staticmethod
    def log_error(message):
        Logger.log(message, "ERROR")

    @staticmethod
    def log_verbose(message):
        Logger.log(message, "VERBOSE")


def using_decoupled_model_transaction_policy(model_config):
    """Whether a model configuration (as initialize's args["model_config"] gives it, parsed) asks for
    decoupled answers (model_transaction_policy { decoupled: true })."""
    return bool(model_config.get("model_transaction_policy", {}).get("decoupled", False))


class ModelConfig:
    """The configuration TritonPythonModel.auto_complete_config(config) receives and returns, when the
    model loads: what config.pbtxt says (or nothing but the name, without one), to be completed with
    the model's inputs, outputs, batch size, dynamic batching and transaction policy. A tensor the
    configuration already lists must agree with the one added (its type and dims); a max_batch_size
    below the configuration's is refused; each refusal fails the model's load with its message."""

    def __init__(self, model_config):
        self._model_config = json.loads(model_config) if isinstance(model_config, (str, bytes)) else model_config
        self._model_config.setdefault("input", [])
        self._model_config.setdefault("output", [])
        self._model_config.setdefault("max_batch_size", 0)

    def _who(self):
        return "model '" + str(self._model_config.get("name", "")) + "'"

    def as_dict(self):
        return self._model_config

    def set_max_batch_size(self, max_batch_size):
        if not isinstance(max_batch_size, int) or isinstance(max_batch_size, bool) or max_batch_size < 0:
            raise ValueError(f"{self._who()}: auto_complete_config: max_batch_size must be a non-negative integer, "
                             f"got {max_batch_size!r}")
        if self._model_config["max_batch_size"] > max_batch_size:
            raise ValueError(f"{self._who()}: the configuration says max_batch_size "
                             f"{self._model_config['max_batch_size']}, auto_complete_config {max_batch_size}")
        self._model_config["max_batch_size"] = max_batch_size

    def set_dynamic_batching(self):
        for other in ("sequence_batching", "ensemble_scheduling"):
            if other in self._model_config:
                raise ValueError(f"{self._who()}: the configuration schedules it with {other}; auto_complete_config "
                                 "cannot make that dynamic_batching")
        self._model_config.setdefault("dynamic_batching", {})

    def _add(self, kind, tensor, allowed):
        if not isinstance(tensor, dict):
            raise ValueError(f"{self._who()}: auto_complete_config: an {kind} is a dict, got {type(tensor).__name__}")
        name = tensor.get("name")
        extra = sorted(set(tensor) - set(allowed))
        if extra:
            raise ValueError(f"{self._who()}: {kind} {name!r} in auto_complete_config has properties other than "
                             f"{', '.join(allowed)}: {', '.join(extra)}")
        for key in ("name", "data_type", "dims"):
            if key not in tensor:
                raise ValueError(f"{self._who()}: {kind} {name!r} in auto_complete_config lacks {key!r}")
        for current in self._model_config[kind]:
            if current.get("name") != name:
                continue
            have = current.get("data_type", "TYPE_INVALID")
            if have not in ("", "TYPE_INVALID") and have != tensor["data_type"]:
                raise ValueError(f"{self._who()}: {kind} {name!r}: the configuration says {have}, "
                                 f"auto_complete_config {tensor['data_type']}")
            if current.get("dims") and list(current["dims"]) != list(tensor["dims"]):
                raise ValueError(f"{self._who()}: {kind} {name!r}: the configuration says dims {current['dims']}, "
                                 f"auto_complete_config {tensor['dims']}")
            if "optional" in current and "optional" in tensor and current["optional"] != tensor["optional"]:
                raise ValueError(f"{self._who()}: {kind} {name!r}: the configuration says optional "
                                 f"{current['optional']}, auto_complete_config {tensor['optional']}")
            current.update(tensor)
            return
        self._model_config[kind].append(dict(tensor))

    def add_input(self, input):  # noqa: A002 - Triton's parameter name
        self._add("input", input, ("name", "data_type", "dims", "optional"))

    def add_output(self, output):
        self._add("output", output, ("name", "data_type", "dims"))

    def set_model_transaction_policy(self, transaction_policy_dict):
        extra = sorted(set(transaction_policy_dict) - {"decoupled"})
        if extra:
            raise ValueError(f"{self._who()}: auto_complete_config's transaction policy has properties other than "
                             f"decoupled: {', '.join(extra)}")
        policy = self._model_config.setdefault("model_transaction_policy", {})
        if "decoupled" in transaction_policy_dict:
            if "decoupled" in policy and policy["decoupled"] != transaction_policy_dict["decoupled"]:
                raise ValueError(f"{self._who()}: the configuration says decoupled {policy['decoupled']}, "
                                 f"auto_complete_config {transaction_policy_dict['decoupled']}")
            policy["decoupled"] = transaction_policy_dict["decoupled"]


# Custom metrics: the operations a model's metrics made, sent to the server before each batch's
# answer and, while no batch runs, by stub.py's flusher on its own (it sets _metric_wake); the server
# keeps the values and exports them in /metrics. What waits to be sent is bounded: the changes to one
# series become one operation (a counter's or gauge's additions summed, a set taking their place; a
# histogram's observations counted per bucket), and at most _METRIC_OPS_MAX operations wait (beyond:
# dropped, and said on stderr when they are sent). A process the model forks has no metrics.
_METRIC_OPS_MAX = 100000
_metric_ops = []
_metric_series = {}  # a series' key -> the index in _metric_ops of its waiting operation
_metric_declared = set()  # families whose declaration waits to be sent
_metric_dropped = 0
_metric_lock = None  # a threading.Lock, set on first use
_metric_wake = None  # stub.py's flusher: called after each operation
_metric_pid = os.getpid()


def _metric_merge(waiting, op):
    """`op` folded into the series' waiting operation; False when it cannot be (a sum past the
    floats: `op` waits on its own)."""
    import math
    kind = op["op"]
    if kind == "set":
        waiting.clear()
        waiting.update(op)
        return True
    if kind == "observe":
        if "counts" not in waiting:
            waiting["counts"] = [0] * (len(waiting["buckets"]) + 1)
            waiting["counts"][bisect.bisect_left(waiting["buckets"], waiting["value"])] = 1
        total = waiting["value"] + op["value"]
        if not math.isfinite(total):
            return False
        waiting["counts"][bisect.bisect_left(waiting["buckets"], op["value"])] += 1
        waiting["value"] = total
        return True
    total = waiting["value"] + op["value"]  # an add (after an add or a set: the set's value moves)
    if not math.isfinite(total):
        return False
    waiting["value"] = total
    return True


def _metric_op(op):
    global _metric_lock, _metric_dropped
    if os.getpid() != _metric_pid:
        return
    if _metric_lock is None:
        import threading
        _metric_lock = threading.Lock()
    with _metric_lock:
        kind = op["op"]
        if kind == "declare":
            key = None
            if op["name"] in _metric_declared:
                return
            if len(_metric_declared) >= 10000:  # (the server takes 256 families)
                _metric_dropped += 1
                return
            _metric_declared.add(op["name"])
        else:
            key = (op["name"], tuple(sorted(op["labels"].items())), tuple(op.get("buckets") or ()))
            waiting = _metric_series.get(key)
            if waiting is not None and _metric_merge(_metric_ops[waiting], op):
                return
        if len(_metric_ops) >= _METRIC_OPS_MAX and kind != "declare":
            _metric_dropped += 1
            return
        if key:
            _metric_series[key] = len(_metric_ops)
        _metric_ops.append(op)
    if _metric_wake is not None:
        _metric_wake()


def _take_metric_ops():
    """The operations since the last call (stub.py sends them)."""
    global _metric_ops, _metric_series, _metric_declared, _metric_dropped
    if _metric_lock is None or not _metric_ops:
        return []
    with _metric_lock:
        ops, dropped = _metric_ops, _metric_dropped
        _metric_ops, _metric_series, _metric_declared, _metric_dropped = [], {}, set(), 0
    if dropped:
        print(f"quern: {dropped} metric updates dropped (at most {_METRIC_OPS_MAX} wait to be sent)", file=sys.stderr)
    return ops


class MetricFamily:
    """A family of metrics the model defines (Triton's pb_utils.MetricFamily): exported in the server's
    /metrics under `name` with its description, a COUNTER, GAUGE or HISTOGRAM. Values reach the server
    with the batch's answer, or, made while no batch runs, within a tenth of a second."""
    COUNTER, GAUGE, HISTOGRAM = 0, 1, 2
    _KINDS = {0: "counter", 1: "gauge", 2: "histogram"}

    def __init__(self, name, description, kind):
        if kind not in self._KINDS:
            raise ValueError(f"MetricFamily {name!r}: kind must be MetricFamily.COUNTER, GAUGE or HISTOGRAM")
        if not isinstance(name, str) or not name:
            raise ValueError("a MetricFamily needs a name")
        self._name, self._kind = name, kind
        _metric_op({"op": "declare", "name": name, "help": str(description), "kind": self._KINDS[kind]})

    def Metric(self, labels=None, buckets=None):
        return Metric(self, labels, buckets)


class Metric:
    """One series of a MetricFamily, by its labels (a dict of str to str)."""

    def __init__(self, family, labels=None, buckets=None):
        labels = dict(labels or {})
        for k, v in labels.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise ValueError(f"metric {family._name!r}: labels are str to str, got {k!r}: {v!r}")
        if family._kind == MetricFamily.HISTOGRAM:
            import math
            if not buckets:
                raise ValueError(f"histogram {family._name!r}: a Metric needs its buckets")
            if "le" in labels:
                raise ValueError(f"histogram {family._name!r}: the label 'le' is its buckets' own")
            buckets = [float(b) for b in buckets]
            if buckets != sorted(set(buckets)) or not all(math.isfinite(b) for b in buckets):
                raise ValueError(f"histogram {family._name!r}: buckets must be increasing finite numbers")
        elif buckets is not None:
            raise ValueError(f"metric {family._name!r}: only a histogram has buckets")
        self._family, self._labels, self._buckets = family, labels, buckets
        self._value, self._sum, self._count = 0.0, 0.0, 0
        if family._kind != MetricFamily.HISTOGRAM:
            self._op("add", 0.0)  # the series exists from now on, at 0

    def _number(self, value):
        import math
        try:
            number = float(value)
        except (TypeError, ValueError):
            number = math.nan
        if isinstance(value, bool) or not math.isfinite(number):
            raise ValueError(f"metric {self._family._name!r}: a value is a finite number, got {value!r}")
        return number

    def _op(self, op, value):
        _metric_op({"op": op, "name": self._family._name, "labels": self._labels, "value": value,
                    **({"buckets": self._buckets} if self._buckets else {})})

    def increment(self, value):
        value = self._number(value)
        if self._family._kind == MetricFamily.HISTOGRAM:
            raise ValueError("a histogram observes values: observe()")
        if self._family._kind == MetricFamily.COUNTER and value < 0:
            raise ValueError("a counter cannot decrease")
        self._value += value
        self._op("add", value)

    def set(self, value):
        value = self._number(value)
        if self._family._kind != MetricFamily.GAUGE:
            raise ValueError("only a gauge is set")
        self._value = value
        self._op("set", value)

    def observe(self, value):
        value = self._number(value)
        if self._family._kind != MetricFamily.HISTOGRAM:
            raise ValueError("only a histogram observes values")
        self._sum += value
        self._count += 1
        self._op("observe", value)

    def value(self):
        """The value as this process made it (a series several instances add to sums theirs on the
        server); a histogram's: its sum."""
        return self._sum if self._family._kind == MetricFamily.HISTOGRAM else self._value
