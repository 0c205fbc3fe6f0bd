"""FP32 models against their INT8 twins through the vision routes, side by side in one run: for each pair
(MODEL, MODEL_int8 of examples/models), one `quern serve` per model in turn (FP32, INT8, FP32, INT8,
...), each loaded by keep-alive connections that send their next image when answered. Detectors go
through /v1/vision/detection (the server started with --detection-model, a multipart form),
classifiers through /predict/{model} (JSON, the image in base64). Prints per run the images/s, the median latency and the server's CPU per
image (/proc, the measured window only), then the medians and the INT8/FP32 ratio of images/s.

    build/venv/bin/python bench/int8_bench.py [--pairs objects imagenet] [--connections 1 16]
        [--seconds 15] [--rounds 2] [--quern build/ci/src/cli/quern]

The image: darknet's dog.jpg scaled to 640x480, JPEG quality 90 (third_party/real-models/photos).
"""
import argparse
import base64
import http.client
import io
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

from PIL import Image

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "python"))
from quern_testing import cpu_seconds, start_quern  # noqa: E402


def frame():
    out = io.BytesIO()
    photo = os.path.join(ROOT, "third_party", "real-models", "photos", "dog.jpg")
    Image.open(photo).convert("RGB").resize((640, 480)).save(out, "JPEG", quality=90)
    return out.getvalue()


def load(port, path, body, headers, connections, seconds):
    """(images answered, images/s, median ms, failures) of `connections` closed-loop clients for `seconds`."""
    lat, failed, lock = [], [], threading.Lock()
    stop = time.perf_counter() + seconds

    def client():
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        while time.perf_counter() < stop:
            t = time.perf_counter()
            c.request("POST", path, body=body, headers=headers)
            r = c.getresponse()
            doc = json.loads(r.read())
            took = time.perf_counter() - t
            with lock:
                if r.status == 200 and doc.get("success", True) and doc.get("predictions"):
                    lat.append(took)
                else:
                    failed.append(doc.get("error", r.status))
        c.close()

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(connections)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return len(lat), len(lat) / (time.perf_counter() - t0), statistics.median(lat) * 1e3 if lat else 0, failed


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", nargs="+", default=["objects", "imagenet"], help="FP32 models with an _int8 twin")
    ap.add_argument("--connections", nargs="+", type=int, default=[1, 16])
    ap.add_argument("--seconds", type=float, default=15)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--quern", default=os.path.join(ROOT, "build", "ci", "src", "cli", "quern"))
    ap.add_argument("--models", default=os.path.join(ROOT, "examples", "models"))
    a = ap.parse_args()
    image = frame()
    form = (b"--xx\r\nContent-Disposition: form-data; name=\"image\"; filename=\"frame.jpg\"\r\n"
            b"Content-Type: image/jpeg\r\n\r\n" + image + b"\r\n--xx--\r\n")
    form_headers = {"Content-Type": "multipart/form-data; boundary=xx"}
    as_json = json.dumps({"image": base64.b64encode(image).decode()}).encode()
    results = {}
    for pair in a.pairs:
        detector = '"detection"' in open(os.path.join(a.models, pair, "config.pbtxt")).read()
        for r in range(a.rounds):
            for model in (pair, pair + "_int8"):
                repo = tempfile.mkdtemp()
                shutil.copytree(os.path.join(a.models, model), os.path.join(repo, model))
                flags = ["--detection-model", model] if detector else []
                path = "/v1/vision/detection" if detector else f"/predict/{model}"
                body, headers = (form, form_headers) if detector else (as_json, {"Content-Type": "application/json"})
                proc, ports = start_quern(a.quern, repo, *flags)
                try:
                    load(ports["HTTP"], path, body, headers, 2, 2)  # warm-up
                    for n in a.connections:
                        c0 = cpu_seconds(proc.pid)
                        count, ips, p50, failed = load(ports["HTTP"], path, body, headers, n, a.seconds)
                        cpu_ms = (cpu_seconds(proc.pid) - c0) / max(1, count) * 1e3
                        results.setdefault((pair, model, n), []).append(ips)
                        print(f"round {r + 1} {model:<14} {n:>3} connections {ips:7.1f} images/s  p50 {p50:7.1f} ms  "
                              f"server CPU {cpu_ms:6.1f} ms/image  failed {len(failed)}"
                              + (f" ({failed[0]})" if failed else ""), flush=True)
                finally:
                    proc.terminate()
                    proc.wait()
                    shutil.rmtree(repo)
    print("\nmedians (images/s) and INT8 / FP32:")
    for pair in a.pairs:
        for n in a.connections:
            fp32 = statistics.median(results[(pair, pair, n)])
            int8 = statistics.median(results[(pair, pair + "_int8", n)])
            print(f"{pair:<10} {n:>3} connections  FP32 {fp32:7.1f}  INT8 {int8:7.1f}  {int8 / fp32:5.2f}x")


if __name__ == "__main__":
    main()
