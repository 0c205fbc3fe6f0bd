# The process that runs one instance of a Python model for the Quern server.
#
# The server starts `python3 -c <bootstrap>` with these descriptors:
#   3  a Unix socket from the server: frames of a 4-byte little-endian
#      length and a payload (this source, the pb_utils source, the launch
#      JSON, then one execute frame per batch and a shutdown frame)
#   4  a Unix socket to the server, frames the same way (ready, then one
#      answer per batch); a socket of its own, so that the server reading
#      an answer does not wake this process waiting on socket 3
#   5, 7, 8, 9  memfds shared with the server, the slots: a batch's input
#      tensors are written into one slot by the server, its output tensors
#      into the same slot by this process (either side may grow it); the
#      server may keep a slot's outputs while it answers, using another slot
#      for the next batch
#   10 a memfd shared with the server, the BLS slot: the input tensors of this process's calls to
#      other models (written here), then the outputs of their answers (written by the server)
#   6  the read end of a pipe the server holds open: when the server exits,
#      it reports a hang-up and this process exits too
#   1, 2  a pipe into the server's log
# The bootstrap has already defined _read_frame(); this source runs in its
# globals.
import inspect
import json
import mmap
import os
import select
import signal
import struct
import sys
import threading
import traceback
import types

CONTROL_FD, REPLY_FD, LIFE_FD = 3, 4, 6
SHM_FDS = (5, 7, 8, 9)
BLS_FD = 10
ALIGN = 64
MAX_SHM_BYTES = 1 << 34  # 16 GiB: no batch of outputs is larger
MAX_FRAME_BYTES = 64 << 20  # as the server's kMaxFrameBytes: a larger frame ends the process
BYTES = 13
_NUMPY_TYPES = {1: "bool", 2: "uint8", 3: "uint16", 4: "uint32", 5: "uint64", 6: "int8", 7: "int16", 8: "int32",
                9: "int64", 10: "float16", 11: "float32", 12: "float64"}

# The frames' fields, compiled once (a format string is looked up on every call otherwise).
_U32 = struct.Struct("<I")
_U16 = struct.Struct("<H")
_BATCH = struct.Struct("<BIIqQ")  # after the op: slot, requests, inputs, padded rows, slot size
_ID_LEN = struct.Struct("<H")
_TENSOR = struct.Struct("<HBB")  # name length, type, rank
_PLACE = struct.Struct("<QQ")  # offset and bytes in the slot
_REPLY = struct.Struct("<QI")  # slot size, failed requests
_FAILED = struct.Struct("<IBI")
_INT64S = {}


def _int64s(n):
    """The Struct of n little-endian int64s."""
    s = _INT64S.get(n)
    if s is None:
        s = _INT64S[n] = struct.Struct(f"<{n}q")
    return s


_inbox = bytearray()


def _next_frame():
    """The next frame, reading as much as the socket holds at once."""
    global _inbox
    while True:
        if len(_inbox) >= 4:
            (n,) = _U32.unpack_from(_inbox)
            if len(_inbox) >= 4 + n:
                frame = bytes(_inbox[4:4 + n])
                del _inbox[:4 + n]
                return frame
        chunk = _read_control()
        # Most reads hold exactly one frame: it is returned without passing through the inbox.
        if not _inbox and len(chunk) >= 4 and _U32.unpack_from(chunk)[0] == len(chunk) - 4:
            return chunk[4:]
        _inbox += chunk


_send_lock = threading.Lock()  # a decoupled model's threads send beside the main thread


def _read_control():
    """What the control socket holds (at least a byte: blocks until then); the server gone, this
    process ends."""
    try:
        chunk = os.read(CONTROL_FD, 65536)
    except OSError:
        chunk = b""
    if not chunk:
        _server_gone()
    return chunk


def _send(payload):
    data = _U32.pack(len(payload)) + payload
    view = memoryview(data)
    with _send_lock:
        try:
            while view:
                view = view[os.write(REPLY_FD, view):]
        except OSError:
            _server_gone()


_metric_send_lock = threading.Lock()
METRIC_FLUSH_S = 0.05  # how long the flusher lets a model's metric changes gather before it sends them
METRIC_FRAME_BYTES = 1 << 20  # the most JSON one frame "M" carries


def _send_metrics(utils):
    """The model's metric operations waiting, in frames "M" of at most METRIC_FRAME_BYTES (one sender
    at a time: the server applies them in the order they were made)."""
    with _metric_send_lock:
        ops = utils._take_metric_ops()
        part, size = [], 0
        for op in ops:
            text = json.dumps(op)
            if part and size + len(text) > METRIC_FRAME_BYTES:
                _send(b"M[" + ",".join(part).encode("utf-8") + b"]")
                part, size = [], 0
            part.append(text)
            size += len(text) + 1
        if part:
            _send(b"M[" + ",".join(part).encode("utf-8") + b"]")


def _start_metric_flusher(utils):
    """Sends what the model's metrics changed while no batch runs (in initialize(), from its own
    threads), within METRIC_FLUSH_S of the change: a batch's answer takes them first otherwise. Its
    thread starts with the model's first metric, on the CPUs the process started with."""
    import time
    wake = threading.Event()
    started = threading.Lock()
    cpus = os.sched_getaffinity(0)

    def run():
        try:
            os.sched_setaffinity(0, cpus)  # (not the one CPU a batch's thread may be held on)
        except OSError:
            pass
        while True:
            wake.wait()
            time.sleep(METRIC_FLUSH_S)  # what else changes meanwhile goes in the same frame
            wake.clear()
            _send_metrics(utils)

    def changed():
        if os.getpid() != _bls_state["pid"]:
            return  # a process the model forked: its metrics are its own
        if not wake.is_set():
            wake.set()
        if started.acquire(blocking=False):  # (kept: the first change starts it)
            try:
                threading.Thread(target=run, daemon=True, name="quern-metrics").start()
            except RuntimeError:  # no thread now (e.g. the model's memory bound): the next change tries again
                started.release()

    utils._metric_wake = changed
    if utils._metric_ops:
        changed()  # what initialize() did


