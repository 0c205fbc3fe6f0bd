"""Shared inputs for the black-box tests: one 1x2 array per datatype of the `dtypes` test model (an
Identity per input), with the KServe datatype name of each."""
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


def start_quern(binary, repo, *extra):
    """Starts `quern serve` on free ports (HTTP, gRPC, metrics) and waits until it serves.
    Returns (process, {"HTTP": port, "gRPC": port, "metrics": port[, "vision": port]}); its log is drained in the background."""
    import re
    import subprocess
    import threading
    import time

    proc = subprocess.Popen([binary, "serve", "--model-repository", repo, "--http-port", "0", "--grpc-port", "0",
                             "--metrics-port", "0", "--host", "127.0.0.1", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ports = {}
    deadline = time.time() + 60
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line or line.startswith("quern: serving "):
            break
        m = re.search(r"(HTTP|gRPC|metrics|vision) listening on [^:]+:(\d+)", line)
        if m:
            ports[m.group(1)] = int(m.group(2))
    if len(ports) < 3:
        proc.kill()
        raise AssertionError(f"quern serve did not report its ports (got {ports})")
    # Keep reading the log so the server never blocks on a full pipe.
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
    return proc, ports
