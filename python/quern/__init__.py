"""Quern's engine inside a Python program: dynamic batching, instances and ONNX Runtime, without a
server.

    import numpy as np, quern
    engine = quern.Engine("examples/models")
    result = engine.infer("add_sub", {"INPUT0": np.ones((1, 4), np.float32), "INPUT1": np.ones((1, 4), np.float32)})
    result["OUTPUT0"]          # a numpy array over the engine's own buffer
    result.telemetry           # batch size, queue / compute / total milliseconds

Inputs are numpy arrays (C-contiguous, numeric or bool), read in place while the call runs. Many
threads may call `infer` at once: their requests meet in the model's batches, and each gets its own
result. Errors raise quern.Error subclasses that name the model, the input and what was expected.
"""
from ._quern import Engine as _Engine

__all__ = ["Engine", "Result", "Error", "InvalidArgument", "NotFound", "Unavailable", "DeadlineExceeded",
           "Cancelled", "ResourceExhausted", "FailedPrecondition", "Internal", "Unimplemented"]


class Error(Exception):
    """A request Quern refused or could not answer; `code` is the status name (e.g. "INVALID_ARGUMENT")."""

    def __init__(self, message, code="UNKNOWN"):
        super().__init__(message)
        self.code = code


class InvalidArgument(Error, ValueError):
    """Bad input: a wrong dtype, shape or name; do not retry."""


class NotFound(Error, LookupError):
    """An unknown model or version."""


class Unavailable(Error):
    """The model is not ready or its queue is full; retry later."""


class DeadlineExceeded(Error, TimeoutError):
    """The request's timeout passed before it ran."""


class Cancelled(Error):
    """The request was cancelled."""


class ResourceExhausted(Error):
    """A size limit was exceeded."""


class FailedPrecondition(Error):
    """The request does not fit the model's state."""


class Internal(Error):
    """The model failed."""


class Unimplemented(Error, NotImplementedError):
    """Not supported yet."""


_BY_CODE = {3: InvalidArgument, 5: NotFound, 14: Unavailable, 4: DeadlineExceeded, 1: Cancelled,
            8: ResourceExhausted, 9: FailedPrecondition, 13: Internal, 12: Unimplemented}


def _error(code, name, message):
    """The exception for a status (called by the extension)."""
    return _BY_CODE.get(code, Error)(message, name)


class Result(dict):
    """A request's outputs by name, with `telemetry`: request_id, model_version, batch_size (items in
    the batch it ran in), queue_ms, compute_ms and total_ms."""

    def __init__(self, outputs, telemetry):
        super().__init__(outputs)
        self.telemetry = telemetry


class Engine:
    """Quern's engine over a Triton-style model repository (the models load when it is made)."""

    def __init__(self, model_repository, *, max_queue_wait_ms=0, cores=0):
        self._engine = _Engine(str(model_repository), max_queue_wait_ms, cores)

    def infer(self, model, inputs, *, version=None, priority=None, timeout=None):
        """Runs one request: `inputs` maps input names to numpy arrays (with the batch dimension when the
        model batches); `timeout` in seconds. Returns a Result; the GIL is released while it waits."""
        outputs, telemetry = self._engine.infer(model, inputs, version=version, priority=priority, timeout=timeout)
        return Result(outputs, telemetry)

    def models(self):
        """Every model version: name, version, state, reason, inputs and outputs (name, datatype, dims)."""
        return self._engine.models()
