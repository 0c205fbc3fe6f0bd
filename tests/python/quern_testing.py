"""Shared inputs for the black-box tests: one 1x2 array per datatype of the `dtypes` test model (an
Identity per input), with the KServe datatype name of each."""
import collections
import functools
import os
import tempfile

import numpy as np

DTYPE_ARRAYS = {
    "in_bool": np.array([[True, False]]),
    "in_uint8": np.array([[1, 255]], np.uint8),
    "in_int8": np.array([[-1, 7]], np.int8),
    "in_int32": np.array([[-70000, 5]], np.int32),
    "in_int64": np.array([[1 << 40, -2]], np.int64),
    "in_fp16": np.array([[1.5, -2.0]], np.float16),
    "in_fp32": np.array([[1.25, 2.5]], np.float32),
    "in_fp64": np.array([[1e300, -0.125]], np.float64),
    "in_string": np.array([[b"quern", b"mill\x00stone"]], np.object_),
}
DTYPE_NAMES = {"in_bool": "BOOL", "in_uint8": "UINT8", "in_int8": "INT8", "in_int32": "INT32", "in_int64": "INT64",
               "in_fp16": "FP16", "in_fp32": "FP32", "in_fp64": "FP64", "in_string": "BYTES"}


def iou(a, b):
    """Intersection over union of two boxes (x_min, y_min, x_max, y_max)."""
    iw = min(a[2], b[2]) - max(a[0], b[0])
    ih = min(a[3], b[3]) - max(a[1], b[1])
    if iw <= 0 or ih <= 0:
        return 0.0
    inter = iw * ih
    return inter / ((a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter)


def _bilinear_axis(out_size, offset, scale, size):
    """Sampling positions along one axis: pixel centres at half-integers, edges clamped, the weight
    of the second source pixel in 256ths."""
    s = (np.arange(out_size) + 0.5 - offset) / scale
    valid = (s >= 0) & (s < size)
    d = np.clip(s - 0.5, 0, size - 1)
    i0 = np.floor(d).astype(np.int64)
    i1 = np.minimum(i0 + 1, size - 1)
    w1 = np.floor((d - i0) * 256 + 0.5).astype(np.int64)
    return valid, i0, i1, w1


def resample(rgb, width, height, scale_x, scale_y, offset_x=0.0, offset_y=0.0, pad=114):
    """An independent reference for the server's resize: output pixel o samples the source at
    (o + 0.5 - offset) / scale, bilinear with 8-bit weights, rows blended first (x 256), then columns,
    rounded; outside the image the pad value. (Valid while the image is less than twice the output's
    size, where the server samples bilinearly rather than averaging areas.)"""
    h, w, _ = rgb.shape
    vy, y0, y1, wy = _bilinear_axis(height, offset_y, scale_y, h)
    vx, x0, x1, wx = _bilinear_axis(width, offset_x, scale_x, w)
    px = rgb.astype(np.int64)
    rows = px[y0] * (256 - wy)[:, None, None] + px[y1] * wy[:, None, None]
    out = (rows[:, x0] * (256 - wx)[None, :, None] + rows[:, x1] * wx[None, :, None] + (1 << 15)) >> 16
    out[~vy] = pad
    out[:, ~vx] = pad
    return out.astype(np.uint8)


def decode_yolov8(out, width, height, threshold, labels, scale_x, scale_y, offset_x=0.0, offset_y=0.0,
                  nms_iou=0.45, max_det=100):
    """An independent reference for a YOLOv8-layout detector's answer: `out` is [84, cells] (cx, cy,
    w, h in input pixels and 80 probabilities); the best class per cell at >= threshold, class-wise
    greedy NMS (suppress above nms_iou), best first, boxes mapped back to the photograph's pixels
    (input = photo * scale + offset), clipped and rounded as CodeProject.AI answers them."""
    import numpy as np
    cls = out[4:]
    best = np.argmax(cls, axis=0)
    conf = cls[best, np.arange(out.shape[1])]
    boxes = []
    for i in np.nonzero(conf >= np.float32(threshold))[0]:
        cx, cy, w, h = (float(v) for v in out[:4, i])
        boxes.append((float(conf[i]), int(best[i]), ((cx - w / 2 - offset_x) / scale_x, (cy - h / 2 - offset_y) / scale_y,
                                                     (cx + w / 2 - offset_x) / scale_x, (cy + h / 2 - offset_y) / scale_y)))
    boxes.sort(key=lambda b: -b[0])
    kept = []
    for b in boxes:
        if len(kept) < max_det and all(k[1] != b[1] or iou(k[2], b[2]) <= nms_iou for k in kept):
            kept.append(b)
    clip = (width, height, width, height)
    corners = ("x_min", "y_min", "x_max", "y_max")
    return [{"label": labels[c], "confidence": p,
             **{k: int(np.floor(min(max(box[j], 0.0), clip[j]) + 0.5)) for j, k in enumerate(corners)}}
            for p, c, box in kept]


# The runtime cache the suite's servers share: beside the build's test models.
RUNTIME_CACHE = (os.path.join(os.environ["QUERN_TEST_MODELS"], "..", "runtime-cache") if "QUERN_TEST_MODELS" in os.environ
                 else os.path.join(tempfile.gettempdir(), f"quern-runtime-cache-{os.getuid()}"))


def pin_runtime(model_dir, backend="onnxruntime"):
    """Rewrites a copied model's config.pbtxt to run it on `backend` instead of the runtime measured
    fastest (backend "auto"): for a test whose reference is ONNX Runtime's FP32 arithmetic itself."""
    import pathlib
    import re
    config = pathlib.Path(model_dir) / "config.pbtxt"
    text = re.sub(r'(?m)^\s*(backend|platform)\s*:.*$', "", config.read_text())
    config.write_text(f'backend: "{backend}"\n' + text)


# Every server start_quern started in this process, (when, process): a failing test's report shows the
# last LOG_TAIL_LINES lines of each server started during it or still running (conftest.py).
STARTED = []
LOG_TAIL_LINES = 40


def start_quern(binary, repo, *extra, env=None, cwd=None, log=None, start_timeout=180):
    """Starts `quern serve` on free ports (HTTP, gRPC, metrics) and waits until it serves, with
    `env` as its environment and `cwd` as its working directory when given, allowing it
    `start_timeout` seconds to load its models (a bound for a hang: models of backend "auto" are
    measured at load, OpenVINO compiles included, several times slower under the sanitizers beside
    other tests).
    Returns (process, {"HTTP": port, "gRPC": port, "metrics": port[, "vision": port]}); its log is drained in the background
    (its lines appended to `log` when that is a list)."""
    import re
    import subprocess
    import threading
    import time

    import os

    # QUERN_TEST_ONE_CORE=1: the server may use one CPU (as under taskset or a one-core cpuset),
    # where its HTTP threads run their requests' batches themselves.
    one_core = None
    if os.environ.get("QUERN_TEST_ONE_CORE") == "1":
        one_core = lambda: os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # noqa: E731
    # QUERN_TEST_SERVE_ARGS: more flags for every server a test file starts (a suite run again with
    # another setting, e.g. two I/O threads).
    more = os.environ.get("QUERN_TEST_SERVE_ARGS", "").split()
    # Models of backend "auto" (the examples' detectors and classifier, unconfigured ONNX models) are
    # measured once per build: every server of the suite keeps its choices in one runtime cache, unless
    # the test names its own (--runtime-cache or --data-dir).
    if not any(str(a).startswith(("--runtime-cache", "--data-dir")) for a in [*more, *extra]):
        more += ["--runtime-cache", RUNTIME_CACHE]
    proc = subprocess.Popen([binary, "serve", "--model-repository", repo, "--http-port", "0", "--grpc-port", "0",
                             "--metrics-port", "0", "--host", "127.0.0.1", *more, *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=cwd,
                            preexec_fn=one_core)
    ports = {}
    tail = collections.deque(maxlen=LOG_TAIL_LINES)
    proc.quern_log_tail = tail
    STARTED.append((time.time(), proc))
    keep = log.append if log is not None else (lambda line: None)

    def sink(line):
        tail.append(line)
        keep(line)
    deadline = time.time() + start_timeout
    while time.time() < deadline:
        line = proc.stdout.readline()
        sink(line)
        if not line or line.startswith("quern: serving "):
            break
        m = re.search(r"(HTTP|gRPC|metrics|vision) listening on [^:]+:(\d+)", line)
        if m:
            ports[m.group(1)] = int(m.group(2))
    if len(ports) < 3:
        proc.kill()
        raise AssertionError(f"quern serve did not report its ports (got {ports}); its output:\n" + "".join(tail))
    # Keep reading the log so the server never blocks on a full pipe (into
    # `log`, a list, when given); stop_quern joins this thread.
    proc.quern_log_reader = threading.Thread(target=lambda: [sink(line) for line in proc.stdout], daemon=True)
    proc.quern_log_reader.start()
    return proc, ports


def stop_quern(proc, timeout=30):
    """SIGTERM to a server start_quern started; waits for it to exit and for its last log line to be
    read. Returns its exit code."""
    proc.terminate()
    code = proc.wait(timeout=timeout)
    reader = getattr(proc, "quern_log_reader", None)
    if reader is not None:
        reader.join(timeout=timeout)
    return code


def wait_until(pred, timeout=30, what="condition", every=0.05):
    """pred()'s first true value, polled every `every` seconds; fails after `timeout` seconds, saying
    what it waited for and the last value it saw."""
    import time
    deadline = time.time() + timeout
    v = None
    while time.time() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout} s waiting for {what} (last seen: {v!r})")


def metric_sum(port, name, **labels):
    """The sum of metric `name`'s samples whose labels include `labels`, read from the server's
    metrics port (0 when none)."""
    import re
    data = http_request(port, "GET", "/metrics")[2].decode()
    total = 0.0
    for m in re.finditer(rf"^{re.escape(name)}(?:\{{([^}}]*)\}})? (\S+)$", data, re.M):
        have = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(1) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(m.group(2))
    return total


def pending(port, model):
    """How many of `model`'s requests wait in its queue (quern_pending_requests, metrics port `port`)."""
    return metric_sum(port, "quern_pending_requests", model=model)


def http_request(port, method, path, body=None, headers=None, timeout=30):
    """One request on a new connection to 127.0.0.1:port: (status, headers, body)."""
    import http.client
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    c.request(method, path, body=body, headers=headers or {})
    r = c.getresponse()
    data = r.read()
    c.close()
    return r.status, dict(r.getheaders()), data


def post_form(port, path, files=(), **fields):
    """POSTs a multipart form to 127.0.0.1:port: `files` as (field, bytes) pairs, `fields` as text;
    asserts HTTP 200 and returns the JSON answer."""
    import json
    import uuid
    boundary = uuid.uuid4().hex
    body = b""
    for k, v in fields.items():
        body += f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n'.encode() + str(v).encode() + b"\r\n"
    for k, data in files:
        body += (f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"; filename="{k}.jpg"\r\n\r\n'.encode() +
                 data + b"\r\n")
    body += f"--{boundary}--\r\n".encode()
    status, _, data = http_request(port, "POST", path, body,
                                   {"Content-Type": f"multipart/form-data; boundary={boundary}"}, timeout=60)
    assert status == 200, data
    return json.loads(data)


def cpu_seconds(pid):
    """User + system CPU seconds process `pid` has used (/proc/PID/stat)."""
    import os
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid):
    """Resident memory of process `pid`, MB (/proc/PID/status VmRSS); 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except FileNotFoundError:
        pass
    return 0.0


@functools.lru_cache(maxsize=None)
def sanitized(binary):
    """True when `binary` runs under AddressSanitizer (its quarantine holds freed memory, so resident
    memory says little about leaks there, and its checks take CPU time; LeakSanitizer checks leaks at
    exit): gcc links the runtime as libasan.so, clang into the binary itself."""
    import mmap
    import subprocess
    if "libasan" in subprocess.run(["ldd", binary], capture_output=True, text=True).stdout:
        return True
    with open(binary, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        return m.find(b"__asan_init") >= 0


@functools.lru_cache(maxsize=None)
def cpu_flags():
    """The CPU's feature flags as the kernel lists them (/proc/cpuinfo); empty when unreadable."""
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), []))
    except OSError:
        return frozenset()


