"""Admission under mixed load: slow detections keep a server busy while bursts of cheap
classifications arrive; how many of each are refused (503) and how long the answered ones took.

    build/ci/src/cli/quern serve --model-repository examples/models --http-port 8125 &
    build/venv/bin/python bench/admission_mix.py --port 8125 --seconds 20 --burst 50

4 connections send detections (`objects`, a 640x480 JPEG) back to back for the whole run; every 2 s
a burst of --burst classifications (`/predict/imagenet`, the same photograph) is sent at once, one
connection each.
"""
import argparse
import base64
import http.client
import json
import os
import sys
import threading
import time
import uuid

sys.path.insert(0, os.path.dirname(__file__))
from detector_quality import frame_640x480 as frame  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--seconds", type=float, default=20)
    ap.add_argument("--burst", type=int, default=50)
    args = ap.parse_args()
    jpeg = frame()
    boundary = uuid.uuid4().hex
    det_body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"image\"; filename=\"f.jpg\"\r\n"
                "Content-Type: image/jpeg\r\n\r\n").encode() + jpeg + f"\r\n--{boundary}--\r\n".encode()
    cls_body = json.dumps({"image": base64.b64encode(jpeg).decode()})
    stop = time.perf_counter() + args.seconds
    lock = threading.Lock()
    stats = {"detect": [0, 0, []], "classify": [0, 0, []]}  # answered, refused, latencies

    def send(kind, conn, path, body, ctype):
        t = time.perf_counter()
        conn.request("POST", path, body, {"Content-Type": ctype})
        r = conn.getresponse()
        r.read()
        with lock:
            s = stats[kind]
            if r.status == 200:
                s[0] += 1
                s[2].append(time.perf_counter() - t)
            elif r.status == 503:
                s[1] += 1
            else:
                print(kind, r.status, file=sys.stderr)

    def detector():
        c = http.client.HTTPConnection("127.0.0.1", args.port, timeout=120)
        while time.perf_counter() < stop:
            send("detect", c, "/v1/vision/custom/objects", det_body, f"multipart/form-data; boundary={boundary}")

    def classify():
        c = http.client.HTTPConnection("127.0.0.1", args.port, timeout=120)
        send("classify", c, "/predict/imagenet", cls_body, "application/json")

    threads = [threading.Thread(target=detector) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(2)
    bursts = 0
    while time.perf_counter() < stop - 2:
        burst = [threading.Thread(target=classify) for _ in range(args.burst)]
        for t in burst:
            t.start()
        for t in burst:
            t.join()
        bursts += 1
        time.sleep(2)
    for t in threads:
        t.join()
    print(f"{bursts} bursts of {args.burst} classifications beside 4 connections of detections")
    for kind, (ok, refused, lat) in stats.items():
        lat.sort()
        p50 = lat[len(lat) // 2] * 1e3 if lat else 0
        p99 = lat[min(len(lat) - 1, len(lat) * 99 // 100)] * 1e3 if lat else 0
        print(f"{kind:<9} answered {ok:>5}  refused {refused:>4}  p50 {p50:7.1f} ms  p99 {p99:7.1f} ms")


if __name__ == "__main__":
    main()
