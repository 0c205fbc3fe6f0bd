"""Detector quality on the labelled photographs (tests/data/labels/detection.json): precision and
recall at IoU 0.5 and the false positives at confidence >= 0.5, for each detection model named,
through a running server's /v1/vision/custom/{model}.

    build/ci/src/cli/quern serve --model-repository examples/models --vision-port 32168 &
    build/venv/bin/python bench/detector_quality.py --port 32168 objects objects_fast [--rate 20]

With --rate SECONDS it also measures images/s through /v1/vision/custom/{model} for a 640x480 JPEG
(darknet's dog.jpg scaled, quality 90) with 1 and 4 connections (keep-alive, each sending its next
image when its answer arrives), each model for that long.
"""
import argparse
import http.client
import io
import json
import os
import sys
import threading
import time
import urllib.request
import uuid

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "python"))
from detection_labels import LABELS, PHOTOS, score  # noqa: E402


def detect(port, model, path, min_confidence):
    boundary = uuid.uuid4().hex
    with open(path, "rb") as f:
        data = f.read()
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"min_confidence\"\r\n\r\n{min_confidence}\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"image\"; filename=\"{os.path.basename(path)}\"\r\n"
            "Content-Type: application/octet-stream\r\n\r\n").encode() + data + f"\r\n--{boundary}--\r\n".encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/vision/custom/{model}", body,
                                 {"Content-Type": f"multipart/form-data; boundary={boundary}"})
    answer = json.load(urllib.request.urlopen(req, timeout=120))
    return [(p["label"], p["confidence"], [p["x_min"], p["y_min"], p["x_max"], p["y_max"]])
            for p in answer["predictions"]]


def form_body(image):
    boundary = uuid.uuid4().hex
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"image\"; filename=\"frame.jpg\"\r\n"
            "Content-Type: image/jpeg\r\n\r\n").encode() + image + f"\r\n--{boundary}--\r\n".encode()
    return body, f"multipart/form-data; boundary={boundary}"


def rate(port, model, image, connections, seconds):
    """Images answered per second, and the median latency in ms."""
    body, ctype = form_body(image)
    done, lat, stop = [0], [], time.perf_counter() + seconds
    lock = threading.Lock()

    def client():
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        while time.perf_counter() < stop:
            t = time.perf_counter()
            c.request("POST", f"/v1/vision/custom/{model}", body, {"Content-Type": ctype})
            r = c.getresponse()
            ok = r.status == 200 and json.loads(r.read()).get("success")
            with lock:
                if ok:
                    done[0] += 1
                    lat.append(time.perf_counter() - t)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(connections)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lat.sort()
    return done[0] / (time.perf_counter() - t0), (lat[len(lat) // 2] * 1e3 if lat else 0)


def frame_640x480():
    from PIL import Image
    out = io.BytesIO()
    Image.open(os.path.join(PHOTOS, "dog.jpg")).convert("RGB").resize((640, 480)).save(out, "JPEG", quality=90)
    return out.getvalue()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, default=32168)
    ap.add_argument("--rate", type=float, default=0, help="seconds per model and connection count")
    ap.add_argument("models", nargs="+")
    args = ap.parse_args()
    print(f"{len(LABELS)} photos, {sum(len(p['objects']) for p in LABELS.values())} labelled objects")
    print(f"{'model':<14} {'threshold':>9} {'precision':>9} {'recall':>7} {'false positives':>16}")
    for model in args.models:
        found = {photo: detect(args.port, model, os.path.join(PHOTOS, photo), 0.25) for photo in LABELS}
        for threshold in (0.25, 0.5):
            r = score(found, threshold)
            print(f"{model:<14} {threshold:>9} {r['precision']:>9.2f} {r['recall']:>7.2f} {r['fp']:>16}")
            if threshold == 0.5:
                print(f"    false at >= 0.5: {r['false']}\n    missed at 0.5: {r['missed']}")
    if args.rate > 0:
        frame = frame_640x480()
        print(f"{'model':<14} {'connections':>11} {'images/s':>9} {'p50 ms':>7}")
        for model in args.models:
            rate(args.port, model, frame, 1, 2)  # warm up
            for n in (1, 4):
                r, p50 = rate(args.port, model, frame, n, args.rate)
                print(f"{model:<14} {n:>11} {r:>9.1f} {p50:>7.1f}")


if __name__ == "__main__":
    main()
