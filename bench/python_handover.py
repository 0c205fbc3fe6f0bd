"""How often the thread that runs a short Python model's batch blocks, and how often the model's
process does: the caller of engine.infer and the model's process, their voluntary context switches
(/proc/PID/task/TID/status) per call over rounds of 200 calls of an echo model. With the hand-over
(quern.same_core, the process on the caller's CPU and the caller yielding it until the answer is
there) the caller blocks far less than once per call and the process about once (waiting for the
next batch); sleeping until the answer costs the caller one or more per call. A measurement, not a
test: another process on the same core takes the yielded CPU (the test checks the placement:
test_a_python_model_with_short_batches_runs_on_its_callers_core_and_the_caller_keeps_its_cpus).
  build/ci/python on PYTHONPATH (or the installed wheel):
  PYTHONPATH=build/ci/python build/venv/bin/python bench/python_handover.py [rounds, 10]"""
import os
import sys
import tempfile
import threading
import pathlib

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "python"))
import quern  # noqa: E402

from quern_testing import python_model_pids, voluntary_switches  # noqa: E402


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    with tempfile.TemporaryDirectory() as d:
        repo = pathlib.Path(d)
        for name, extra in (("yield", ""), ("sleep", 'parameters { key: "quern.same_core" value { string_value: "off" } }\n')):
            (repo / name / "1").mkdir(parents=True)
            (repo / name / "config.pbtxt").write_text(
                'backend: "python"\nmax_batch_size: 4\n'
                'input [ { name: "x" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
                'output [ { name: "y" data_type: TYPE_FP32 dims: [ 4 ] } ]\ninstance_group [ { count: 1 } ]\n' + extra)
            (repo / name / "1" / "model.py").write_text('def infer(inputs):\n    return {"y": inputs["x"] * 2}\n')
        me, tid = os.getpid(), threading.get_native_id()
        print("| model | round | caller: blocked per call | process: blocked per call |")
        print("|---|---:|---:|---:|")
        with quern.Engine(repo) as engine:
            x = np.arange(4, dtype=np.float32).reshape(1, 4)
            for name in ("yield", "sleep"):
                for _ in range(30):  # the process is placed once its round trips are known to be short
                    engine.infer(name, {"x": x})
                (model_pid,) = python_model_pids(name)
                for r in range(rounds):
                    before = voluntary_switches(me, tid), voluntary_switches(model_pid)
                    for i in range(200):
                        xi = x + i
                        assert (engine.infer(name, {"x": xi})["y"] == xi * 2).all()
                    after = voluntary_switches(me, tid), voluntary_switches(model_pid)
                    print(f"| {name} | {r + 1} | {(after[0] - before[0]) / 200:.2f} | {(after[1] - before[1]) / 200:.2f} |")


if __name__ == "__main__":
    main()
