"""OCR character accuracy (spaces included) on the page set of tests/python/ocr_pages.py: Quern's
`ocr` ensemble (over HTTP) against RapidOCR (the same PP-OCR models in-process) on the same pages.

    build/ci/src/cli/quern serve --model-repository examples/models --http-port 8000 &
    build/venv/bin/python bench/ocr_accuracy.py --port 8000 [--show]
"""
import argparse
import os
import sys

import numpy as np
import tritonclient.http as httpclient

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "python"))
from ocr_pages import accuracy, pages  # noqa: E402


def quern_read(client, png):
    inp = httpclient.InferInput("image", [1], "BYTES")
    inp.set_data_from_numpy(np.array([png], dtype=object), binary_data=True)
    return [t.decode() for t in client.infer("ocr", [inp]).as_numpy("text")]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--show", action="store_true", help="print each reading")
    args = ap.parse_args()
    from rapidocr_onnxruntime import RapidOCR
    rapid = RapidOCR()
    client = httpclient.InferenceServerClient(f"127.0.0.1:{args.port}")
    print(f"{'page':<28} {'quern':>7} {'rapidocr':>9} {'quern lines':>12} {'truth lines':>12}")
    ours_all, theirs_all = [], []
    for name, (png, truth) in pages().items():
        ours = quern_read(client, png)
        theirs = [r[1] for r in (rapid(png)[0] or [])]
        qa, ra = accuracy(ours, truth), accuracy(theirs, truth)
        ours_all.append(qa)
        theirs_all.append(ra)
        print(f"{name:<28} {qa:>7.3f} {ra:>9.3f} {len(ours):>12} {len(truth):>12}")
        if args.show:
            print(f"    quern:    {ours}\n    rapidocr: {theirs}")
    print(f"{'mean':<28} {np.mean(ours_all):>7.3f} {np.mean(theirs_all):>9.3f}")


if __name__ == "__main__":
    main()
