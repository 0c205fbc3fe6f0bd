#!/usr/bin/env python3
"""Resident memory of `quern serve` holding one model, per instance layout, and what a burst of
load leaves behind.

For each layout (the automatic one, and `instance_group [{count: N}]` for each N given; the
model's own config.pbtxt when it has one and --keep-config is given, else `max_batch_size: 8`
with dynamic batching) the model is copied into a fresh repository, the server is started, and
its resident memory (VmRSS) is read: after loading; after --steady seconds of requests one at a
time (the steady state at batch 1); after 12 requests sent 4 at a time and 3 one at a time (so every instance, the
wide one included, has run); right after --seconds of --load requests in flight (binary KServe
bodies from quern-perf: large batches); and after --quiet seconds without requests. Prints one line per layout
with the answers per second of the load phase, the peak (VmHWM) by its end, and the median time of a
request in the one-at-a-time phase (a lone request, on a new connection).

--vision JPEG: every request is that photograph posted to the CodeProject.AI detection route
(/v1/vision/detection, multipart; the model must be a detector), the load phase as --load Python
client threads, each sending its next request when its answer arrives.

    build/venv/bin/python bench/memory_bench.py bench/models/resnet50 [--counts 1 2 4]
    build/venv/bin/python bench/memory_bench.py examples/models/objects --counts --load 16
    build/venv/bin/python bench/memory_bench.py examples/models/objects --keep-config --backend openvino
    build/venv/bin/python bench/memory_bench.py examples/models/objects --keep-config --counts --load 16 \
        --vision examples/data/dog.jpg
"""
import argparse
import concurrent.futures
import http.client
import json
import os
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid, field="VmRSS"):
    """VmRSS (resident now) or VmHWM (the most resident so far) of `pid`, in MB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def wait_ready(base, proc):
    deadline = time.time() + 120
    while True:
        try:
            urllib.request.urlopen(base + "/v2/health/ready", timeout=5)
            return
        except Exception:
            if time.time() > deadline or proc.poll() is not None:
                raise SystemExit("the server did not become ready")
            time.sleep(0.1)


def request_body(base):
    """A binary KServe request for one item of the model's first input (0.5 everywhere)."""
    meta = json.load(urllib.request.urlopen(base + "/v2/models/m"))
    inp = meta["inputs"][0]
    shape = [1] + [max(d, 1) for d in inp["shape"][1:]]
    n = 1
    for d in shape:
        n *= d
    if inp["datatype"] != "FP32":
        raise SystemExit(f"memory_bench sends FP32 inputs; the model's first input is {inp['datatype']}")
    header = json.dumps({"inputs": [{"name": inp["name"], "shape": shape, "datatype": "FP32",
                                     "parameters": {"binary_data_size": 4 * n}}]}).encode()
    return header + struct.pack(f"<{n}f", *([0.5] * n)), len(header)


def multipart(jpeg):
    """(body, content type) of a CodeProject.AI request carrying `jpeg` as its image."""
    boundary = "quernmemorybench"
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"image\"; filename=\"frame.jpg\"\r\n"
            f"Content-Type: image/jpeg\r\n\r\n").encode() + jpeg + f"\r\n--{boundary}--\r\n".encode()
    return body, f"multipart/form-data; boundary={boundary}"


