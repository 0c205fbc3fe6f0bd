"""Two `quern serve` binaries served in turn (base, new, base, new, ...) with the same CodeProject.AI
detection load: 640x480 JPEGs to /v1/vision/detection from `--connections` keep-alive clients.
Prints per run: images/s, the server's CPU per image (user + system, /proc, the measured window
only) and the answers that were not a success.
    build/venv/bin/python bench/vision_ab.py BASE_BINARY NEW_BINARY [--rounds 4] [--images 300]
        [--connections 4] [--model bench/models/detect_640]
"""
import argparse
import http.client
import io
import json
import os
import shutil
import sys
import tempfile
import threading
import time

import numpy as np
from PIL import Image

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "python"))
from quern_testing import cpu_seconds, start_quern  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("base")
    ap.add_argument("new")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--images", type=int, default=300)
    ap.add_argument("--connections", type=int, default=4)
    ap.add_argument("--model", default=os.path.join(ROOT, "bench", "models", "detect_640"))
    a = ap.parse_args()
    repo = tempfile.mkdtemp()
    name = os.path.basename(a.model.rstrip("/"))
    shutil.copytree(a.model, os.path.join(repo, name))
    pixels = (np.random.default_rng(1).random((480, 640, 3)) * 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "JPEG", quality=90)
    body = (b"--xx\r\nContent-Disposition: form-data; name=\"image\"; filename=\"a.jpg\"\r\n\r\n" + buf.getvalue() +
            b"\r\n--xx--\r\n")
    headers = {"Content-Type": "multipart/form-data; boundary=xx"}

    def run(binary):
        proc, ports = start_quern(binary, repo, "--detection-model", name)
        failed = []

        def client(n):
            c = http.client.HTTPConnection("127.0.0.1", ports["HTTP"], timeout=60)
            for _ in range(n):
                c.request("POST", "/v1/vision/detection", body=body, headers=headers)
                doc = json.loads(c.getresponse().read())
                if not doc["success"]:
                    failed.append(doc["error"])
            c.close()

        client(20)  # warm-up
        failed.clear()
        c0, t0 = cpu_seconds(proc.pid), time.time()
        threads = [threading.Thread(target=client, args=(a.images // a.connections,)) for _ in range(a.connections)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        c1, t1 = cpu_seconds(proc.pid), time.time()
        proc.terminate()
        proc.wait()
        n = a.images // a.connections * a.connections
        return n / (t1 - t0), (c1 - c0) / n * 1e3, len(failed)

    for r in range(a.rounds):
        for side, binary in (("base", a.base), ("new", a.new)):
            ips, ms, bad = run(binary)
            print(f"round {r + 1} {side:4s} {ips:6.1f} images/s  server CPU {ms:.1f} ms/image  failed {bad}",
                  flush=True)
    shutil.rmtree(repo)


if __name__ == "__main__":
    main()
