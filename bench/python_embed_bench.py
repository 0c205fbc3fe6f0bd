"""The embedded engine from Python against onnxruntime-python on the same ONNX model, side by side.

    PYTHONPATH=build/release/python build/venv/bin/python bench/python_embed_bench.py \
        --model examples/models/small_cnn --threads 4 8 --seconds 5

N Python threads each send single-item requests back to back, through quern.Engine.infer (the
engine batches them) and through onnxruntime.InferenceSession.run on one shared session (in two
thread settings: ONNX Runtime's default, and one intra-op thread per run; the better counts).
Reports items/s for each and the ratio, and the process's CPU time and context switches per item
over the same window (steadier than items/s on a shared machine). Answers are checked against each
other first. With --rounds N the two are measured in turn N times per thread count and the median
ratio is printed.
"""
import argparse
import glob
import os
import statistics
import sys
import threading
import time

import numpy as np
import onnxruntime as ort

import quern


def context_switches():
    """Voluntary + involuntary context switches of every thread of this process so far."""
    total = 0
    for f in glob.glob("/proc/self/task/*/status"):
        try:
            with open(f) as fh:
                for line in fh:
                    if line.startswith(("voluntary_ctxt_switches:", "nonvoluntary_ctxt_switches:")):
                        total += int(line.split()[-1])
        except OSError:
            pass  # a thread that ended meanwhile
    return total


def measure(run, threads, seconds, make_input):
    """(items/s, CPU µs per item, context switches per item) over `seconds` after a warm-up."""
    counts = [0] * threads
    stop = threading.Event()
    measuring = threading.Event()

    def worker(i):
        x = make_input(i)
        while not stop.is_set():
            run(x)
            if measuring.is_set():
                counts[i] += 1

    ts = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    time.sleep(1.0)  # warm-up
    cpu0, cs0 = os.times(), context_switches()
    measuring.set()
    t0 = time.perf_counter()
    time.sleep(seconds)
    measuring.clear()
    wall = time.perf_counter() - t0
    cpu1, cs1 = os.times(), context_switches()
    stop.set()
    for t in ts:
        t.join()
    items = max(1, sum(counts))
    cpu = (cpu1.user + cpu1.system - cpu0.user - cpu0.system) / items * 1e6
    return sum(counts) / wall, cpu, (cs1 - cs0) / items


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="examples/models/small_cnn", help="a model folder with 1/model.onnx")
    ap.add_argument("--threads", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--seconds", type=float, default=5)
    ap.add_argument("--rounds", type=int, default=1,
                    help="quern and onnxruntime measured in turn this many times per thread count (the median "
                         "ratio is printed: steadier on a shared machine)")
    args = ap.parse_args()
    os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")
    onnx_file = os.path.join(args.model, "1", "model.onnx")
    name = os.path.basename(os.path.normpath(args.model))
    repo = os.path.dirname(os.path.abspath(args.model))

    sessions = {}
    for label, intra in (("ort default threads", 0), ("ort 1 intra-op thread", 1)):
        o = ort.SessionOptions()
        o.intra_op_num_threads = intra
        sessions[label] = ort.InferenceSession(onnx_file, o, providers=["CPUExecutionProvider"])
    s0 = next(iter(sessions.values()))
    inp = s0.get_inputs()[0]
    shape = [1] + [d if isinstance(d, int) else 1 for d in inp.shape[1:]]
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal(shape).astype(np.float32) for _ in range(max(args.threads))]
    out_name = s0.get_outputs()[0].name

    with quern.Engine(repo) as engine:
        ref = s0.run(None, {inp.name: inputs[0]})[0]
        got = engine.infer(name, {inp.name: inputs[0]})[out_name]
        if not np.allclose(ref, got, rtol=1e-4, atol=1e-5):
            sys.exit("the engine and onnxruntime disagree")
        print(f"model {onnx_file}, onnxruntime-python {ort.__version__}, single-item requests")
        print(f"{'threads':>8} {'quern items/s':>14} {'µs CPU':>7} {'switches':>9} {'best ort items/s':>17} "
              f"{'µs CPU':>7} {'switches':>9} {'x ort':>7}   ort settings")
        for n in args.threads:
            ratios = []
            for round_ in range(args.rounds):
                q, q_cpu, q_cs = measure(lambda x: engine.infer(name, {inp.name: x}), n, args.seconds,
                                         lambda i: inputs[i])
                if round_ == 0:  # the better onnxruntime setting, kept for the later rounds
                    best = (0.0, 0.0, 0.0)
                    for label, s in sessions.items():
                        r = measure(lambda x, s=s: s.run([out_name], {inp.name: x}), n, args.seconds,
                                    lambda i: inputs[i])
                        if r[0] > best[0]:
                            best, best_label, best_session = r, label, s
                else:
                    best = measure(lambda x, s=best_session: s.run([out_name], {inp.name: x}), n, args.seconds,
                                   lambda i: inputs[i])
                ratios.append(q / best[0])
                print(f"{n:>8} {q:>14.0f} {q_cpu:>7.1f} {q_cs:>9.2f} {best[0]:>17.0f} {best[1]:>7.1f} {best[2]:>9.2f} "
                      f"{q / best[0]:>7.3f}   {best_label}", flush=True)
            if args.rounds > 1:
                print(f"{n:>8} threads: median x ort {statistics.median(ratios):.3f} over {args.rounds} rounds "
                      f"(min {min(ratios):.3f}, max {max(ratios):.3f})", flush=True)


if __name__ == "__main__":
    main()
