# triton_python_backend_utils as Quern's Python models see it (import it as
# pb_utils): the common subset of Triton's Python backend API, so that a
# model.py written for Triton runs unchanged. Tensors are numpy arrays; an
# input tensor's array views the shared memory the server wrote the batch
# into and is valid while execute() runs (copy it to keep it).
import json
import sys

import numpy as np

__all__ = [
    "Tensor", "InferenceRequest", "InferenceResponse", "TritonError", "TritonModelException", "Logger",
    "get_input_tensor_by_name", "get_output_tensor_by_name", "get_input_config_by_name",
    "get_output_config_by_name", "triton_string_to_numpy", "numpy_to_triton_type", "serialize_byte_tensor",
    "deserialize_bytes_tensor",
]

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


class InferenceRequest:
    """One request of a batch, as execute() receives it."""
    __slots__ = ("_inputs", "_by_name", "_request_id", "_correlation_id", "_requested_output_names",
                 "_model_name", "_model_version")

    def __init__(self, inputs=None, request_id="", correlation_id=0, requested_output_names=(), model_name="",
                 model_version=-1, **_ignored):
        self._inputs = list(inputs or [])
        self._by_name = None
        self._request_id = request_id
        self._correlation_id = correlation_id
        self._requested_output_names = list(requested_output_names)
        self._model_name = model_name
        self._model_version = model_version

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
        return "{}"

    def is_cancelled(self):
        return False

    def get_response_sender(self):
        raise TritonModelException("decoupled models (response senders) are not supported by Quern's Python backend")

    def exec(self, *args, **kwargs):
        raise TritonModelException("calling other models from a Python model (BLS) is not supported by Quern's "
                                   "Python backend")

    async_exec = exec


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
