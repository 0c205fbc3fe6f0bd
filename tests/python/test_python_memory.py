"""A Python model's shared memory follows its load: the slots a large batch grew give their pages
back to the system once batches stop needing them. Measured from the outside: the blocks the
system holds for the model's memfds (which the server keeps open), through a real `quern serve` and
the real tritonclient; expected answers computed with numpy."""
import os
import threading
import time

import numpy as np
import tritonclient.http as httpclient

from quern_testing import start_quern, stop_quern, wait_until, write_model

QUERN = os.environ["QUERN_BIN"]


def _shm_kib(pid, model):
    """KiB the shared memory of `model`'s processes holds (their memfds, which server `pid` keeps
    open): what the system has allocated for them, whoever maps it."""
    total = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(f"/memfd:quern:{model} "):
                total += os.stat(f"/proc/{pid}/fd/{fd}").st_blocks * 512
        except FileNotFoundError:
            pass  # closed meanwhile
    return total // 1024


def test_a_large_batchs_shared_memory_goes_back_after_it_whether_the_load_pauses_or_goes_on(tmp_path):
    """A batch of 32 MiB in and out grows its slot of shared memory to 64 MiB. Its pages go back to
    the system within two idle times (5 s each) of the batch: when nothing follows it, and when
    two callers keep the model busy with small batches (they keep only what they use). Answers stay right
    throughout, a large batch after the release included (its pages come back zeroed, written
    again)."""
    write_model(tmp_path, "big", """
        backend: "python"
        max_batch_size: 0
        input [ { name: "x" data_type: TYPE_FP32 dims: [ -1 ] } ]
        output [ { name: "y" data_type: TYPE_FP32 dims: [ -1 ] } ]
        instance_group [ { count: 1 kind: KIND_CPU } ]
        """, "def infer(inputs):\n    return {'y': inputs['x'] + 1}\n")
    proc, ports = start_quern(QUERN, str(tmp_path))
    client = httpclient.InferenceServerClient(f"127.0.0.1:{ports['HTTP']}", network_timeout=120)

    def infer(x):
        inp = httpclient.InferInput("x", list(x.shape), "FP32")
        inp.set_data_from_numpy(x, binary_data=True)
        out = httpclient.InferRequestedOutput("y", binary_data=True)
        y = client.infer("big", [inp], outputs=[out]).as_numpy("y")
        np.testing.assert_array_equal(y, x + 1)

    try:
        small = np.arange(16, dtype=np.float32)
        infer(small)
        base = _shm_kib(proc.pid, "big")
        large = np.random.default_rng(7).random(8 << 20, dtype=np.float32)  # 32 MiB
        for phase in ("a pause", "small batches going on"):
            infer(large)
            held = _shm_kib(proc.pid, "big") - base
            assert held >= 60 << 10, f"the large batch's 64 MiB in and out hold only {held} KiB"
            start = time.monotonic()
            if phase == "a pause":
                wait_until(lambda: _shm_kib(proc.pid, "big") - base < 4096, timeout=60,
                           what="the large batch's shared memory to go back after a pause")
            else:  # two callers back to back: the model is hardly ever without a batch
                stop, errors = threading.Event(), []

                def caller():
                    mine = httpclient.InferenceServerClient(f"127.0.0.1:{ports['HTTP']}", network_timeout=120)
                    inp = httpclient.InferInput("x", list(small.shape), "FP32")
                    inp.set_data_from_numpy(small, binary_data=True)
                    while not stop.is_set():
                        try:
                            np.testing.assert_array_equal(mine.infer("big", [inp]).as_numpy("y"), small + 1)
                        except Exception as e:  # noqa: BLE001 (reported below)
                            errors.append(repr(e))
                            return

                callers = [threading.Thread(target=caller) for _ in range(2)]
                for t in callers:
                    t.start()
                try:
                    wait_until(lambda: _shm_kib(proc.pid, "big") - base < 4096 or errors, timeout=60,
                               what="the large batch's shared memory to go back while small batches go on")
                finally:
                    stop.set()
                    for t in callers:
                        t.join()
                assert not errors, errors
            print(f"after {phase}: {held} KiB went back within {time.monotonic() - start:.1f} s")
        infer(large)
        infer(small)
    finally:
        stop_quern(proc)
