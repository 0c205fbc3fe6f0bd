#!/usr/bin/env python3
"""Resident memory of `quern serve` holding one model, per instance layout.

For each layout (the automatic one, and `instance_group [{count: N}]` for each N given) the
model is copied into a fresh repository, the server is started, and its resident memory (VmRSS)
is read after loading and again after 12 requests sent 4 at a time and 3 one at a time (so
every instance, the wide one included, has run). Prints one line per layout.

    build/venv/bin/python bench/memory_bench.py bench/models/resnet50 [--counts 1 2 4]
"""
import argparse
import concurrent.futures
import json
import os
import shutil
import socket
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


def rss_mb(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def measure(binary, model_dir, count):
    repo = tempfile.mkdtemp(prefix="quern-memory-")
    try:
        os.makedirs(os.path.join(repo, "m", "1"))
        shutil.copy(os.path.join(model_dir, "1", "model.onnx"), os.path.join(repo, "m", "1", "model.onnx"))
        if count:
            with open(os.path.join(repo, "m", "config.pbtxt"), "w") as f:
                f.write(f"max_batch_size: 8\ndynamic_batching {{ }}\ninstance_group [ {{ count: {count} }} ]\n")
        port = free_port()
        proc = subprocess.Popen([binary, "serve", "--model-repository", repo, "--host", "127.0.0.1", "--http-port",
                                 str(port), "--grpc-port", "-1", "--metrics-port", "0"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            base = f"http://127.0.0.1:{port}"
            deadline = time.time() + 120
            while True:
                try:
                    urllib.request.urlopen(base + "/v2/health/ready", timeout=5)
                    break
                except Exception:
                    if time.time() > deadline or proc.poll() is not None:
                        raise SystemExit("the server did not become ready")
                    time.sleep(0.1)
            loaded = rss_mb(proc.pid)
            meta = json.load(urllib.request.urlopen(base + "/v2/models/m"))
            inp = meta["inputs"][0]
            shape = [1] + [max(d, 1) for d in inp["shape"][1:]]
            n = 1
            for d in shape:
                n *= d
            body = json.dumps({"inputs": [{"name": inp["name"], "shape": shape, "datatype": inp["datatype"],
                                           "data": [0.5] * n}]}).encode()

            def infer(_):
                req = urllib.request.Request(base + "/v2/models/m/infer", body,
                                             {"Content-Type": "application/json"})
                return urllib.request.urlopen(req, timeout=120).status

            with concurrent.futures.ThreadPoolExecutor(4) as ex:
                statuses = list(ex.map(infer, range(12)))
            statuses += [infer(0) for _ in range(3)]
            if any(s != 200 for s in statuses):
                raise SystemExit(f"requests failed: {statuses}")
            return loaded, rss_mb(proc.pid)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    finally:
        shutil.rmtree(repo, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a model folder holding 1/model.onnx")
    ap.add_argument("--counts", type=int, nargs="*", default=[1, 2, 4], help="instance_group counts to measure")
    ap.add_argument("--quern", default=os.path.join(ROOT, "build", "ci", "src", "cli", "quern"))
    a = ap.parse_args()
    print(f"{a.model}: resident memory (VmRSS) of quern serve, MB")
    print(f"{'layout':<24} {'after load':>10} {'after requests':>15}")
    for count in [0] + a.counts:
        loaded, after = measure(a.quern, a.model, count)
        label = "automatic (cores + wide)" if count == 0 else f"count {count}"
        print(f"{label:<24} {loaded:>10.0f} {after:>15.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