def _server_gone():
    """The server is gone, killed perhaps, and cannot end this process group
    itself: workers model.py forked share it and end with it, this process
    too. Whichever thread notices first (the watcher, or the main thread
    finding the socket closed) does it."""
    try:
        os.killpg(0, signal.SIGKILL)
    finally:
        os._exit(0)


def _watch_server():
    poller = select.poll()
    poller.register(LIFE_FD, select.POLLIN)
    while True:
        if poller.poll():
            _server_gone()  # a hang-up: nothing is ever written to the pipe


_MAX_MEMORY_MB = 0  # quern.python.max_memory_mb; 0 = no bound


def _last_line(exc):
    lines = traceback.format_exception_only(type(exc), exc)
    line = lines[-1].strip() if lines else type(exc).__name__
    if isinstance(exc, MemoryError) and _MAX_MEMORY_MB:
        line += f" (the model's memory bound: quern.python.max_memory_mb = {_MAX_MEMORY_MB})"
    return line if len(line) <= 2000 else line[:2000] + "..."


def _end_with_this_process():
    """What this process starts from its main thread (where initialize and execute run) ends with
    it: each such child (os.fork, multiprocessing, subprocess) asks the kernel to be killed when
    the thread that started it ends (PR_SET_PDEATHSIG), so that nothing outlives the server, whose
    death kills this process the same way (the bootstrap), not even a child that left the process
    group with setsid(). A child started from another thread is left as it is (that thread may
    end long before the process); an unload still kills every process below this one."""
    import ctypes
    import subprocess
    libc = ctypes.CDLL(None)
    forking_from_main = [False]

    def dies_with_parent():
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)

    def before():
        forking_from_main[0] = threading.current_thread() is threading.main_thread()

    def after_in_child():
        if forking_from_main[0]:
            dies_with_parent()

    os.register_at_fork(before=before, after_in_child=after_in_child)
    # subprocess forks in C without running the hooks above: its preexec_fn does it.
    popen_init = subprocess.Popen.__init__

    def init(self, *args, preexec_fn=None, **kwargs):
        if threading.current_thread() is not threading.main_thread():
            return popen_init(self, *args, preexec_fn=preexec_fn, **kwargs)

        def preexec():
            dies_with_parent()
            if preexec_fn is not None:
                preexec_fn()
        popen_init(self, *args, preexec_fn=preexec, **kwargs)

    subprocess.Popen.__init__ = init


def _bound_memory(mb):
    """quern.python.max_memory_mb: the process's address space is bounded (RLIMIT_AS); an
    allocation beyond it fails in the model (MemoryError in numpy), not on the host."""
    global _MAX_MEMORY_MB
    if not mb:
        return
    import resource
    _MAX_MEMORY_MB = int(mb)
    limit = _MAX_MEMORY_MB << 20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


class Shm:
    """One slot of shared memory, mapped whole; remapped when either side grows it."""

    def __init__(self, fd):
        self.fd = fd
        self.size = 0
        self.map = None
        self.address = 0

    def ensure(self, size):
        if size > self.size:
            import ctypes
            # The old map stays alive while arrays still view it.
            self.map = mmap.mmap(self.fd, size)
            self.size = size
            self.address = ctypes.addressof(ctypes.c_char.from_buffer(self.map))

    def offset_of(self, array, end):
        """Where `array` lies in this slot when it is a contiguous view of this batch's inputs (the
        first `end` bytes; an input passed on), else None."""
        if not array.flags.c_contiguous:
            return None
        start = array.__array_interface__["data"][0] - self.address
        if 0 <= start and start + array.nbytes <= min(end, self.size):
            return start
        return None

    def grow(self, needed):
        if needed > MAX_SHM_BYTES:
            raise MemoryError(f"outputs need {needed} bytes of shared memory; at most {MAX_SHM_BYTES}")
        current = os.fstat(self.fd).st_size
        if needed > current:
            size = max(needed, min(current * 2, MAX_SHM_BYTES))
            size = (size + (1 << 20) - 1) & ~((1 << 20) - 1)
            os.ftruncate(self.fd, size)
            current = size
        self.ensure(current)


