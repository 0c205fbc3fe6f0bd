"""The classifier through the runtime backend "auto" chooses, against the same file on ONNX Runtime
FP32: top-1 agreement of POST /predict/{model} over views of the photographs, and images/s.

One server serves examples/models/imagenet twice: pinned to ONNX Runtime (`imagenet`, the reference)
and as backend "auto" chooses (`imagenet_auto`; the server's log line says which runtime and why).
Each photograph of third_party/real-models/photos (scripts/setup.sh) is sent whole and as nine other
views (four corner crops and a centre crop of 70 %, the mirror image, half size, a quarter turn each
way), JPEG quality 90. Prints the agreement of the top-1 class, the largest and mean change of the
reference class's confidence, and with --seconds the images/s of each model at 1 and 4 connections.

    build/venv/bin/python bench/classifier_agreement.py [--seconds 5] [--no-bf16]
"""
import argparse
import base64
import http.client
import io
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time

from PIL import Image

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(ROOT, "tests", "python"))
from quern_testing import start_quern, stop_quern  # noqa: E402

PHOTOS = os.path.join(ROOT, "third_party", "real-models", "photos")


def views(path):
    """The photograph and nine views of it, as JPEG bytes."""
    im = Image.open(path).convert("RGB")
    w, h = im.size
    cw, ch = int(w * 0.7), int(h * 0.7)
    out = [im,
           im.crop((0, 0, cw, ch)), im.crop((w - cw, 0, w, ch)), im.crop((0, h - ch, cw, h)),
           im.crop((w - cw, h - ch, w, h)), im.crop(((w - cw) // 2, (h - ch) // 2, (w + cw) // 2, (h + ch) // 2)),
           im.transpose(Image.Transpose.FLIP_LEFT_RIGHT), im.resize((max(1, w // 2), max(1, h // 2))),
           im.transpose(Image.Transpose.ROTATE_90), im.transpose(Image.Transpose.ROTATE_270)]
    encoded = []
    for v in out:
        b = io.BytesIO()
        v.save(b, "JPEG", quality=90)
        encoded.append(b.getvalue())
    return encoded


def predict(conn, model, jpeg):
    body = json.dumps({"image": base64.b64encode(jpeg).decode()})
    conn.request("POST", f"/predict/{model}", body, {"Content-Type": "application/json"})
    r = conn.getresponse()
    data = r.read()
    if r.status != 200:
        raise SystemExit(f"/predict/{model}: {r.status} {data[:300]!r}")
    return json.loads(data)["predictions"]


def rate(port, model, jpeg, connections, seconds):
    done, stop = [0], time.perf_counter() + seconds
    lock = threading.Lock()

    def client():
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        while time.perf_counter() < stop:
            predict(c, model, jpeg)
            with lock:
                done[0] += 1

    threads = [threading.Thread(target=client) for _ in range(connections)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return done[0] / (time.perf_counter() - t0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quern", default=os.path.join(ROOT, "build", "ci", "src", "cli", "quern"))
    ap.add_argument("--seconds", type=float, default=0, help="also measure images/s, this long per run")
    ap.add_argument("--no-bf16", action="store_true", help="QUERN_NO_BF16=1: as a CPU without bf16")
    args = ap.parse_args()
    work = tempfile.mkdtemp()
    try:
        repo = os.path.join(work, "repo")
        src = os.path.join(ROOT, "examples", "models", "imagenet")
        for name, backend in (("imagenet", "onnxruntime"), ("imagenet_auto", "auto")):
            shutil.copytree(src, os.path.join(repo, name))
            cfg = os.path.join(repo, name, "config.pbtxt")
            text = re.sub(r'(?m)^\s*(backend|platform|name)\s*:.*$', "", open(cfg).read())
            open(cfg, "w").write(f'name: "{name}"\nbackend: "{backend}"\n' + text)
        env = dict(os.environ)
        if args.no_bf16:
            env["QUERN_NO_BF16"] = "1"
        log = []
        proc, ports = start_quern(args.quern, repo, log=log, env=env, start_timeout=300)
        try:
            print("".join(line for line in log if "runtime chosen by measurement" in line).strip())
            conn = http.client.HTTPConnection("127.0.0.1", ports["HTTP"], timeout=120)
            same, total, changes = 0, 0, []
            for photo in sorted(os.listdir(PHOTOS)):
                for jpeg in views(os.path.join(PHOTOS, photo)):
                    ref = predict(conn, "imagenet", jpeg)
                    got = predict(conn, "imagenet_auto", jpeg)
                    total += 1
                    same += ref[0]["class_id"] == got[0]["class_id"]
                    theirs = {p["class_id"]: p["confidence"] for p in got}
                    changes.append(abs(ref[0]["confidence"] - theirs.get(ref[0]["class_id"], 0.0)))
            print(f"top-1 agreement with ONNX Runtime FP32: {same} of {total} views ({100 * same / total:.1f} %) "
                  f"of {len(os.listdir(PHOTOS))} photographs; the reference class's confidence moved by "
                  f"{statistics.mean(changes):.4f} on average, {max(changes):.4f} at most")
            if args.seconds:
                jpeg = views(os.path.join(PHOTOS, "dog.jpg"))[0]
                for connections in (1, 4):
                    for model in ("imagenet", "imagenet_auto"):
                        print(f"{model}: {rate(ports['HTTP'], model, jpeg, connections, args.seconds):.1f} images/s "
                              f"at {connections} connection(s)")
        finally:
            stop_quern(proc)
    finally:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
