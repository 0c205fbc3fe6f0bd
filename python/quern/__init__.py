"""Quern's engine inside a Python program: dynamic batching, instances and ONNX Runtime, without a
server.

    import numpy as np, quern
    engine = quern.Engine("examples/models")
    result = engine.infer("add_sub", {"INPUT0": np.ones((1, 4), np.float32), "INPUT1": np.ones((1, 4), np.float32)})
    result["OUTPUT0"]          # a numpy array over the engine's own buffer
    result.telemetry           # batch size, queue / compute / total milliseconds

Inputs are numpy arrays (C-contiguous, numeric or bool), read in place while the call runs; BYTES
tensors are object arrays of bytes or str (str as UTF-8) or numpy 'S'/'U' arrays, copied, and come
back as object arrays of bytes. Many
threads may call `infer` at once, and `infer_async` returns a future (awaitable in asyncio): the
requests meet in the model's batches, and each gets its own result. Errors raise quern.Error subclasses that name the model, the input and what was expected.
"""
import asyncio
import atexit
import concurrent.futures
import os
import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

from . import _quern
from ._quern import Engine as _Engine

__version__: str = _quern.__version__  # the project's version, as CMake states it (quern --version)

__all__ = ["__version__", "Engine", "Result", "InferFuture", "Error", "InvalidArgument", "NotFound", "Unavailable", "DeadlineExceeded",
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


_quern._set_error_factory(_error)
# Engines still open when the interpreter exits are closed first, while their threads may still take
# the GIL to deliver answers.
_open_engines = weakref.WeakSet()
atexit.register(lambda: [e.close() for e in list(_open_engines)])


class Result(dict):
    """A request's outputs by name, with `telemetry`: request_id, model_version, batch_size (items in
    the batch it ran in), queue_ms, compute_ms and total_ms; for an ensemble also `steps`, one dict per
    step (step, model, model_version, batch_size, queue_ms, compute_ms, total_ms) in the order they finished."""

    __slots__ = ("_telemetry",)

    def __init__(self, outputs=(), telemetry=None):
        super().__init__(outputs)
        self._telemetry = {} if telemetry is None else telemetry

    @property
    def telemetry(self) -> dict:
        t = self._telemetry
        if type(t) is tuple:  # as the engine answered: made into a dict once, when first read
            request_id, version, batch_size, queue_ns, compute_ns, total_ns = t
            t = self._telemetry = {"request_id": request_id, "model_version": version, "batch_size": batch_size,
                                   "queue_ms": queue_ns / 1e6, "compute_ms": compute_ns / 1e6,
                                   "total_ms": total_ns / 1e6}
        return t


_quern._set_result_type(Result)


class InferFuture(concurrent.futures.Future):
    """The future of an infer_async request: a concurrent.futures.Future that asyncio code may also
    await. cancel() withdraws the request: one that has not started is never computed; one already
    in a batch still runs, and its answer is dropped."""

    def __init__(self):
        super().__init__()
        self._cancellation = None

    def cancel(self):
        if self._cancellation is not None and not self.done():
            self._cancellation.cancel()
        return super().cancel()

    def __await__(self):
        return asyncio.wrap_future(self).__await__()


class Engine:
    """Quern's engine over a Triton-style model repository (its models load when it is made), and any
    Python functions registered as models."""

    def __init__(self, model_repository: "str | os.PathLike[str] | None" = None, *, max_queue_wait_ms: int = 0,
                 cores: int = 0) -> None:
        self._engine = _Engine("" if model_repository is None else str(model_repository), max_queue_wait_ms, cores)
        _open_engines.add(self)

    def close(self) -> None:
        """Answers what is queued, stops the engine's threads and frees its models; later calls raise
        quern.Unavailable. Also on leaving a `with` block, and at interpreter exit."""
        self._engine.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def infer(self, model: str, inputs: "dict[str, np.ndarray]", *, version: "int | None" = None,
              priority: "int | None" = None, timeout: "float | None" = None) -> Result:
        """Runs one request: `inputs` maps input names to numpy arrays (with the batch dimension when the
        model batches); `timeout` in seconds. Returns a Result; the GIL is released while it waits."""
        if version is None and priority is None and timeout is None:
            return self._engine.infer(model, inputs)
        return self._engine.infer(model, inputs, version=version, priority=priority, timeout=timeout)

    def infer_async(self, model: str, inputs: "dict[str, np.ndarray]", *, version: "int | None" = None,
                    priority: "int | None" = None, timeout: "float | None" = None) -> InferFuture:
        """Submits one request and returns at once with an InferFuture (await it, or call result());
        a refusal or a failure is raised from it. The inputs must stay unchanged until it is done: the
        engine reads them in place. Done-callbacks added to the future run on an engine thread: they
        must not wait for another request of the same model."""
        future = InferFuture()

        def done(result, error):  # on an engine thread, with the GIL
            try:
                if error is not None:
                    future.set_exception(error)
                else:
                    future.set_result(result)
            except concurrent.futures.InvalidStateError:
                pass  # cancelled meanwhile
        try:
            future._cancellation = self._engine.infer_async(model, inputs, done, version=version,
                                                            priority=priority, timeout=timeout)
        except Error as e:  # refused at once (bad input, unknown model, full queue): through the future too
            future.set_exception(e)
        return future

    def register(self, name: str, fn, *, inputs, outputs, max_batch_size: int = 8, instances: int = 1,
                 max_queue_delay_us: int = 0) -> None:
        """Serves a Python function as model `name`, batched like any other: fn({input name: array}) ->
        {output name: array}, every array with the batch along its first dimension (requests of many
        callers meet in one call when max_batch_size > 0). `inputs` and `outputs` are
        [(name, datatype, dims without the batch dimension)], datatype a KServe name such as "FP32" or
        "BYTES" (object arrays of bytes in; bytes, str, 'S' or 'U' arrays out).
        The input arrays are read-only copies of the batch; each output must have the declared dims
        (-1: any) after the batch; an exception fails that batch's requests with its message
        (quern.Internal), and the model goes on serving. The function runs on the engine's threads
        (one batch at a time: the GIL): a blocking infer on the same model from inside it waits for
        itself. A function that holds the engine keeps it alive until close()."""
        self._engine.register(name, fn, [tuple(i) for i in inputs], [tuple(o) for o in outputs], max_batch_size,
                              instances, max_queue_delay_us)

    def models(self) -> "list[dict]":
        """Every model version: name, version, state, reason, inputs and outputs (name, datatype, dims)."""
        return self._engine.models()