class Runner:
    def __init__(self, launch, np, utils):
        self.np = np
        self.utils = utils
        self.slots = [Shm(fd) for fd in SHM_FDS]
        self.shm = self.slots[0]
        self.name = launch["model_name"]
        self.batched = launch["max_batch_size"] > 0
        self.decoupled = bool(launch.get("decoupled", False))
        self.senders = {}  # a decoupled model's open requests of the running batch: index -> sender
        self.batch = 0  # batches received, as the server counts them (a decoupled model's frames name theirs)
        self.outputs = [(o["name"], o["dtype"], o["dims"]) for o in launch["outputs"]]
        self.dtypes = {t: np.dtype(n) for t, n in _NUMPY_TYPES.items()}
        # Per output, what a checked array must be when it is already right (the common case, taken
        # without building error context): its numpy type, and its dimensions when none is open.
        self.expect = [(self.dtypes.get(dtype), tuple(dims) if all(d >= 0 for d in dims) else None)
                       for _, dtype, dims in self.outputs]
        # Per output, the start of its entry in the reply (length, type, rank, name).
        self.described = [_TENSOR.pack(len(name.encode()), dtype, len(dims) + (1 if self.batched else 0)) +
                          name.encode() for name, dtype, dims in self.outputs]
        self.ndarray = np.ndarray
        self.request_ids = ()
        self.placed = {}
        self.args = launch["args"]
        module = self._import(launch)
        self.triton = None
        self.infer = None
        if hasattr(module, "TritonPythonModel"):
            self.triton = module.TritonPythonModel()
            if hasattr(self.triton, "initialize"):
                self.triton.initialize(dict(self.args))
        elif callable(getattr(module, "infer", None)):
            if callable(getattr(module, "initialize", None)):
                module.initialize(dict(self.args))
            self.infer = module.infer
        else:
            raise TypeError(f"{launch['model_file']} defines neither a class TritonPythonModel nor a function "
                            "infer(inputs)")
        self.module = module
        if self.decoupled and self.triton is None:
            raise TypeError(f"{launch['model_file']}: a decoupled model (model_transaction_policy) answers through "
                            "its requests' senders: it defines class TritonPythonModel, not infer(inputs)")

    def _import(self, launch):
        import importlib.util
        path = launch["model_file"]
        spec = importlib.util.spec_from_file_location("model", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules["model"] = module
        spec.loader.exec_module(module)
        return module

    def finalize(self):
        target = self.triton if self.triton is not None else self.module
        fn = getattr(target, "finalize", None)
        if callable(fn):
            fn()

    # --- one batch ---------------------------------------------------------

    def read_inputs(self, frame):
        slot, n_requests, n_inputs, padded, shm_size = _BATCH.unpack_from(frame, 1)
        pos = 26
        self.shm = self.slots[slot]
        rows = _int64s(n_requests).unpack_from(frame, pos)
        pos += 8 * n_requests
        ids_at = pos
        for _ in range(n_requests):  # each request's id, then its parameters
            pos += 2 + _ID_LEN.unpack_from(frame, pos)[0]
            pos += 4 + _U32.unpack_from(frame, pos)[0]
        self.ids_frame = (frame, ids_at, n_requests)  # decoded only for execute(requests)
        self.shm.ensure(shm_size)
        shm = self.shm.map
        inputs = {}
        # Each input array by its id, with its offset: an output that is one of them is already in
        # place (the array is held here, so the id cannot be another object's while the batch runs).
        placed = self.placed = {}
        end = 0
        for _ in range(n_inputs):
            name_len, dtype, rank = _TENSOR.unpack_from(frame, pos)
            pos += 4
            name = frame[pos:pos + name_len].decode()
            pos += name_len
            dims = _int64s(rank).unpack_from(frame, pos)
            pos += 8 * rank
            offset, nbytes = _PLACE.unpack_from(frame, pos)
            pos += 16
            if offset + nbytes > end:
                end = offset + nbytes
            if dtype == BYTES:
                array = self._decode_bytes(memoryview(shm)[offset:offset + nbytes], dims)
            else:
                t = self.dtypes[dtype]
                array = self.np.frombuffer(shm, t, nbytes // t.itemsize, offset).reshape(dims)
                array.flags.writeable = False
                placed[id(array)] = (array, offset)
            inputs[name] = array
        return rows, padded, inputs, end

    def _read_ids(self):
        """Each request's id and parameters (a JSON object's text, "{}" for none)."""
        frame, pos, n = self.ids_frame
        ids, parameters = [], []
        for _ in range(n):
            (id_len,) = _ID_LEN.unpack_from(frame, pos)
            ids.append(frame[pos + 2:pos + 2 + id_len].decode("utf-8", "replace"))
            pos += 2 + id_len
            (p_len,) = _U32.unpack_from(frame, pos)
            parameters.append(frame[pos + 4:pos + 4 + p_len].decode("utf-8", "replace") if p_len else "{}")
            pos += 4 + p_len
        return ids, parameters

    def _decode_bytes(self, view, dims):
        np = self.np
        count = 1
        for d in dims:
            count *= d
        out = np.empty(count, dtype=np.object_)
        pos = 0
        for i in range(count):
            n = int.from_bytes(view[pos:pos + 4], "little")
            out[i] = bytes(view[pos + 4:pos + 4 + n])
            pos += 4 + n
        return out.reshape(dims)

    def _check(self, name, dtype, dims, array, rows, expect=(None, None)):
        """`array` as the output `name` should be, or raises ValueError saying why. `expect` is the
        output's entry in self.expect."""
        want, fixed = expect
        if fixed is not None and type(array) is self.ndarray and array.dtype is want:
            if array.shape == (((rows,) + fixed) if self.batched else fixed):
                return array
        array = _typed(self.np, name, dtype, array, self.dtypes.get(dtype))
        shape = array.shape
        expect = ([rows] if self.batched else []) + list(dims)
        if len(shape) != len(expect) or any(e >= 0 and s != e for s, e in zip(shape, expect)):
            shown = ["-1" if e < 0 else str(e) for e in expect]
            raise ValueError(f"output '{name}' has shape {list(shape)}; expected [{', '.join(shown)}]"
                             + (" (the first dimension is the request's rows)" if self.batched else ""))
        return array

    def execute(self, frame):
        self.batch = (self.batch + 1) & 0xFFFFFFFF
        rows, padded, inputs, end = self.read_inputs(frame)
        if self.decoupled:
            return self._execute_decoupled(rows, inputs)
        failed = {}
        if self.triton is not None:
            columns = self._execute_triton(rows, inputs, failed)
        else:
            columns = self._execute_plain(padded, inputs)
        return self._write_outputs(rows, padded, columns, failed, end)

    def _execute_plain(self, padded, inputs):
        result = self.infer(inputs)
        if not isinstance(result, dict):
            raise TypeError(f"infer() returned {type(result).__name__}; expected a dict of output name to array")
        columns = []
        for (name, dtype, dims), expect in zip(self.outputs, self.expect):
            if name not in result:
                raise ValueError(f"infer() returned no output '{name}' (it returned {sorted(map(str, result))})")
            columns.append([self._check(name, dtype, dims, result[name], padded, expect)])
        return columns

    def _requests(self, rows, inputs):
        """execute()'s requests: each its rows of the batch's inputs (views of the slot)."""
        utils = self.utils
        names = [o[0] for o in self.outputs]
        self.request_ids, parameters = self._read_ids()
        requests = []
        start = 0
        for i, r in enumerate(rows):
            if self.batched:
                tensors = [utils.Tensor(n, a[start:start + r]) for n, a in inputs.items()]
            else:
                tensors = [utils.Tensor(n, a) for n, a in inputs.items()]
            request = utils.InferenceRequest(tensors, request_id=self.request_ids[i], requested_output_names=names,
                                             model_name=self.name)
            request._parameters = parameters[i]  # the server's JSON (its front end checked it)
            requests.append(request)
            start += r
        return requests

    def _execute_triton(self, rows, inputs, failed):
        utils = self.utils
        requests = self._requests(rows, inputs)
        with _bls_lock:
            _bls_state["open"] = True
        try:
            responses = self.triton.execute(requests)
            if inspect.iscoroutine(responses):  # an `async def execute` (awaiting BLS calls)
                import asyncio
                responses = asyncio.run(responses)
        finally:
            with _bls_lock:  # a call under way on another thread ends first
                _bls_state["open"] = False
        if responses is None or len(responses) != len(requests):
            got = "None" if responses is None else f"{len(responses)} responses"
            raise ValueError(f"execute() returned {got} for {len(requests)} requests")
        columns = [[] for _ in self.outputs]
        for i, response in enumerate(responses):
            try:
                if not isinstance(response, utils.InferenceResponse):
                    raise TypeError(f"execute() returned {type(response).__name__} for request {i}; expected "
                                    "pb_utils.InferenceResponse")
                if response.has_error():
                    error = response.error()
                    if isinstance(error, utils.TritonError):
                        raise _RequestError(error.message(), error.code())
                    raise _RequestError(str(error), utils.TritonError.UNKNOWN)
                by_name = {t.name(): t for t in response.output_tensors()}
                checked = []
                for (name, dtype, dims), expect in zip(self.outputs, self.expect):
                    t = by_name.get(name)
                    if t is None:
                        raise ValueError(f"the response has no output '{name}'")
                    checked.append(self._check(name, dtype, dims, t.as_numpy(), rows[i], expect))
                for k, a in enumerate(checked):
                    columns[k].append(a)
            except _RequestError as e:
                failed[i] = (e.code, str(e))
                for k in range(len(self.outputs)):
                    columns[k].append(None)
            except Exception as e:
                failed[i] = (_error_code(e, utils), _last_line(e))
                for k in range(len(self.outputs)):
                    columns[k].append(None)
        return columns

    def _execute_decoupled(self, rows, inputs):
        """execute(requests) of a decoupled model: its responses go out as it sends them (frames "P"),
        from this thread or any other, during execute() or after; the answer is "d", execute()
        returned. The inputs are views of the batch's slot, which the server keeps for the batch
        until every request is closed (the final flag)."""
        utils = self.utils
        requests = self._requests(rows, inputs)
        self.senders = {}
        for i, request in enumerate(requests):
            request._response_sender = self.senders[i] = ResponseSender(self, i, self.batch)
        self.placed = {}
        with _bls_lock:
            _bls_state["open"] = True
        error = None
        try:
            returned = self.triton.execute(requests)
            if inspect.iscoroutine(returned):
                import asyncio
                returned = asyncio.run(returned)
            if returned is not None:
                error = (utils.TritonError.INTERNAL, f"execute() of decoupled model '{self.name}' returned "
                         f"{type(returned).__name__}: a decoupled model sends its responses through "
                         "request.get_response_sender() and returns None")
        except BaseException as e:  # noqa: BLE001 - every request still open fails with it
            if isinstance(e, SystemExit):
                raise
            traceback.print_exc()
            sys.stderr.flush()
            error = (_error_code(e, utils), _last_line(e))
        finally:
            with _bls_lock:
                _bls_state["open"] = False
        if error is not None:
            for sender in list(self.senders.values()):
                sender._close_with(error)
        return b"d" + _U32.pack(self.batch)

    def encode_response(self, batch, index, response, final):
        """The frame "P" of one response (see the server's PythonModel::Deliver)."""
        np, utils = self.np, self.utils
        head = b"P" + struct.pack("<IIB", batch, index, 1 if final else 0)
        if response is None:
            return head + b"\0"
        try:
            if not isinstance(response, utils.InferenceResponse):
                raise TypeError(f"send() got {type(response).__name__}; expected pb_utils.InferenceResponse")
            if response.has_error():
                error = response.error()
                if isinstance(error, utils.TritonError):
                    raise _RequestError(error.message(), error.code())
                raise _RequestError(str(error), utils.TritonError.INTERNAL)
            by_name = {name: (dtype, dims) for name, dtype, dims in self.outputs}
            parts = []
            for t in response.output_tensors():
                name = t.name()
                if name not in by_name:
                    raise ValueError(f"the response holds '{name}', which is not an output of the model "
                                     f"(outputs: {', '.join(sorted(by_name))})")
                dtype, _ = by_name[name]
                array = _typed(np, name, dtype, t.as_numpy(), self.dtypes.get(dtype))
                parts.append(_encode_tensor(name, array, np, utils))
            payload = head + b"\1" + struct.pack("<H", len(parts)) + b"".join(parts)
            if len(payload) > MAX_FRAME_BYTES:
                raise _RequestError(f"a response of {len(payload)} bytes; at most {MAX_FRAME_BYTES} go in one",
                                    utils.TritonError.UNSUPPORTED)
            return payload
        except _RequestError as e:
            code, message = e.code, str(e)
        except Exception as e:  # noqa: BLE001 - the caller gets the error as this response
            code, message = _error_code(e, utils), _last_line(e)
        m = message[:2000].encode("utf-8", "replace")
        return head + b"\2" + struct.pack("<BI", code & 0xFF, len(m)) + m

    def cancel(self, index):
        sender = self.senders.get(index)
        if sender is not None:
            sender._cancelled = True

    def forget(self, batch):
        """The server ended batch `batch` (its callers gone, or its time up): its senders are closed;
        what they sent meanwhile the server drops."""
        if batch == self.batch:
            for sender in list(self.senders.values()):
                sender._cancelled = True
                sender._closed = True
            self.senders = {}

    def _write_outputs(self, rows, padded, columns, failed, end):
        """Writes each output's parts after the inputs; returns the reply frame."""
        np = self.np
        shm = self.shm
        plain = self.triton is None
        described = []
        offset = (end + ALIGN - 1) & ~(ALIGN - 1)
        for (name, dtype, dims), parts, head in zip(self.outputs, columns, self.described):
            present = [p for p in parts if p is not None]
            if present:
                inner = list(present[0].shape[1:] if self.batched else present[0].shape)
                for p in present:
                    if list(p.shape[1:] if self.batched else p.shape) != inner:
                        raise ValueError(f"output '{name}' has shape {list(p.shape)} in one response and "
                                         f"{inner} after the rows in another: a batch's outputs must agree")
            else:
                inner = [max(d, 0) for d in dims]
            out_dims = ([padded] + inner) if self.batched else inner
            if dtype == BYTES:
                pieces = []
                row = 0
                for i, p in enumerate(parts):
                    if p is None:
                        pieces.append(b"\0\0\0\0" * (rows[i] * _count(inner)))
                    else:
                        pieces.append(self.utils.serialize_byte_tensor(p).tobytes())
                    row += rows[i]
                if self.batched and not plain and row < padded:
                    pieces.append(b"\0\0\0\0" * ((padded - row) * _count(inner)))
                data = b"".join(pieces)
                nbytes = len(data)
                shm.grow(offset + nbytes)
                shm.map[offset:offset + nbytes] = data
            else:
                t = self.dtypes[dtype]
                nbytes = _count(out_dims) * t.itemsize
                # An output that is an input passed on (or a view of one) is already in place.
                whole = None
                if parts[0] is not None and (plain or (len(parts) == 1 and (not self.batched or padded == rows[0]))):
                    whole = parts[0]
                at = None
                if whole is not None and nbytes:
                    input_there = self.placed.get(id(whole))
                    if input_there is not None and input_there[0] is whole and whole.nbytes == nbytes:
                        at = input_there[1]  # an input passed on as it came
                    else:
                        at = shm.offset_of(whole, end)
                if at is not None and at % t.itemsize == 0:
                    described.append(_describe(head, out_dims, at, nbytes))
                    continue
                shm.grow(offset + nbytes)
                dst = np.frombuffer(shm.map, t, _count(out_dims), offset).reshape(out_dims)
                if plain or not self.batched:
                    if parts[0] is None:
                        dst[...] = 0
                    else:
                        np.copyto(dst, parts[0])
                else:
                    row = 0
                    for i, p in enumerate(parts):
                        if p is None:
                            dst[row:row + rows[i]] = 0
                        else:
                            dst[row:row + rows[i]] = p
                        row += rows[i]
                    if row < padded:
                        dst[row:] = 0
                del dst
            described.append(_describe(head, out_dims, offset, nbytes))
            offset = (offset + nbytes + ALIGN - 1) & ~(ALIGN - 1)
        self.placed = {}
        reply = [b"D", _REPLY.pack(shm.size, len(failed))]
        for i, (code, message) in failed.items():
            m = message[:2000].encode("utf-8", "replace")  # whole characters: the error goes into JSON
            reply.append(_FAILED.pack(i, code & 0xFF, len(m)) + m)
        reply.append(_U32.pack(len(described)))
        return b"".join(reply + described)


def _typed(np, name, dtype, array, want):
    """`array` (or a list) as output `name` of the configured type `dtype` (numpy type `want`; None for
    BYTES), converted when no value changes (see _cast); else ValueError saying why."""
    if not isinstance(array, np.ndarray):
        array = np.asarray(array, dtype=np.object_ if dtype == BYTES else None)
    if dtype == BYTES:
        if array.dtype.kind not in "OSU":
            raise ValueError(f"output '{name}' has dtype {array.dtype}; the configuration says TYPE_STRING "
                             "(bytes or str elements)")
        return array
    return array if array.dtype == want else _cast(np, name, array, want)


def _cast(np, name, array, want):
    """`array` as numpy type `want`, when no value changes: safe casts, a float to a narrower float
    (kept closely), and integers that fit (int64 -> int32 of small numbers); else ValueError. int64 ->
    int8 of large numbers or uint64 -> int64 would answer wrong numbers."""
    kind, to = array.dtype.kind, want.kind
    if kind not in "OSUV" and (np.can_cast(array.dtype, want, "safe") or (kind == "f" and to == "f")):
        return array.astype(want)
    if kind in "biu" and to in "iu":
        limits = np.iinfo(want)
        if array.size == 0 or (int(array.min()) >= limits.min and int(array.max()) <= limits.max):
            return array.astype(want)
        raise ValueError(f"output '{name}' has dtype {array.dtype}; the configuration says {want} (and a value "
                         "does not fit it)")
    raise ValueError(f"output '{name}' has dtype {array.dtype}; the configuration says {want}")


class _RequestError(Exception):
    def __init__(self, message, code):
        super().__init__(message)
        self.code = code


class ResponseSender:
    """request.get_response_sender() of a decoupled model (Triton's InferenceResponseSender): send()
    from any thread of the model's process, during execute() or after it returned, until the final
    flag closes the request."""

    def __init__(self, runner, index, batch):
        self._runner = runner
        self._index = index
        self._batch = batch
        self._lock = threading.Lock()
        self._closed = False
        self._cancelled = False

    def send(self, response=None, flags=0):
        utils = self._runner.utils
        final_flag = utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        if flags not in (0, final_flag):
            raise utils.TritonModelException(f"send(flags={flags!r}): flags is 0 or "
                                             "TRITONSERVER_RESPONSE_COMPLETE_FINAL")
        if response is None and flags != final_flag:
            raise utils.TritonModelException("send() without a response needs flags="
                                             "TRITONSERVER_RESPONSE_COMPLETE_FINAL")
        if os.getpid() != _bls_state["pid"]:
            raise utils.TritonModelException("a response sender works only in the model's own process")
        final = flags == final_flag
        with self._lock:  # the frames of one request leave in the order sent
            if self._closed:
                raise utils.TritonModelException("Unable to send response. Response sender has been closed.")
            payload = self._runner.encode_response(self._batch, self._index, response, final)
            _send_metrics(utils)  # the model's metrics before its answer, as for a batch
            _send(payload)
            if final:
                self._closed = True
                self._forget_me()

    def _forget_me(self):
        senders = self._runner.senders
        if senders.get(self._index) is self:  # (not a later batch's sender of the same index)
            del senders[self._index]

    def is_cancelled(self):
        if not self._cancelled:
            _read_cancellations()
        return self._cancelled

    def _close_with(self, error):
        """Closes the request with `error` (code, message), unless closed already."""
        code, message = error
        with self._lock:
            if self._closed:
                return
            self._closed = True
            m = message[:2000].encode("utf-8", "replace")
            _send(b"P" + struct.pack("<IIB", self._batch, self._index, 1) + b"\2" + struct.pack("<BI", code & 0xFF, len(m))
                  + m)
            self._forget_me()


_runner = None  # the Runner, for cancellations read beside a call to another model


def _cancellation(frame):
    """Applies the frame "K" (a request of the running batch was cancelled: u32 its index)."""
    if _runner is not None and len(frame) >= 5:
        _runner.cancel(_U32.unpack_from(frame, 1)[0])


def _read_cancellations():
    """While execute() runs the main thread reads no frames: cancellations sent meanwhile are read
    here (whole frames "K" at the front of what has arrived), when the model asks."""
    global _inbox
    if os.getpid() != _bls_state["pid"]:
        return
    with _bls_lock:
        if not _bls_state["open"]:
            return  # the main thread reads them itself
        while select.select([CONTROL_FD], [], [], 0)[0]:
            _inbox += _read_control()
        while len(_inbox) >= 9:
            (n,) = _U32.unpack_from(_inbox)
            if len(_inbox) < 4 + n or _inbox[4:5] != b"K":
                break
            _cancellation(bytes(_inbox[4:4 + n]))
            del _inbox[:4 + n]


def _error_code(exc, utils):
    """Triton's code for an exception: a raised TritonError keeps its own, anything else is INTERNAL."""
    if isinstance(exc, utils.TritonError) and isinstance(exc.code(), int):
        return exc.code()
    return utils.TritonError.INTERNAL


def _describe(head, dims, offset, nbytes):
    """An output's entry in the reply: `head` (its name's length, type, rank and name, from
    Runner.described), then its shape and where its bytes lie in the slot."""
    return head + _int64s(len(dims)).pack(*dims) + _PLACE.pack(offset, nbytes)


def _count(dims):
    n = 1
    for d in dims:
        n *= d
    return n


# BLS: a model calling another model while its execute() runs. The request goes to the server as the
# frame "B" on the reply socket; the server runs it like any request and answers "b" on the control
# socket. One call at a time (a lock): calls from several threads, or awaited together, run one after
# another. The answer to the batch waits for a call under way. The tensors, both ways, go through the
# BLS slot (shared memory, fd 10): the frames say where they lie; what is read from it is copied, as
# the next call writes there again.
_BLS = struct.Struct("<IqQBQ")  # call, version, timeout (us), decoupled (all responses), input bytes in the slot
MAX_BLS_BYTES = 1 << 30  # as the server's kMaxBlsAnswerBytes: a call's inputs, and an answer's outputs
_bls_lock = threading.Lock()
_bls_state = {"next": 0, "open": False, "pid": os.getpid()}
_NUMPY_CODES = {v: k for k, v in _NUMPY_TYPES.items()}
_DTYPE_CODES = {}  # numpy dtype (native byte order) -> its code, filled by _dtype_codes on first use


_DTYPES = {}  # code -> numpy dtype, likewise


def _dtype_codes(np):
    if not _DTYPE_CODES:
        _DTYPE_CODES.update({np.dtype(v): k for k, v in _NUMPY_TYPES.items()})
        _DTYPES.update({k: np.dtype(v) for k, v in _NUMPY_TYPES.items()})
    return _DTYPE_CODES


def _encode_tensor(name, array, np, utils):
    """A tensor of a frame with its bytes in it (a decoupled model's response, frame "P")."""
    if array.dtype.kind in "OSU":
        code, data = BYTES, utils.serialize_byte_tensor(array).tobytes()
    else:
        code = _NUMPY_CODES.get(array.dtype.name)
        if code is None:
            raise TypeError(f"output '{name}' has numpy type {array.dtype}, which the server has no type for")
        data = np.ascontiguousarray(array.astype(array.dtype.newbyteorder("="), copy=False)).tobytes()
    raw = name.encode("utf-8")
    return (struct.pack("<HBB", len(raw), code, array.ndim) + raw + _int64s(array.ndim).pack(*array.shape) +
            struct.pack("<Q", len(data)) + data)


def _bls_inputs(request, np, utils):
    """The call's inputs placed in the BLS slot, one after another: the frame's part that describes
    them (u16 count, then each tensor's head, byte count and offset) and the bytes they take."""
    placed, end = [], 0
    for tensor in request.inputs():
        name, array = tensor.name(), tensor.as_numpy()
        if type(array) is not np.ndarray:
            array = np.asarray(array)
        dtype = array.dtype
        code = _DTYPE_CODES.get(dtype)  # (native byte order, a type the server has: the common case)
        if code is not None:
            data = array if array.flags.c_contiguous else np.ascontiguousarray(array)
        elif dtype.kind in "OSU":
            code, data = BYTES, utils.serialize_byte_tensor(array)
        else:
            code = _NUMPY_CODES.get(dtype.name)
            if code is None:
                raise TypeError(f"BLS input '{name}' has numpy type {dtype}, which the server has no type for")
            data = np.ascontiguousarray(array.astype(dtype.newbyteorder("="), copy=False))
        placed.append((name, code, array.shape, data, end))
        end += (data.nbytes + ALIGN - 1) // ALIGN * ALIGN
    if end > MAX_BLS_BYTES:
        raise utils.TritonModelException(f"a call to model '{request.model_name()}' carries {end} bytes of inputs; "
                                         f"at most {MAX_BLS_BYTES} go in one call")
    slot = _bls_slot()
    try:
        if end > slot.size or slot.map is None:  # (mapped large enough already: no system call)
            slot.grow(max(end, 1))
    except (OSError, MemoryError) as e:  # e.g. past the model's memory bound
        raise utils.TritonModelException(f"a call to model '{request.model_name()}': {end} bytes of shared "
                                         f"memory for its inputs: {e}") from None
    parts = [_U16.pack(len(placed))]
    for name, code, shape, data, offset in placed:
        nbytes = data.nbytes
        if nbytes:
            if nbytes <= 4096:  # a small copy: through a memoryview, without making arrays
                slot.map[offset:offset + nbytes] = data.data.cast("B") if data.ndim else data.tobytes()
            else:
                np.frombuffer(slot.map, np.uint8, nbytes, offset)[:] = data.reshape(-1).view(np.uint8)
        raw = name.encode("utf-8")
        parts.append(_TENSOR.pack(len(raw), code, len(shape)) + raw + _int64s(len(shape)).pack(*shape) +
                     _PLACE.pack(nbytes, offset))
    return b"".join(parts), end


def _bls_slot():
    slot = _bls_state.get("slot")
    if slot is None:
        slot = _bls_state["slot"] = Shm(BLS_FD)
    return slot


def _bls_call(request, np, utils, decoupled=False):
    name = request.model_name().encode("utf-8")
    rid = str(request.request_id() or "").encode("utf-8")[:1024]
    outs = [str(o).encode("utf-8") for o in request.requested_output_names()]
    if os.getpid() != _bls_state["pid"]:  # a process the model forked shares the sockets, not the calls
        raise utils.TritonModelException("calling other models (BLS) works only in the model's own process")
    with _bls_lock:
        if not _bls_state["open"]:
            raise utils.TritonModelException("calling other models (BLS) works only while execute() runs")
        _bls_state["next"] += 1
        call = _bls_state["next"]
        parameters = request._parameters.encode("utf-8") if request._parameters != "{}" else b""
        _dtype_codes(np)
        tensors, slot_size = _bls_inputs(request, np, utils)
        parts = [b"B", _BLS.pack(call, int(request._model_version), int(request._timeout or 0), 1 if decoupled else 0,
                                 slot_size),
                 struct.pack("<H", len(name)), name, struct.pack("<H", len(rid)), rid,
                 struct.pack("<I", len(parameters)), parameters, struct.pack("<H", len(outs))]
        for o in outs:
            parts += [struct.pack("<H", len(o)), o]
        parts.append(tensors)
        payload = b"".join(parts)
        if len(payload) > MAX_FRAME_BYTES:
            raise utils.TritonModelException(f"a call to model '{request.model_name()}' has a frame of "
                                             f"{len(payload)} bytes; at most {MAX_FRAME_BYTES}")
        try:
            _send(payload)
            reply = _next_frame()
            while reply[:1] == b"K":
                _cancellation(reply)
                reply = _next_frame()
        except BaseException:  # noqa: BLE001 - the frames would be out of step: the server starts a new process
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
        # Read while the lock is held: the next call (another thread's) writes into the BLS slot.
        return _bls_answer(request, reply, call, decoupled, np, utils)


def _bls_answer(request, reply, call, decoupled, np, utils):
    """The answer "b" to call `call`: its response (or exec(decoupled=True)'s iterator), the tensors
    copied out of the BLS slot."""
    if reply[:1] != b"b":
        raise RuntimeError("the server answered a BLS call with an unknown frame")
    view = memoryview(reply)
    got, slot_size, failed, code, length = struct.unpack_from("<IQBBI", view, 1)
    pos = 19
    _bls_slot().ensure(slot_size)  # the bytes the answer's outputs take (the server may have grown it)
    message = bytes(view[pos:pos + length]).decode("utf-8", "replace")
    pos += length
    if got != call:
        raise RuntimeError(f"the server answered BLS call {got} for call {call}")
    if failed:
        error = utils.InferenceResponse(error=utils.TritonError(message, code))
        return utils.ResponseIterator([error]) if decoupled else error
    if not decoupled:
        return _bls_response(request, view, pos, np, utils)[0]
    # exec(decoupled=True): u32 responses, each u8 final, u8 what it holds (0 nothing, 1 tensors, 2 an
    # error: u8 code, u32 length, the message).
    (n,) = struct.unpack_from("<I", view, pos)
    pos += 4
    responses = []
    for _ in range(n):
        final, kind = struct.unpack_from("<BB", view, pos)
        pos += 2
        if kind == 2:
            code, length = struct.unpack_from("<BI", view, pos)
            pos += 5
            message = bytes(view[pos:pos + length]).decode("utf-8", "replace")
            pos += length
            responses.append(utils.InferenceResponse(error=utils.TritonError(message, code)))
        elif kind == 1:
            response, pos = _bls_response(request, view, pos, np, utils)
            responses.append(response)
        else:
            responses.append(utils.InferenceResponse())
    return utils.ResponseIterator(responses)


def _bls_response(request, view, pos, np, utils):
    """The response whose tensors start at `pos` (u16 count, then each tensor), and where it ends."""
    (count,) = _U16.unpack_from(view, pos)
    pos += 2
    tensors = []
    slot = _bls_slot()
    for _ in range(count):
        nlen, dtype, rank = _TENSOR.unpack_from(view, pos)
        pos += 4
        out_name = bytes(view[pos:pos + nlen]).decode("utf-8", "replace")
        pos += nlen
        dims = _int64s(rank).unpack_from(view, pos) if rank else ()
        pos += 8 * rank
        nbytes, offset = _PLACE.unpack_from(view, pos)
        pos += 16
        if offset + nbytes > slot.size:
            raise RuntimeError(f"the server answered output '{out_name}' outside the shared memory")
        # (From the BLS slot: the next call writes there, so every array is a copy.)
        numpy_type = _DTYPES.get(dtype)
        if numpy_type is not None:  # a copy: writable and aligned, as a model expects its arrays
            if nbytes % numpy_type.itemsize:
                raise RuntimeError(f"the server answered output '{out_name}' of {nbytes} bytes, not whole "
                                   f"{numpy_type} items")
            array = np.frombuffer(slot.map, numpy_type, nbytes // numpy_type.itemsize, offset).reshape(dims).copy()
            if tensors is not None:
                tensors.append(utils.Tensor(out_name, array))
            continue
        data = np.frombuffer(slot.map, np.uint8, nbytes, offset) if nbytes else np.empty(0, np.uint8)
        if dtype == BYTES:
            array = utils.deserialize_bytes_tensor(data).reshape(dims)
        elif dtype in _NUMPY_TYPES:
            array = data.view(_NUMPY_TYPES[dtype]).reshape(dims).copy()
        else:
            unsupported = utils.TritonError(
                f"model '{request.model_name()}' answered output '{out_name}' in a type numpy has not (BF16)",
                utils.TritonError.UNSUPPORTED)
            tensors = None
            continue
        if tensors is not None:
            tensors.append(utils.Tensor(out_name, array))
    if tensors is None:
        return utils.InferenceResponse(error=unsupported), pos
    return utils.InferenceResponse(output_tensors=tensors), pos


def _auto_complete(launch, utils):
    """The model's TritonPythonModel.auto_complete_config(config), its answer sent as the frame
    "A" + the configuration's JSON after "R"; then the process waits for the server's "S" and exits.
    Runs nothing else of the model (no initialize)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("model", launch["model_file"])
    module = importlib.util.module_from_spec(spec)
    sys.modules["model"] = module
    spec.loader.exec_module(module)
    triton = getattr(module, "TritonPythonModel", None)
    fn = getattr(triton, "auto_complete_config", None)
    config = utils.ModelConfig(launch["model_config"])
    if callable(fn):  # else model.py only mentions the name: the configuration stays as it is
        config = fn(config)
    if not isinstance(config, utils.ModelConfig):
        raise TypeError("auto_complete_config returned " + type(config).__name__ +
                        ", not the pb_utils.ModelConfig it was given")
    answer = json.dumps(config.as_dict())
    _send(b"R")
    _send(b"A" + answer.encode("utf-8"))
    while _next_frame()[:1] != b"S":
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _main():
    global _runner
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the server's to handle
    sys.dont_write_bytecode = True
    utils_source = _read_frame().decode()
    launch = json.loads(_read_frame())
    threading.Thread(target=_watch_server, daemon=True, name="quern-server-watch").start()
    if os.getppid() != launch["server_pid"]:
        os._exit(0)
    _end_with_this_process()
    sys.argv = [launch["model_file"]]
    # The model's version folder is importable (modules beside model.py); the
    # server's working directory is not.
    sys.path = [p for p in sys.path if p not in ("", ".")]
    sys.path.insert(0, launch["version_dir"])
    try:
        import numpy as np
        utils = types.ModuleType("triton_python_backend_utils")
        utils.__file__ = "<quern: triton_python_backend_utils>"
        exec(compile(utils_source, utils.__file__, "exec"), utils.__dict__)
        sys.modules["triton_python_backend_utils"] = utils
        utils._bls_call = lambda request, decoupled=False: _bls_call(request, np, utils, decoupled)
        _bound_memory(launch.get("max_memory_mb", 0))
        if launch.get("mode") == "auto_complete":
            _auto_complete(launch, utils)  # answers and exits
        runner = _runner = Runner(launch, np, utils)
    except BaseException as e:
        traceback.print_exc()
        sys.stderr.flush()
        _send(b"F" + _last_line(e).encode("utf-8", "replace"))
        os._exit(1)
    _send(b"R")
    _start_metric_flusher(utils)
    while True:
        frame = _next_frame()
        op = frame[:1]
        if op == b"E":
            try:
                reply = runner.execute(frame)
            except BaseException as e:  # noqa: BLE001 - the batch fails, the process goes on
                if isinstance(e, SystemExit):
                    raise
                traceback.print_exc()
                sys.stderr.flush()
                reply = b"X" + bytes([_error_code(e, runner.utils) & 0xFF]) + _last_line(e).encode("utf-8", "replace")
            _send_metrics(runner.utils)  # the model's metrics, just before the answer
            _send(reply)
        elif op == b"K":
            _cancellation(frame)
        elif op == b"Z":
            runner.forget(_U32.unpack_from(frame, 1)[0])
        elif op == b"S":
            try:
                runner.finalize()
            except BaseException:
                traceback.print_exc()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)


_main()