def cpu_has_bf16():
    """True when this CPU computes bf16 natively (avx512_bf16 or amx_bf16 among its flags), the CPUs
    where OpenVINO's default precision is bf16 and backend "auto" measures it."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PortTaken(Exception):
    """A server could not bind the port it was given."""


class RedisServer:
    """A real redis-server for one test: its own port and data directory, append-only file on
    (fsync on every write), so a restart keeps what was acknowledged. Extra arguments go to
    redis-server as they are (e.g. "--requirepass", "pw")."""

    def __init__(self, directory, *extra, port=None, tls=False):
        self.dir = str(directory)
        self.port = port or free_port()
        self.extra = list(extra)
        self.tls = tls
        self.proc = None
        # A port found free may be taken by another process (tests run side by side) before
        # redis-server binds it: then another port, when the test let this class choose.
        for attempt in range(3):
            try:
                self.start()
                return
            except PortTaken:
                if port is not None or attempt == 2:
                    raise
                self.port = free_port()

    def start(self):
        import subprocess
        import time
        ports = ["--port", "0", "--tls-port", str(self.port)] if self.tls else ["--port", str(self.port)]
        self.proc = subprocess.Popen(
            ["redis-server", *ports, "--bind", "127.0.0.1", "--dir", self.dir, "--appendonly", "yes",
             "--appendfsync", "always", "--save", "", "--daemonize", "no", *self.extra],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        import socket
        deadline = time.time() + 20
        while time.time() < deadline:
            if self.proc.poll() is not None:
                said = self.proc.stdout.read().decode(errors="replace")
                if "Address already in use" in said:
                    raise PortTaken(self.port)
                raise AssertionError(f"redis-server exited with {self.proc.returncode}: {said[-2000:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    if not self.tls:
                        # Redis itself, not another process on the port: any RESP answer (+PONG,
                        # -NOAUTH with a password set).
                        s.settimeout(5)
                        s.sendall(b"PING\r\n")
                        if s.recv(64)[:1] not in (b"+", b"-"):
                            raise OSError("not redis")
                self._drain_output()
                return
            except OSError:
                time.sleep(0.05)
        raise AssertionError("redis-server did not start")

    def _drain_output(self):
        """Its output read on (and dropped) so that a full pipe never blocks it."""
        import threading
        out = self.proc.stdout

        def drain():
            while out.read(65536):
                pass

        threading.Thread(target=drain, daemon=True).start()

    def client(self, **kwargs):
        import redis
        return redis.Redis(host="127.0.0.1", port=self.port, **kwargs)

    def stop(self, kill=False):
        if self.proc and self.proc.poll() is None:
            self.proc.kill() if kill else self.proc.terminate()
            self.proc.wait(timeout=30)

    def url(self, db=0):
        return f"redis://127.0.0.1:{self.port}/{db}"


def voluntary_switches(pid, tid=None):
    """A thread's voluntary context switches so far (the times it blocked): thread `tid` of process
    `pid`, its main thread by default."""
    with open(f"/proc/{pid}/task/{tid or pid}/status") as f:
        return int(next(line for line in f if line.startswith("voluntary_ctxt_switches:")).split()[1])


def python_model_pids(model, parent=None):
    """The processes running instances of Python model `model` started by process `parent` (this
    one by default), found by the title the server gives them (quern-python:<model>:<instance>)."""
    import os

    parent = parent or os.getpid()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
        except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
            continue
        if ppid == parent and any(a.startswith(f"quern-python:{model}:".encode()) for a in args):
            found.append(int(entry))
    return found


def write_one_step_ensemble(repo, name, step, tensor_in, in_type, tensor_out, out_type, max_batch_size=0,
                            step_out=None):
    """An ensemble `name` in `repo` whose one step is model `step`: input `tensor_in` ([1] of `in_type`,
    e.g. "TYPE_FP32") passed to the step under that name, and output `tensor_out` ([1] of `out_type`),
    the step's output of that name (or of `step_out`)."""
    import textwrap
    (repo / name / "1").mkdir(parents=True, exist_ok=True)
    (repo / name / "config.pbtxt").write_text(textwrap.dedent(f'''
        platform: "ensemble"
        max_batch_size: {max_batch_size}
        input [ {{ name: "{tensor_in}" data_type: {in_type} dims: [ 1 ] }} ]
        output [ {{ name: "{tensor_out}" data_type: {out_type} dims: [ 1 ] }} ]
        ensemble_scheduling {{ step [ {{ model_name: "{step}" model_version: -1
          input_map {{ key: "{tensor_in}" value: "{tensor_in}" }}
          output_map {{ key: "{step_out or tensor_out}" value: "{tensor_out}" }} }} ] }}
        '''))


def write_model(repo, name, config, code, version=1, extra=None):
    """A model folder in `repo` (a pathlib.Path): config.pbtxt (dedented) and <version>/model.py, with
    `extra` files ({name: text}) beside model.py."""
    import textwrap
    d = repo / name / str(version)
    d.mkdir(parents=True, exist_ok=True)
    (repo / name / "config.pbtxt").write_text(textwrap.dedent(config))
    (d / "model.py").write_text(code)
    for fname, text in (extra or {}).items():
        (d / fname).write_text(text)