def measure(binary, perf, model_dir, count, keep_config, steady, load, seconds, quiet, backend=None, vision=None,
            serve_args=()):
    repo = tempfile.mkdtemp(prefix="quern-memory-")
    try:
        own = os.path.join(model_dir, "config.pbtxt")
        config = "max_batch_size: 8\ndynamic_batching { }\n"
        if keep_config and os.path.exists(own):
            shutil.copytree(model_dir, os.path.join(repo, "m"))  # with its label files
            with open(own) as f:
                config = "".join(line for line in f if not line.startswith("name:"))
        else:
            os.makedirs(os.path.join(repo, "m", "1"))
            shutil.copy(os.path.join(model_dir, "1", "model.onnx"), os.path.join(repo, "m", "1", "model.onnx"))
        if backend:
            config = f'backend: "{backend}"\n' + "".join(
                line + "\n" for line in config.splitlines() if not line.lstrip().startswith(("backend", "platform")))
        if count:
            config += f"instance_group [ {{ count: {count} }} ]\n"
        with open(os.path.join(repo, "m", "config.pbtxt"), "w") as f:
            f.write(config)
        port = free_port()
        proc = subprocess.Popen([binary, "serve", "--model-repository", repo, "--host", "127.0.0.1", "--http-port",
                                 str(port), "--grpc-port", "-1", "--metrics-port", "0", *serve_args],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            base = f"http://127.0.0.1:{port}"
            wait_ready(base, proc)
            row = {"after load": rss_mb(proc.pid)}
            if vision:
                with open(vision, "rb") as f:
                    body, content_type = multipart(f.read())
                path, headers = "/v1/vision/detection", {"Content-Type": content_type}
            else:
                body, header_len = request_body(base)
                path, headers = "/v2/models/m/infer", {"Content-Type": "application/octet-stream",
                                                       "Inference-Header-Content-Length": str(header_len)}

            def infer(conn=None):
                own_conn = conn is None
                conn = conn or http.client.HTTPConnection("127.0.0.1", port, timeout=300)
                conn.request("POST", path, body, headers)
                r = conn.getresponse()
                r.read()
                if own_conn:
                    conn.close()
                if r.status != 200:
                    raise SystemExit(f"a request failed: HTTP {r.status}")

            until = time.time() + steady  # one at a time for longer than a kept block's idle time
            lone = []
            while time.time() < until:
                t = time.monotonic()
                infer()
                lone.append(time.monotonic() - t)
            row["batch 1"] = rss_mb(proc.pid)
            row["lone ms"] = 1000 * statistics.median(lone[1:] or lone)  # the first opens the model's caches
            with concurrent.futures.ThreadPoolExecutor(4) as ex:
                list(ex.map(lambda _: infer(), range(12)))
            for _ in range(3):
                infer()
            row["after requests"] = rss_mb(proc.pid)
            if vision:
                # The load: `load` clients, each on its own connection, one request in flight each.
                end = time.time() + seconds

                def client(_):
                    conn, n = http.client.HTTPConnection("127.0.0.1", port, timeout=300), 0
                    while time.time() < end:
                        infer(conn)
                        n += 1
                    conn.close()
                    return n

                start = time.time()
                with concurrent.futures.ThreadPoolExecutor(load) as ex:
                    answered = sum(ex.map(client, range(load)))
                row["load"] = rss_mb(proc.pid)
                row["peak"] = rss_mb(proc.pid, "VmHWM")
                row["answers/s"] = answered / (time.time() - start)
            else:
                # The load: quern-perf (binary tensors, one connection per request in flight).
                out = subprocess.run([perf, "--url", base, "-m", "m", "-c", str(load), "-s", str(seconds),
                                      "--warmup", "1", "--format", "json"], capture_output=True, text=True,
                                     timeout=600)
                if out.returncode != 0:
                    raise SystemExit(f"quern-perf failed: {out.stderr}")
                row["load"] = rss_mb(proc.pid)
                row["peak"] = rss_mb(proc.pid, "VmHWM")
                level = json.loads(out.stdout)["levels"][0]
                if level["errors"]:
                    raise SystemExit(f"quern-perf: {level['errors']} requests failed: {level['error_kinds']}")
                row["answers/s"] = level["requests_per_s"]
            time.sleep(quiet)
            row["quiet"] = rss_mb(proc.pid)
            return row
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    finally:
        shutil.rmtree(repo, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a model folder holding 1/model.onnx")
    ap.add_argument("--counts", type=int, nargs="*", default=[1, 2, 4], help="instance_group counts to measure")
    ap.add_argument("--keep-config", action="store_true", help="the model's own config.pbtxt (max_batch_size ...)")
    ap.add_argument("--backend", help='the backend to run it ("openvino", "auto"; default: its own, else ONNX Runtime)')
    ap.add_argument("--steady", type=float, default=8, help="seconds of requests one at a time (batch 1)")
    ap.add_argument("--load", type=int, default=16, help="requests in flight in the load phase")
    ap.add_argument("--seconds", type=float, default=10, help="length of the load phase")
    ap.add_argument("--quiet", type=float, default=7, help="seconds without requests before the last reading")
    ap.add_argument("--vision", help="a JPEG: requests go to /v1/vision/detection (see above)")
    ap.add_argument("--serve-arg", action="append", default=[],
                    help="one more argument for quern serve (repeat it: --serve-arg=--memory-budget-mb --serve-arg=200)")
    ap.add_argument("--quern", default=os.path.join(ROOT, "build", "ci", "src", "cli", "quern"))
    ap.add_argument("--perf", default=os.path.join(ROOT, "build", "ci", "src", "cli", "quern-perf"),
                    help="the load generator (quern perf)")
    a = ap.parse_args()
    print(f"{a.model}: resident memory (VmRSS) of quern serve, MB; {a.load} in flight for {a.seconds:g} s, "
          f"then {a.quiet:g} s quiet")
    cols = ["after load", "batch 1", "after requests", "load", "peak", "quiet", "answers/s", "lone ms"]
    print(f"{'layout':<24} " + " ".join(f"{c:>14}" for c in cols))
    for count in [0] + a.counts:
        row = measure(a.quern, a.perf, a.model, count, a.keep_config, a.steady, a.load, a.seconds, a.quiet,
                      a.backend, a.vision, a.serve_arg)
        label = "automatic (cores + wide)" if count == 0 else f"count {count}"
        print(f"{label:<24} " + " ".join(f"{row[c]:>14.1f}" if c in ("answers/s", "lone ms") else f"{row[c]:>14.0f}"
                                         for c in cols), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
