"""OCR pages/s: Quern's `ocr` ensemble (over HTTP, tritonclient) against RapidOCR (same PP-OCR models,
in-process, onnxruntime-python) on the same machine and the same images, side by side.

    build/release/src/cli/quern serve --model-repository examples/models --http-port 8000 &
    build/venv/bin/python bench/ocr_bench.py --port 8000 --concurrency 1 4 16 --seconds 10

Two pages, rendered here: a receipt (576 px wide, 30 lines) and a 1920 x 1080 screenshot (menus, a
text column, a table: ~80 words). Each setting first checks that both read the same text, then runs
N concurrent callers for the given time: Quern with N HTTP clients, RapidOCR with N threads calling
one RapidOCR object (its sessions run concurrently; each call holds the GIL only between model runs).
Reports pages/s and p50/p99 latency, and for Quern the time per page in each step model (from the
statistics endpoint: compute per request, summed over the step's requests).
"""
import argparse
import io
import threading
import time

import numpy as np
import tritonclient.http as httpclient
from PIL import Image, ImageDraw, ImageFont
from tritonclient.utils import InferenceServerException

DEJAVU = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf"
MONO = "/usr/share/fonts/truetype/dejavu/DejaVuSansMono.ttf"
STEPS = ("ocr_prepare", "ocr_detector", "ocr_boxes", "ocr_crop", "text_direction", "ocr_lines", "ocr_recognizer",
         "ocr_text")


def receipt():
    img = Image.new("RGB", (576, 1200), "white")
    d = ImageDraw.Draw(img)
    big, small = ImageFont.truetype(DEJAVU, 30), ImageFont.truetype(MONO, 20)
    d.text((170, 20), "QUERN MILL", font=big, fill="black")
    y = 80
    rng = np.random.default_rng(7)
    for i in range(26):
        item = ["Flour", "Rye", "Spelt", "Oats", "Barley", "Bran", "Millet", "Wheat"][i % 8] + f"{i:02d}"
        d.text((30, y), item, font=small, fill="black")
        d.text((420, y), f"{rng.integers(1, 99)}.{rng.integers(0, 99):02d}", font=small, fill="black")
        y += 38
    d.text((30, y + 10), "TOTAL", font=big, fill="black")
    d.text((400, y + 10), "1234.56", font=big, fill="black")
    return encode(img)


def screenshot():
    img = Image.new("RGB", (1920, 1080), (245, 245, 245))
    d = ImageDraw.Draw(img)
    f, h = ImageFont.truetype(DEJAVU, 18), ImageFont.truetype(DEJAVU, 28)
    for i, m in enumerate(["File", "Edit", "View", "Models", "Batching", "Metrics", "Help"]):
        d.text((20 + 130 * i, 10), m, font=f, fill="black")
    d.text((60, 80), "Dashboard", font=h, fill="black")
    for r in range(18):
        d.text((60, 140 + 48 * r), f"Request{r:03d}", font=f, fill="black")
        d.text((360, 140 + 48 * r), f"{(r * 37) % 100}ms", font=f, fill="black")
        d.text((560, 140 + 48 * r), ["ready", "loading", "failed"][r % 3], font=f, fill="black")
    for r in range(16):
        d.text((1100, 140 + 54 * r), f"Column{r}text", font=f, fill=(30, 30, 30))
        d.text((1400, 140 + 54 * r), f"value{r * 7}", font=f, fill=(30, 30, 30))
    return encode(img)


def encode(img):
    out = io.BytesIO()
    img.save(out, "PNG")
    return out.getvalue()


def quern_read(client, png):
    inp = httpclient.InferInput("image", [1], "BYTES")
    inp.set_data_from_numpy(np.array([png], dtype=object), binary_data=True)
    return [t.decode() for t in client.infer("ocr", [inp]).as_numpy("text")]


def run(call_factory, concurrency, seconds):
    """(pages/s, p50 ms, p99 ms, refused): pages answered per second; a refusal (the server's queue
    bound) is counted and the caller tries again 50 ms later."""
    lat, stop = [], threading.Event()
    lock = threading.Lock()
    refused = [0]

    def worker():
        call = call_factory()
        mine = []
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                call()
            except InferenceServerException:
                with lock:
                    refused[0] += 1
                time.sleep(0.05)
                continue
            mine.append(time.perf_counter() - t0)
        with lock:
            lat.extend(mine)

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    lat.sort()
    if not lat:
        return 0.0, 0.0, 0.0, refused[0]
    return len(lat) / wall, lat[len(lat) // 2] * 1e3, lat[min(len(lat) - 1, len(lat) * 99 // 100)] * 1e3, refused[0]


def step_times(client):
    out = {}
    for m in STEPS:
        s = client.get_inference_statistics(m)["model_stats"][0]["inference_stats"]
        out[m] = (int(s["compute_infer"]["ns"]) + int(s["compute_input"]["ns"]) + int(s["compute_output"]["ns"]),
                  int(s["success"]["count"]))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--seconds", type=float, default=10)
    args = ap.parse_args()
    from rapidocr_onnxruntime import RapidOCR
    rapid = RapidOCR()
    url = f"127.0.0.1:{args.port}"
    pages = {"receipt 576x1200": receipt(), "screenshot 1920x1080": screenshot()}
    print(f"{'page':<22} {'N':>3} {'quern pages/s':>14} {'p50 ms':>8} {'p99 ms':>8} {'rapidocr pages/s':>17} "
          f"{'p50 ms':>8} {'p99 ms':>8} {'x':>6}")
    for name, png in pages.items():
        client = httpclient.InferenceServerClient(url)
        ours = quern_read(client, png)
        theirs = [r[1] for r in (rapid(png)[0] or [])]
        if ours != theirs:
            diff = [(i, a, b) for i, (a, b) in enumerate(zip(ours, theirs)) if a != b]
            print(f"{name}: the texts differ ({len(ours)} and {len(theirs)} lines; first differences "
                  f"(line, quern, rapidocr): {diff[:4]})")
        breakdown = []
        for n in args.concurrency:
            before = step_times(client)
            q = run(lambda: (lambda c=httpclient.InferenceServerClient(url, concurrency=1): quern_read(c, png)), n,
                    args.seconds)
            after = step_times(client)
            r = run(lambda: (lambda: rapid(png)), n, args.seconds)
            print(f"{name:<22} {n:>3} {q[0]:>14.2f} {q[1]:>8.1f} {q[2]:>8.1f} {r[0]:>17.2f} {r[1]:>8.1f} {r[2]:>8.1f} "
                  f"{q[0] / r[0]:>6.2f}" + (f"   ({q[3]} refused by quern's queue bound)" if q[3] else ""))
            pages_done = after["ocr_text"][1] - before["ocr_text"][1]
            if n == args.concurrency[0] and pages_done:
                breakdown = [(m, (after[m][0] - before[m][0]) / pages_done / 1e6) for m in STEPS]
        print(f"  {len(ours)} lines; ms per page in each step (N={args.concurrency[0]}): " +
              ", ".join(f"{m} {ms:.1f}" for m, ms in breakdown))


if __name__ == "__main__":
    main()
