"""How many cores two instances of a CPU-bound Python model use at once: two concurrent requests of
~0.7 s of CPU each, each instance's execute() reporting its wall interval and CPU time; prints the
cores used over the span of the two ((cpu_a + cpu_b) / span), per round. A measurement, not a test:
it depends on what else the machine runs (the test checks that the two run at once, in two
processes: test_two_instances_run_two_batches_at_once).
  build/venv/bin/python bench/python_instances.py [build/ci/src/cli/quern] [rounds, 5]"""
import os
import sys
import tempfile
import threading

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "python"))
os.environ.setdefault("QUERN_BIN", "")
os.environ.setdefault("QUERN_TEST_MODELS", "")
import tritonclient.http as httpclient  # noqa: E402

from quern_testing import start_quern  # noqa: E402
from test_python_models import BUSY, busy_config, write_model  # noqa: E402


def main():
    quern = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "build", "ci", "src", "cli", "quern")
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    with tempfile.TemporaryDirectory() as d:
        import pathlib
        write_model(pathlib.Path(d), "busy", busy_config(2), BUSY)
        proc, ports = start_quern(quern, d)
        try:
            for r in range(rounds):
                out = [None, None]

                def call(i):
                    inp = httpclient.InferInput("n", [1, 1], "INT64")
                    inp.set_data_from_numpy(np.array([[8_000_000]], dtype=np.int64))
                    client = httpclient.InferenceServerClient(f"127.0.0.1:{ports['HTTP']}", network_timeout=120)
                    out[i] = client.infer("busy", [inp]).as_numpy("info")[0]
                threads = [threading.Thread(target=call, args=(i,)) for i in range(2)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                (_, s_a, e_a, cpu_a), (_, s_b, e_b, cpu_b) = out
                span = max(e_a, e_b) - min(s_a, s_b)
                print(f"round {r + 1}: {(cpu_a + cpu_b) / span:.2f} cores over {span:.2f} s")
        finally:
            proc.terminate()
            proc.wait(timeout=30)


if __name__ == "__main__":
    main()
