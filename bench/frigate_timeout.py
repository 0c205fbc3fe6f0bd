"""Frigate's DeepStack detector against the default detector: one camera's frames, 320x320 (Frigate's
default detector input), JPEG-encoded with Pillow and POSTed to /v1/vision/detection by `requests`
with Frigate's default `api_timeout: 0.1`, as frigate/detectors/plugins/deepstack.py does, one at a
time at the camera's rate. The detector as shipped (backend "auto") and pinned to ONNX Runtime
(backend "onnxruntime") are served in turn, ROUNDS times each; prints per run the frames answered in
time, the timeouts and the latency percentiles (ms).
    build/venv/bin/python bench/frigate_timeout.py [--frames 100] [--fps 5] [--rounds 2]
"""
import argparse
import io
import os
import re
import shutil
import sys
import tempfile
import time

import numpy as np
import requests
from PIL import Image

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "python"))
from quern_testing import start_quern, stop_quern  # noqa: E402

PHOTOS = os.path.join(ROOT, "third_party", "real-models", "photos")


def frames(n):
    """n 320x320 frames: the photographs' centres, resized as Frigate hands a region to its detector."""
    photos = sorted(f for f in os.listdir(PHOTOS) if f.endswith((".jpg", ".png")))
    out = []
    for i in range(n):
        im = Image.open(os.path.join(PHOTOS, photos[i % len(photos)])).convert("RGB")
        side = min(im.size)
        left, top = (im.size[0] - side) // 2, (im.size[1] - side) // 2
        region = im.crop((left, top, left + side, top + side)).resize((320, 320))
        buf = io.BytesIO()
        region.save(buf, format="JPEG")
        out.append(buf.getvalue())
    return out


def run(binary, backend, jpegs, fps):
    repo = tempfile.mkdtemp()
    shutil.copytree(os.path.join(ROOT, "examples", "models", "objects"), os.path.join(repo, "objects"))
    config = os.path.join(repo, "objects", "config.pbtxt")
    text = open(config).read()
    open(config, "w").write(re.sub(r'(?m)^backend\s*:.*$', f'backend: "{backend}"', text))
    log = []
    proc, ports = start_quern(binary, repo, "--runtime-cache", os.path.join(repo, "cache"), log=log,
                              start_timeout=300)
    chosen = next((m.group(1) for m in (re.search(r"runtime chosen by measurement \([^)]*\): ([^:;]+):", l)
                                        for l in log) if m), backend)
    url = f"http://127.0.0.1:{ports['HTTP']}/v1/vision/detection"
    session = requests.Session()
    ms, timeouts = [], 0
    try:
        for jpeg in jpegs[:3]:  # warm-up, as a camera's first frames
            session.post(url, data={"api_key": ""}, files={"image": jpeg}, timeout=5)
        start = time.monotonic()
        for i, jpeg in enumerate(jpegs):
            time.sleep(max(0.0, start + i / fps - time.monotonic()))
            t0 = time.monotonic()
            try:
                r = session.post(url, data={"api_key": ""}, files={"image": jpeg}, timeout=0.1)
                r.raise_for_status()
                assert r.json()["success"] is True, r.text
                ms.append((time.monotonic() - t0) * 1000)
            except requests.exceptions.Timeout:
                timeouts += 1
    finally:
        stop_quern(proc)
        shutil.rmtree(repo, ignore_errors=True)
    p = np.percentile(ms, [50, 90, 99]) if ms else [float("nan")] * 3
    print(f"{backend:12s} ({chosen}): {len(ms)} of {len(jpegs)} frames in time, {timeouts} timeouts, "
          f"p50 {p[0]:.1f} ms, p90 {p[1]:.1f} ms, p99 {p[2]:.1f} ms, max {max(ms, default=float('nan')):.1f} ms",
          flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--binary", default=os.path.join(ROOT, "build", "release", "src", "cli", "quern"))
    ap.add_argument("--frames", type=int, default=100)
    ap.add_argument("--fps", type=float, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    jpegs = frames(a.frames)
    for _ in range(a.rounds):
        for backend in ("auto", "onnxruntime"):
            run(a.binary, backend, jpegs, a.fps)


if __name__ == "__main__":
    main()
