"""Python models (backend "python") served by a real `quern serve`, driven by the real tritonclient
(HTTP and gRPC). Every model.py is written by the test; expected values are computed here with numpy.
A Triton Python-backend model runs unchanged; crashes, hangs and exceptions stay inside their batch."""
import concurrent.futures
import http.client as http_client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from quern_testing import start_quern, stop_quern, wait_until, write_model, write_one_step_ensemble

QUERN = os.environ["QUERN_BIN"]

# Triton's own example (python_backend/examples/add_sub), as users have it.
ADD_SUB = '''
import json
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.model_config = model_config = json.loads(args["model_config"])
        output0_config = pb_utils.get_output_config_by_name(model_config, "OUTPUT0")
        output1_config = pb_utils.get_output_config_by_name(model_config, "OUTPUT1")
        self.output0_dtype = pb_utils.triton_string_to_numpy(output0_config["data_type"])
        self.output1_dtype = pb_utils.triton_string_to_numpy(output1_config["data_type"])
        print("add_sub initialized as", args["model_instance_name"], "version", args["model_version"])

    def execute(self, requests):
        responses = []
        for request in requests:
            in_0 = pb_utils.get_input_tensor_by_name(request, "INPUT0")
            in_1 = pb_utils.get_input_tensor_by_name(request, "INPUT1")
            out_0, out_1 = (in_0.as_numpy() + in_1.as_numpy(), in_0.as_numpy() - in_1.as_numpy())
            out_tensor_0 = pb_utils.Tensor("OUTPUT0", out_0.astype(self.output0_dtype))
            out_tensor_1 = pb_utils.Tensor("OUTPUT1", out_1.astype(self.output1_dtype))
            responses.append(pb_utils.InferenceResponse(output_tensors=[out_tensor_0, out_tensor_1]))
        return responses

    def finalize(self):
        print("add_sub finalize: cleaning up")
'''

ADD_SUB_CONFIG = '''
backend: "python"
max_batch_size: 16
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] }, { name: "INPUT1" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] }, { name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 4 ] } ]
dynamic_batching { max_queue_delay_microseconds: 20000 }
instance_group [ { count: 1 kind: KIND_CPU } ]
'''

# The plain form: one function over the whole batch. Rows whose first value is 666 raise, 777
# kill the process, 888 hang; the model also reports which process ran it.
PLAIN = '''
import os, time
import numpy as np

def initialize(args):
    global SCALE
    SCALE = 2.0

def infer(inputs):
    x = inputs["x"]
    first = x[:, 0]
    if (first == 666).any():
        raise ValueError("the row starting with 666 is refused")
    if (first == 777).any():
        os.kill(os.getpid(), 9)
    if (first == 888).any():
        time.sleep(60)
    return {"y": x * SCALE, "pid": np.full((x.shape[0], 1), os.getpid(), dtype=np.int64)}
'''

PLAIN_CONFIG = '''
backend: "python"
max_batch_size: 8
input [ { name: "x" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ -1 ] }, { name: "pid" data_type: TYPE_INT64 dims: [ 1 ] } ]
dynamic_batching { }
instance_group [ { count: 1 kind: KIND_CPU } ]
parameters { key: "quern.execute_timeout_ms" value: { string_value: "1500" } }
'''

# Strings in and out, one request at a time (TritonError for a request that asks for it).
STRINGS = '''
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            words = pb_utils.get_input_tensor_by_name(request, "text").as_numpy()
            if any(w == b"fail at length" for w in words.flat):
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError("x" + "\u00e9" * 3000)))
                continue
            if any(w == b"fail me" for w in words.flat):
                responses.append(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError("this request asked to fail", pb_utils.TritonError.INVALID_ARG)))
                continue
            upper = np.array([w.decode().upper() for w in words.flat], dtype=np.object_).reshape(words.shape)
            lengths = np.array([len(w) for w in words.flat], dtype=np.int32).reshape(words.shape)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("upper", upper),
                                                         pb_utils.Tensor("length", lengths)]))
        return responses
'''

STRINGS_CONFIG = '''
backend: "python"
max_batch_size: 8
input [ { name: "text" data_type: TYPE_STRING dims: [ -1 ] } ]
output [ { name: "upper" data_type: TYPE_STRING dims: [ -1 ] }, { name: "length" data_type: TYPE_INT32 dims: [ -1 ] } ]
dynamic_batching { max_queue_delay_microseconds: 20000 }
instance_group [ { count: 1 kind: KIND_CPU } ]
'''

# Large outputs: one passed on from the input (it stays where the server wrote it), one new.
MIRROR = '''
def infer(inputs):
    x = inputs["x"]
    return {"same": x, "plus": x + 1}
'''

MIRROR_CONFIG = '''
backend: "python"
max_batch_size: 8
input [ { name: "x" data_type: TYPE_UINT8 dims: [ -1 ] } ]
output [ { name: "same" data_type: TYPE_UINT8 dims: [ -1 ] }, { name: "plus" data_type: TYPE_UINT8 dims: [ -1 ] } ]
dynamic_batching { }
instance_group [ { count: 1 kind: KIND_CPU } ]
'''

# CPU-bound: a pure-Python loop holding the GIL; reports its process, CPU time and wall interval.
BUSY = '''
import os, time
import numpy as np

def infer(inputs):
    n = inputs["n"]
    wall0, cpu0 = time.time(), time.process_time()
    total = 0
    for i in range(int(n.max())):
        total += i * i
    wall1, cpu1 = time.time(), time.process_time()
    rows = n.shape[0]
    info = np.array([[os.getpid(), wall0, wall1, cpu1 - cpu0]] * rows, dtype=np.float64)
    return {"info": info}
'''


def busy_config(count):
    return f'''
backend: "python"
max_batch_size: 1
input [ {{ name: "n" data_type: TYPE_INT64 dims: [ 1 ] }} ]
output [ {{ name: "info" data_type: TYPE_FP64 dims: [ 4 ] }} ]
instance_group [ {{ count: {count} kind: KIND_CPU }} ]
'''


# Each request's request_id(), as Triton's Python backend gives it (the KServe request id).
IDS = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("id", np.array([[r.request_id().encode()]], dtype=np.object_))]) for r in requests]
'''

IDS_CONFIG = '''
backend: "python"
max_batch_size: 8
input [ { name: "x" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "id" data_type: TYPE_STRING dims: [ 1 ] } ]
dynamic_batching { max_queue_delay_microseconds: 50000 }
'''


def snapshot(path):
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    write_model(repo, "add_sub", ADD_SUB_CONFIG, ADD_SUB)
    write_model(repo, "plain", PLAIN_CONFIG, PLAIN)
    write_model(repo, "strings", STRINGS_CONFIG, STRINGS)
    write_model(repo, "mirror", MIRROR_CONFIG, MIRROR)
    write_model(repo, "ids", IDS_CONFIG, IDS)
    # The same, whose batches wait (up to 30 s) until they hold 6 requests, on one instance: the six
    # requests of test_each_request_in_a_batch_has_its_own_request_id meet in one batch however
    # slowly a busy machine sends them.
    write_model(repo, "ids_six", IDS_CONFIG.replace("max_batch_size: 8", "max_batch_size: 6").replace(
        "max_queue_delay_microseconds: 50000", "max_queue_delay_microseconds: 30000000") +
        "instance_group [ { count: 1 kind: KIND_CPU } ]\n", IDS)
    # An ensemble whose one step is "ids": its request's id reaches the step.
    write_one_step_ensemble(repo, "ids_ensemble", "ids", "x", "TYPE_FP32", "id", "TYPE_STRING", max_batch_size=8)
    # A model importing a module beside model.py, run by the test's own interpreter (a venv).
    write_model(repo, "venv", '''
        backend: "python"
        max_batch_size: 0
        input [ { name: "x" data_type: TYPE_INT32 dims: [ 2 ] } ]
        output [ { name: "exe" data_type: TYPE_STRING dims: [ 1 ] }, { name: "y" data_type: TYPE_INT32 dims: [ 2 ] } ]
        parameters { key: "quern.python" value: { string_value: "%s" } }
        ''' % sys.prefix, '''
import sys
import numpy as np
from helper import twice

def infer(inputs):
    return {"exe": np.array([sys.executable.encode()], dtype=np.object_), "y": twice(inputs["x"])}
''', extra={"helper.py": "def twice(a):\n    return a * 2\n"})
    before = snapshot(repo)
    log = []
    proc, ports = start_quern(QUERN, str(repo), log=log)
    yield {"repo": repo, "ports": ports, "log": log, "proc": proc, "before": before}
    proc.terminate()
    proc.wait(timeout=30)


def http(served):
    return httpclient.InferenceServerClient(f"127.0.0.1:{served['ports']['HTTP']}", concurrency=16)


def grpc(served):
    return grpcclient.InferenceServerClient(f"127.0.0.1:{served['ports']['gRPC']}")


def add_sub_http(client, a, b):
    inputs = [httpclient.InferInput("INPUT0", list(a.shape), "FP32"), httpclient.InferInput("INPUT1", list(b.shape), "FP32")]
    inputs[0].set_data_from_numpy(a, binary_data=True)
    inputs[1].set_data_from_numpy(b, binary_data=False)
    return client.infer("add_sub", inputs)


def test_triton_example_model_runs_unchanged_over_http_and_grpc(served):
    rng = np.random.default_rng(1)
    a = rng.standard_normal((3, 4)).astype(np.float32)
    b = rng.standard_normal((3, 4)).astype(np.float32)
    r = add_sub_http(http(served), a, b)
    np.testing.assert_allclose(r.as_numpy("OUTPUT0"), a + b, rtol=1e-6)
    np.testing.assert_allclose(r.as_numpy("OUTPUT1"), a - b, rtol=1e-6)
    g = grpc(served)
    inputs = [grpcclient.InferInput("INPUT0", [3, 4], "FP32"), grpcclient.InferInput("INPUT1", [3, 4], "FP32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    r = g.infer("add_sub", inputs)
    np.testing.assert_allclose(r.as_numpy("OUTPUT0"), a + b, rtol=1e-6)
    meta = g.get_model_metadata("add_sub", as_json=True)
    assert meta["platform"] == "python"
    config = http(served).get_model_config("add_sub")
    assert config["backend"] == "python"
    # initialize() saw Triton's arguments; its print reached the server's log with the model's name.
    assert any("model 'add_sub' instance 0: add_sub initialized as add_sub_0 version 1" in line
               for line in served["log"]), served["log"][-20:]


def test_concurrent_callers_each_get_their_own_rows_and_batches_form(served):
    client = http(served)
    before = client.get_inference_statistics("add_sub")["model_stats"][0]
    rng = np.random.default_rng(2)
    pairs = [(rng.standard_normal((1 + i % 3, 4)).astype(np.float32),
              rng.standard_normal((1 + i % 3, 4)).astype(np.float32)) for i in range(48)]
    results = [None] * len(pairs)

    def call(i):
        a, b = pairs[i]
        results[i] = add_sub_http(httpclient.InferenceServerClient(f"127.0.0.1:{served['ports']['HTTP']}"), a, b)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(pairs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for (a, b), r in zip(pairs, results):
        np.testing.assert_allclose(r.as_numpy("OUTPUT0"), a + b, rtol=1e-6)
        np.testing.assert_allclose(r.as_numpy("OUTPUT1"), a - b, rtol=1e-6)
    after = client.get_inference_statistics("add_sub")["model_stats"][0]
    requests = after["inference_count"] - before["inference_count"]
    executions = after["execution_count"] - before["execution_count"]
    assert requests == sum(a.shape[0] for a, _ in pairs)
    assert executions < len(pairs), (executions, len(pairs))  # requests met in batches


def test_plain_form_over_the_batch(served):
    x = np.arange(10, dtype=np.float32).reshape(2, 5)
    inp = grpcclient.InferInput("x", [2, 5], "FP32")
    inp.set_data_from_numpy(x)
    r = grpc(served).infer("plain", [inp])
    np.testing.assert_array_equal(r.as_numpy("y"), x * 2)
    assert r.as_numpy("pid").shape == (2, 1)


def plain_http(served, first, model="plain"):
    x = np.array([[first, 1, 2]], dtype=np.float32)
    inp = httpclient.InferInput("x", [1, 3], "FP32")
    inp.set_data_from_numpy(x)
    return httpclient.InferenceServerClient(f"127.0.0.1:{served['ports']['HTTP']}",
                                            network_timeout=120).infer(model, [inp])


def test_exception_fails_only_its_batch_with_the_traceback_line(served):
    with pytest.raises(InferenceServerException) as e:
        plain_http(served, 666)
    assert "ValueError: the row starting with 666 is refused" in str(e.value)
    assert "plain" in str(e.value)
    np.testing.assert_array_equal(plain_http(served, 5).as_numpy("y"), [[10, 2, 4]])
    # The traceback reaches the server's log through the process's stderr, beside the answer.
    wait_until(lambda: any("Traceback" in line and "model 'plain'" in line for line in served["log"]), timeout=10,
               what="the traceback in the server's log")


def test_killed_process_fails_its_batch_and_is_started_again(served):
    pid = int(plain_http(served, 1).as_numpy("pid")[0, 0])
    with pytest.raises(InferenceServerException) as e:
        plain_http(served, 777)
    assert "killed by signal 9" in str(e.value), str(e.value)
    r = plain_http(served, 3)
    np.testing.assert_array_equal(r.as_numpy("y"), [[6, 2, 4]])
    assert int(r.as_numpy("pid")[0, 0]) != pid
    assert http(served).is_model_ready("plain")
    # The dead process was reaped (no zombie left behind).
    assert not os.path.exists(f"/proc/{pid}") or "Z" not in open(f"/proc/{pid}/stat").read().split()[2]


def test_a_process_that_dies_at_every_batch_is_started_again_only_after_a_pause(served):
    for i in range(3):
        if i == 2:
            before_third = time.monotonic()  # the server's pause begins after this
        with pytest.raises(InferenceServerException) as e:
            plain_http(served, 777)
        assert "killed by signal 9" in str(e.value), str(e.value)
    # Three deaths in a row: no process is started for the next second; batches fail at once.
    sent = time.monotonic()
    try:
        plain_http(served, 5)
        answered = None
    except InferenceServerException as refused:
        answered = refused
    if sent - before_third < 0.5:
        # Sent well within the pause: refused (a call held until the pause ended would have started a
        # process and been answered), saying when the process starts again.
        assert answered is not None, "answered within the pause"
        m = re.search(r"died running 3 batches in a row; it starts again in (\d+) ms", str(answered))
        assert m and "503" in str(answered.status()), str(answered)
        assert 0 <= int(m.group(1)) <= 1000, str(answered)
    else:  # this process stalled through the third death: the call may have come after the pause
        print(f"the call went {sent - before_third:.3f} s after the third began; the pause was not checked")
    time.sleep(1.1)
    np.testing.assert_array_equal(plain_http(served, 5).as_numpy("y"), [[10, 2, 4]])  # the streak ends
    with pytest.raises(InferenceServerException) as e:
        plain_http(served, 777)
    assert "killed by signal 9" in str(e.value)
    np.testing.assert_array_equal(plain_http(served, 6).as_numpy("y"), [[12, 2, 4]])  # one death: no pause


def dead(pid):
    """Dead to its parent: a zombie whose every thread is gone, or reaped. (Only the main thread left
    is not enough: it may still be exiting, its sockets open; and a zombie main thread may still have
    other threads exiting.)"""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z" and len(os.listdir(f"/proc/{pid}/task")) <= 1
    except FileNotFoundError:
        return True


def test_process_killed_while_idle_is_replaced_without_failing_a_request(served):
    pid = int(plain_http(served, 1).as_numpy("pid")[0, 0])
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: dead(pid), what=f"process {pid} to die")
    r = plain_http(served, 2)
    np.testing.assert_array_equal(r.as_numpy("y"), [[4, 2, 4]])
    assert int(r.as_numpy("pid")[0, 0]) != pid


def test_workers_forked_by_model_py_neither_hide_a_crash_nor_outlive_it(tmp_path):
    """model.py forks a worker (as multiprocessing does) that inherits the process's socket and
    shared memory: the model's death is still reported at once (not after the execute timeout), and
    the worker dies with it."""
    write_model(tmp_path, "forks", PLAIN_CONFIG.replace('"1500"', '"60000"'), '''
import os, time
import numpy as np

WORKER = 0

def initialize(args):
    global WORKER
    WORKER = os.fork()
    if WORKER == 0:
        time.sleep(1000)
        os._exit(0)

def infer(inputs):
    x = inputs["x"]
    if (x[:, 0] == 777).any():
        os.kill(os.getpid(), 9)
    return {"y": x * 2, "pid": np.full((x.shape[0], 1), WORKER, dtype=np.int64)}
''')
    proc, ports = start_quern(QUERN, str(tmp_path))
    try:
        served = {"ports": ports}
        worker = int(plain_http(served, 1, "forks").as_numpy("pid")[0, 0])
        assert os.path.exists(f"/proc/{worker}")
        start = time.monotonic()
        with pytest.raises(InferenceServerException) as e:
            plain_http(served, 777, "forks")
        assert "killed by signal 9" in str(e.value), str(e.value)
        assert time.monotonic() - start < 20
        deadline = time.time() + 10
        while time.time() < deadline and os.path.exists(f"/proc/{worker}") and \
                "Z" not in open(f"/proc/{worker}/stat").read().split()[2]:
            time.sleep(0.1)
        assert not os.path.exists(f"/proc/{worker}") or "Z" in open(f"/proc/{worker}/stat").read().split()[2]
        np.testing.assert_array_equal(plain_http(served, 3, "forks").as_numpy("y"), [[6, 2, 4]])
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_hung_execute_is_killed_after_the_timeout(served):
    pid = int(plain_http(served, 1).as_numpy("pid")[0, 0])
    start = time.monotonic()
    with pytest.raises(InferenceServerException) as e:
        plain_http(served, 888)
    took = time.monotonic() - start
    assert "ran longer than 1500 ms" in str(e.value), str(e.value)
    assert took < 30, took
    r = plain_http(served, 4)
    np.testing.assert_array_equal(r.as_numpy("y"), [[8, 2, 4]])
    assert int(r.as_numpy("pid")[0, 0]) != pid
    assert not os.path.exists(f"/proc/{pid}")


def test_each_request_in_a_batch_has_its_own_request_id(served):
    def x(module):
        i = module.InferInput("x", [1, 1], "FP32")
        i.set_data_from_numpy(np.zeros((1, 1), np.float32))
        return [i]

    client = http(served)
    before = client.get_inference_statistics("ids_six")["model_stats"][0]["execution_count"]
    results = {}

    def call(n):
        r = http(served).infer("ids_six", x(httpclient), request_id=f"req-{n}")
        results[n] = r.as_numpy("id").ravel()[0]

    threads = [threading.Thread(target=call, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {n: f"req-{n}".encode() for n in range(6)}
    assert client.get_inference_statistics("ids_six")["model_stats"][0]["execution_count"] - before == 1  # batched
    # gRPC: ModelInferRequest.id; HTTP with no id in the body: the X-Request-ID header; neither: "".
    assert grpc(served).infer("ids", x(grpcclient), request_id="g-1").as_numpy("id").ravel()[0] == b"g-1"
    assert client.infer("ids", x(httpclient), headers={"X-Request-ID": "hdr-2"}).as_numpy("id").ravel()[0] == b"hdr-2"
    assert client.infer("ids", x(httpclient)).as_numpy("id").ravel()[0] == b""


def test_a_step_of_an_ensemble_sees_the_request_id_and_a_job_its_job_id(served):
    i = httpclient.InferInput("x", [1, 1], "FP32")
    i.set_data_from_numpy(np.zeros((1, 1), np.float32))
    r = http(served).infer("ids_ensemble", [i], request_id="ens-7")
    assert r.as_numpy("id").ravel()[0] == b"ens-7"
    # A job through the ensemble: the step's request_id() is the job id, and the job has started.
    port = served["ports"]["HTTP"]
    body = json.dumps({"inputs": [{"name": "x", "shape": [1, 1], "datatype": "FP32", "data": [0]}]})
    c = http_client.HTTPConnection("127.0.0.1", port, timeout=30)
    c.request("POST", "/v2/models/ids_ensemble/jobs", body=body)
    answer = c.getresponse()
    job_id = json.loads(answer.read())["job_id"]
    assert answer.status == 202
    deadline = time.time() + 30
    while True:
        c.request("GET", f"/v2/jobs/{job_id}")
        job = json.loads(c.getresponse().read())
        if job["status"] not in ("queued", "running") or time.time() > deadline:
            break
        time.sleep(0.02)
    c.close()
    assert job["status"] == "done", job
    assert job["result"]["outputs"][0]["data"] == [job_id], job
    assert job["started"] and job["submitted"] <= job["started"] <= job["finished"], job


def strings_request(served, words):
    arr = np.array(words, dtype=np.object_).reshape(1, -1)
    inp = httpclient.InferInput("text", list(arr.shape), "BYTES")
    inp.set_data_from_numpy(arr)
    return httpclient.InferenceServerClient(f"127.0.0.1:{served['ports']['HTTP']}").infer("strings", [inp])


def test_bytes_tensors_and_per_request_errors_in_one_batch(served):
    words = [[b"alpha", "\u00e9t\u00e9".encode(), b""], [b"fail me"], [b"x" * 1000, b"beta"], [b"gamma"]]
    results = [None] * len(words)

    def call(i):
        try:
            results[i] = strings_request(served, words[i])
        except InferenceServerException as e:
            results[i] = e

    client = http(served)
    before = client.get_inference_statistics("strings")["model_stats"][0]
    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(words))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for w, r in zip(words, results):
        if w == [b"fail me"]:
            assert isinstance(r, InferenceServerException)
            assert "this request asked to fail" in str(r) and "400" in str(r.status()), (str(r), r.status())
            continue
        assert not isinstance(r, Exception), r
        assert [s for s in r.as_numpy("upper").flat] == [x.decode().upper().encode() for x in w]
        assert r.as_numpy("length").tolist() == [[len(x) for x in w]]
    after = client.get_inference_statistics("strings")["model_stats"][0]
    assert after["execution_count"] - before["execution_count"] < len(words)


def test_large_outputs_stay_intact_while_later_batches_run(served):
    """Outputs borrow the shared memory their batch ran in while the server answers; later batches must
    never write over an answer not yet sent (48 concurrent callers, 384 KiB each way, over HTTP and gRPC)."""
    errors = []

    def call(i):
        try:
            x = np.random.default_rng(i).integers(0, 255, size=(1, 384 * 1024), dtype=np.uint8)
            if i % 2:
                inp = httpclient.InferInput("x", list(x.shape), "UINT8")
                inp.set_data_from_numpy(x, binary_data=True)
                r = httpclient.InferenceServerClient(f"127.0.0.1:{served['ports']['HTTP']}").infer("mirror", [inp])
            else:
                inp = grpcclient.InferInput("x", list(x.shape), "UINT8")
                inp.set_data_from_numpy(x)
                r = grpcclient.InferenceServerClient(f"127.0.0.1:{served['ports']['gRPC']}").infer("mirror", [inp])
            if not np.array_equal(r.as_numpy("same"), x) or not np.array_equal(r.as_numpy("plus"), x + 1):
                errors.append(f"caller {i}: wrong bytes")
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(f"caller {i}: {e}")

    for _ in range(2):
        threads = [threading.Thread(target=call, args=(i,)) for i in range(48)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors, errors[:5]


def test_a_long_error_in_two_byte_characters_is_cut_between_characters(served):
    with pytest.raises(InferenceServerException) as e:
        strings_request(served, [b"fail at length"])
    assert "\u00e9" * 100 in str(e.value) and "\ufffd" not in str(e.value), str(e.value)[:200]


def test_venv_interpreter_and_modules_beside_model_py(served):
    inp = grpcclient.InferInput("x", [2], "INT32")
    inp.set_data_from_numpy(np.array([3, -4], dtype=np.int32))
    r = grpc(served).infer("venv", [inp])
    assert r.as_numpy("y").tolist() == [6, -8]
    exe = r.as_numpy("exe")[0].decode()
    assert os.path.realpath(os.path.dirname(exe)) == os.path.realpath(os.path.join(sys.prefix, "bin")), exe


def test_nothing_is_written_into_the_repository(served):
    assert snapshot(served["repo"]) == served["before"]


def test_two_instances_run_two_batches_at_once(tmp_path):
    """A CPU-bound Python model with two instances runs two batches at once, in two processes (so no
    GIL is shared): their execute() intervals, as each process reports them, overlap for most of
    the shorter one. How many cores the two then use is a measurement, not a test: it depends on
    what else the machine runs: bench/python_instances.py measures it."""
    write_model(tmp_path, "busy", busy_config(2), BUSY)
    proc, ports = start_quern(QUERN, str(tmp_path))
    try:
        def call(out, i):
            inp = httpclient.InferInput("n", [1, 1], "INT64")
            # ~0.7 s of CPU each: long beside the tens of milliseconds by which the second
            # execute() may start after the first.
            inp.set_data_from_numpy(np.array([[8_000_000]], dtype=np.int64))
            out[i] = httpclient.InferenceServerClient(f"127.0.0.1:{ports['HTTP']}",
                                                      network_timeout=120).infer("busy", [inp]).as_numpy("info")[0]

        out = [None, None]
        threads = [threading.Thread(target=call, args=(out, i)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        (pid_a, s_a, e_a, cpu_a), (pid_b, s_b, e_b, cpu_b) = out
        assert pid_a != pid_b, "both batches ran in one process"
        overlap = min(e_a, e_b) - max(s_a, s_b)
        shorter = min(e_a - s_a, e_b - s_b)
        assert overlap > 0.5 * shorter, f"execute() intervals overlap {overlap:.2f} s of {shorter:.2f} s"
        assert cpu_a > 0 and cpu_b > 0
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_load_errors_name_the_model_and_the_cause(tmp_path):
    write_model(tmp_path, "syntax", PLAIN_CONFIG, "def infer(inputs:\n")
    write_model(tmp_path, "nothing", PLAIN_CONFIG, "x = 1\n")
    write_model(tmp_path, "raises", PLAIN_CONFIG, "raise RuntimeError('cannot find my weights')\n")
    write_model(tmp_path, "bad_python", PLAIN_CONFIG + '\nparameters { key: "quern.python" value: { string_value: "/no/such/python" } }\n', PLAIN)
    write_model(tmp_path, "packed_env", PLAIN_CONFIG + '\nparameters { key: "EXECUTION_ENV_PATH" value: { string_value: "$$TRITON_MODEL_DIRECTORY/env.tar.gz" } }\n', PLAIN)
    write_model(tmp_path, "bad_same_core", PLAIN_CONFIG + '\nparameters { key: "quern.same_core" value: { string_value: "sometimes" } }\n', PLAIN)
    write_model(tmp_path, "bad_short", PLAIN_CONFIG + '\nparameters { key: "quern.same_core_below_us" value: { string_value: "0" } }\n', PLAIN)
    (tmp_path / "missing" / "1").mkdir(parents=True)
    (tmp_path / "missing" / "config.pbtxt").write_text(PLAIN_CONFIG)
    write_model(tmp_path, "good", PLAIN_CONFIG, PLAIN)
    proc, ports = start_quern(QUERN, str(tmp_path))
    try:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{ports['HTTP']}")
        index = {m["name"]: m for m in client.get_model_repository_index()}
        assert index["good"]["state"] == "READY"
        expect = {
            "syntax": "SyntaxError",
            "nothing": "defines neither a class TritonPythonModel nor a function infer(inputs)",
            "raises": "RuntimeError: cannot find my weights",
            "bad_python": "/no/such/python",
            "packed_env": "EXECUTION_ENV_PATH",
            "bad_same_core": 'model \'bad_same_core\': parameter quern.same_core must be "on" or "off", got "sometimes"',
            "bad_short": "model 'bad_short': parameter quern.same_core_below_us must be microseconds in [1, 10000000], "
                         'got "0"',
            "missing": "model.py does not exist",
        }
        for name, text in expect.items():
            assert index[name]["state"] != "READY", index[name]
            assert text in index[name]["reason"], (name, index[name]["reason"])
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_changed_model_py_is_reloaded(tmp_path):
    write_model(tmp_path, "scale", PLAIN_CONFIG, PLAIN)
    proc, ports = start_quern(QUERN, str(tmp_path), "--repository-poll-secs", "0.2")
    try:
        served = {"ports": ports}
        np.testing.assert_array_equal(plain_http(served, 1, "scale").as_numpy("y"), [[2, 2, 4]])
        time.sleep(1.1)  # a new modification time even on coarse file systems
        (tmp_path / "scale" / "1" / "model.py").write_text(PLAIN.replace("SCALE = 2.0", "SCALE = 3.0"))
        deadline = time.time() + 30
        while time.time() < deadline:
            y = plain_http(served, 1, "scale").as_numpy("y")
            if y[0, 0] == 3:
                break
            time.sleep(0.2)
        np.testing.assert_array_equal(y, [[3, 3, 6]])
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def python_children(marker, server_pid):
    """The server's Python processes (`marker` in their command line) and the processes in their
    process groups (workers they forked); processes left by other servers are not counted."""
    out = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout.split()
    stats = {}
    for pid in map(int, out):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            stats[pid] = (int(fields[1]), int(fields[2]))  # ppid, pgrp
        except OSError:
            pass
    groups = {pid for pid, (ppid, _) in stats.items() if ppid == server_pid}
    return [pid for pid, (_, pgrp) in stats.items() if pgrp in groups]


def running(pid):
    """Whether `pid` still runs (a zombie waiting for a parent that is gone does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_processes_end_with_the_server_even_when_it_is_killed(tmp_path):
    """The model's process and a worker it forked (which has the same command line) end with the
    server, also when the server is killed with SIGKILL and cannot kill them itself."""
    forking = PLAIN.replace("def initialize(args):", """def initialize(args):
    if os.fork() == 0:
        time.sleep(1000)
        os._exit(0)""", 1)
    write_model(tmp_path, "orphan_check", PLAIN_CONFIG, forking)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        proc, ports = start_quern(QUERN, str(tmp_path))
        children = python_children("quern-python:orphan_check:", proc.pid)
        assert len(children) >= 2, f"expected the model's process and its forked worker: {children}"
        proc.send_signal(sig)
        proc.wait(timeout=30)
        deadline = time.time() + 10
        while time.time() < deadline and any(running(p) for p in children):
            time.sleep(0.1)
        alive = [p for p in children if running(p)]
        assert not alive, f"after {sig.name} these Python processes still run: {alive}"


def test_a_hung_execute_without_a_timeout_does_not_hold_the_shutdown(tmp_path):
    """execute_timeout_ms 0 (no timeout) and an infer() that never returns: a SIGTERM drains for
    --drain-timeout-secs, then the server stops waiting, kills the Python process and exits; the
    caller gets an answer (an error) or a closed connection, never a hang."""
    config = PLAIN_CONFIG.replace('"1500"', '"0"')
    write_model(tmp_path, "stuck", config, 'import time\ndef infer(inputs):\n    time.sleep(3600)\n')
    log = []
    proc, ports = start_quern(QUERN, str(tmp_path), "--drain-timeout-secs", "1", log=log)
    children = python_children("quern-python:stuck:", proc.pid)
    assert children, "no Python process found"
    outcome = []

    def call():
        try:
            plain_http({"ports": ports}, 1, "stuck")
            outcome.append("answered")
        except Exception as e:  # noqa: BLE001 - any error is an answer here
            outcome.append(str(e))
    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    time.sleep(0.5)  # the batch is running
    start = time.time()
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)
        pytest.fail("the server did not exit within 20 s of SIGTERM with a hung execute()")
    assert time.time() - start < 15
    caller.join(timeout=30)
    assert outcome and outcome[0] != "answered", outcome
    deadline = time.time() + 10
    while time.time() < deadline and any(os.path.exists(f"/proc/{p}") for p in children):
        time.sleep(0.1)
    assert not [p for p in children if os.path.exists(f"/proc/{p}")]


def test_wrong_outputs_are_clear_errors(tmp_path):
    write_model(tmp_path, "wrong", PLAIN_CONFIG, '''
import numpy as np
def infer(inputs):
    x = inputs["x"]
    kind = int(x[0, 0])
    if kind == 1:
        return {"y": np.array(["a"] * x.size).reshape(x.shape), "pid": np.zeros((x.shape[0], 1), np.int64)}
    if kind == 2:
        return {"y": x[:, :1], "pid": np.zeros((x.shape[0] + 1, 1), np.int64)}
    if kind == 3:
        return {"y": x}
    if kind == 5:
        return {"y": x, "pid": np.full((x.shape[0], 1), 2**63, np.uint64)}
    if kind == 6:
        return {"y": x.astype(np.float64) / 3, "pid": np.zeros((x.shape[0], 1), np.int8)}
    return [x]
''')
    proc, ports = start_quern(QUERN, str(tmp_path))
    try:
        served = {"ports": ports}
        for kind, text in [(1, "output 'y' has dtype <U1; the configuration says float32"),
                           (2, "output 'pid' has shape [2, 1]; expected [1, 1]"),
                           (3, "returned no output 'pid'"),
                           (4, "infer() returned list"),
                           (5, "output 'pid' has dtype uint64; the configuration says int64")]:
            with pytest.raises(InferenceServerException) as e:
                plain_http(served, kind, "wrong")
            assert text in str(e.value), (kind, str(e.value))
        # Casts that keep the values are taken: float64 to FP32, int8 to INT64.
        r = plain_http(served, 6, "wrong")
        np.testing.assert_allclose(r.as_numpy("y"), [[2, 1 / 3, 2 / 3]], rtol=1e-6)
        assert r.as_numpy("pid").tolist() == [[0]]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples")


def test_example_python_models_around_imagenet(tmp_path):
    """examples/models: imagenet_preprocess (plain form) -> imagenet (ONNX) -> imagenet_top5 (Triton form)
    on a photograph: the pre-processing matches an independent bilinear reference, the top-5 matches
    numpy's softmax of the logits, and the bird is named."""
    import shutil
    from PIL import Image
    from quern_testing import resample
    for m in ("imagenet", "imagenet_preprocess", "imagenet_top5"):
        shutil.copytree(os.path.join(EXAMPLES, "models", m), tmp_path / m)
    proc, ports = start_quern(QUERN, str(tmp_path))
    try:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{ports['HTTP']}")
        rgb = np.asarray(Image.open(os.path.join(EXAMPLES, "data", "eagle.jpg")).convert("RGB"))
        inp = httpclient.InferInput("pixels", list(rgb.shape), "UINT8")
        inp.set_data_from_numpy(np.ascontiguousarray(rgb), binary_data=True)
        image = client.infer("imagenet_preprocess", [inp]).as_numpy("image")
        assert image.shape == (1, 3, 224, 224) and image.dtype == np.float32
        h, w, _ = rgb.shape
        s = 256 / min(w, h)
        ref = resample(rgb, 224, 224, s, s, -np.floor((w * s - 224) / 2 + 1e-9), -np.floor((h * s - 224) / 2 + 1e-9))
        ref = ((ref.astype(np.float32) - 127) / 128).transpose(2, 0, 1)[None]
        assert np.abs(image - ref).max() <= 1.5 / 128, np.abs(image - ref).max()

        inp = httpclient.InferInput("image", list(image.shape), "FP32")
        inp.set_data_from_numpy(image, binary_data=True)
        logits = client.infer("imagenet", [inp]).as_numpy("logits")
        inp = httpclient.InferInput("logits", list(logits.shape), "FP32")
        inp.set_data_from_numpy(logits, binary_data=True)
        top = client.infer("imagenet_top5", [inp])
        x = logits[0].astype(np.float64)
        p = np.exp(x - x.max())
        p /= p.sum()
        order = np.argsort(-p)[:5]
        assert top.as_numpy("classes")[0].tolist() == order.tolist()
        np.testing.assert_allclose(top.as_numpy("probabilities")[0], p[order], rtol=1e-5, atol=1e-7)
        labels = open(os.path.join(EXAMPLES, "models", "imagenet", "labels.txt")).read().splitlines()
        assert [b.decode() for b in top.as_numpy("labels")[0]] == [labels[i] for i in order]
        # A person reading the photograph: a young bald eagle (ImageNet's "kite" is a bird of prey too).
        names = [b.decode() for b in top.as_numpy("labels")[0]]
        assert names[0] in ("bald eagle", "kite") and "bald eagle" in names, names
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


# model.py starts a daemon that leaves the process group (setsid), and a process with subprocess;
# rows starting with 555 hold the GIL in a C call (PyDLL does not release it) for 100 s.
ESCAPES = '''
import ctypes, os, subprocess, time
import numpy as np

DAEMON = 0
SLEEPER = None

def initialize(args):
    global DAEMON, SLEEPER
    DAEMON = os.fork()
    if DAEMON == 0:
        os.setsid()
        time.sleep(1000)
        os._exit(0)
    SLEEPER = subprocess.Popen(["sleep", "1000"], start_new_session=True)

def infer(inputs):
    x = inputs["x"]
    if (x[:, 0] == 555).any():
        ctypes.PyDLL(None).sleep(100)
    pids = np.array([[DAEMON, SLEEPER.pid, os.getpid()]] * x.shape[0], dtype=np.int64)
    return {"y": x * 2, "pids": pids}
'''

ESCAPES_CONFIG = '''
backend: "python"
max_batch_size: 8
input [ { name: "x" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ -1 ] }, { name: "pids" data_type: TYPE_INT64 dims: [ 3 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
'''


def test_nothing_a_model_starts_outlives_its_unload(tmp_path):
    write_model(tmp_path, "escapes", ESCAPES_CONFIG, ESCAPES)
    proc, ports = start_quern(QUERN, str(tmp_path), "--model-control", "explicit")
    try:
        pids = [int(p) for p in plain_http({"ports": ports}, 1, "escapes").as_numpy("pids")[0]]
        assert all(alive(p) for p in pids), pids
        client = httpclient.InferenceServerClient(f"127.0.0.1:{ports['HTTP']}")
        client.unload_model("escapes")
        wait_until(lambda: not any(alive(p) for p in pids), timeout=15, what=f"the model's processes {pids} to end")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_nothing_a_model_starts_outlives_a_killed_server_even_holding_the_gil(tmp_path):
    write_model(tmp_path, "escapes", ESCAPES_CONFIG, ESCAPES)
    proc, ports = start_quern(QUERN, str(tmp_path))
    try:
        pids = [int(p) for p in plain_http({"ports": ports}, 1, "escapes").as_numpy("pids")[0]]
        # The model's process stops in a C call holding the GIL: its own watch cannot run.
        threading.Thread(target=lambda: pytest.raises(Exception, plain_http, {"ports": ports}, 555, "escapes"),
                         daemon=True).start()
        time.sleep(1.5)
        proc.kill()
        proc.wait(timeout=30)
        wait_until(lambda: not any(alive(p) for p in pids), timeout=15,
                   what=f"the model's processes {pids} to end with the server")
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_model_without_a_memory_bound_gets_half_the_machines_memory(tmp_path):
    """Issue: with no quern.python.max_memory_mb a model's 20 GB allocation was stopped only by the
    execute timeout. By default a Python model's process may now map half of the machine's memory
    (at least 4 GiB): asking for three quarters of it fails in the model with MemoryError naming the
    bound. (np.empty touches no page: without the bound the allocation succeeds and takes nothing.)"""
    with open("/proc/meminfo") as f:
        total_mb = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:")) // 1024
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                total_mb = min(total_mb, int(f.read().split()[0]) >> 20)
        except (OSError, ValueError):  # absent, or "max"
            pass
    bound_mb = max(4096, total_mb // 2)
    ask = total_mb * 3 // 4
    if ask <= bound_mb:
        pytest.skip(f"a machine of {total_mb} MB: three quarters of it are within the 4 GiB floor")
    write_model(tmp_path, "roomy", PLAIN_CONFIG, f'''
import numpy as np

def infer(inputs):
    x = inputs["x"]
    if (x[:, 0] == 1).any():
        big = np.empty({ask} << 20, dtype=np.uint8)
        x = x + (big.size > 0)
    return {{"y": x * 2, "pid": np.zeros((x.shape[0], 1), dtype=np.int64)}}
''')
    proc, ports = start_quern(QUERN, str(tmp_path))
    try:
        with pytest.raises(InferenceServerException) as e:
            plain_http({"ports": ports}, 1, "roomy")
        assert "MemoryError" in str(e.value) and f"quern.python.max_memory_mb = {bound_mb}" in str(e.value), \
            str(e.value)
        np.testing.assert_array_equal(plain_http({"ports": ports}, 2, "roomy").as_numpy("y"), [[4, 2, 4]])
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_model_over_its_memory_bound_fails_its_batch_clearly(tmp_path):
    write_model(tmp_path, "hungry", PLAIN_CONFIG + '''
parameters { key: "quern.python.max_memory_mb" value: { string_value: "512" } }
''', '''
import numpy as np

def infer(inputs):
    x = inputs["x"]
    if (x[:, 0] == 1).any():
        big = np.ones(20 << 30, dtype=np.uint8)  # 20 GiB
        x = x + big[0]
    return {"y": x * 2, "pid": np.zeros((x.shape[0], 1), dtype=np.int64)}
''')
    proc, ports = start_quern(QUERN, str(tmp_path))
    try:
        with pytest.raises(InferenceServerException) as e:
            plain_http({"ports": ports}, 1, "hungry")
        assert "MemoryError" in str(e.value) and "quern.python.max_memory_mb = 512" in str(e.value), str(e.value)
        np.testing.assert_array_equal(plain_http({"ports": ports}, 2, "hungry").as_numpy("y"), [[4, 2, 4]])
    finally:
        proc.terminate()
        proc.wait(timeout=30)


# Triton's auto-complete example (python_backend/examples/auto_complete) as its README lays it out:
# a folder holding 1/model.py alone; the model names its tensors and batching.
AUTO_COMPLETE = '''
import json
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        inputs = [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [4]},
                  {"name": "INPUT1", "data_type": "TYPE_FP32", "dims": [4]}]
        outputs = [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [4]},
                   {"name": "OUTPUT1", "data_type": "TYPE_FP32", "dims": [4]}]
        config = auto_complete_model_config.as_dict()
        input_names = [i["name"] for i in config["input"]]
        output_names = [o["name"] for o in config["output"]]
        for i in inputs:
            if i["name"] not in input_names:
                auto_complete_model_config.add_input(i)
        for o in outputs:
            if o["name"] not in output_names:
                auto_complete_model_config.add_output(o)
        auto_complete_model_config.set_max_batch_size(MAX_BATCH)
        if MAX_BATCH > 0:
            auto_complete_model_config.set_dynamic_batching()
        return auto_complete_model_config

    def initialize(self, args):
        self.config = json.loads(args["model_config"])
        assert self.config["input"][0]["dims"] == [4], self.config["input"][0]["dims"]
        assert self.config["max_batch_size"] == MAX_BATCH, self.config

    def execute(self, requests):
        out = []
        for r in requests:
            a = pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy()
            b = pb_utils.get_input_tensor_by_name(r, "INPUT1").as_numpy()
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", a + b), pb_utils.Tensor("OUTPUT1", a - b)]))
        return out
'''


def test_a_model_py_alone_describes_itself_with_auto_complete_config(tmp_path):
    for name, max_batch in (("batching", 4), ("nobatching", 0)):
        (tmp_path / name / "1").mkdir(parents=True)
        (tmp_path / name / "1" / "model.py").write_text(AUTO_COMPLETE.replace("MAX_BATCH", str(max_batch)))
    # A configuration that disagrees with what the model says: refused, naming both.
    write_model(tmp_path, "disagrees", 'backend: "python"\nmax_batch_size: 8\n',
                AUTO_COMPLETE.replace("MAX_BATCH", "4"))
    write_model(tmp_path, "wrong_type", 'backend: "python"\ninput [ { name: "INPUT0" data_type: TYPE_INT32 dims: [ 4 ] } ]\n',
                AUTO_COMPLETE.replace("MAX_BATCH", "0").replace('if i["name"] not in input_names:', "if True:"))
    # auto_complete_config makes the model decoupled (set_model_transaction_policy).
    write_model(tmp_path, "decoupled", 'backend: "python"\n', AUTO_COMPLETE.replace("MAX_BATCH", "0").replace(
        "        return auto_complete_model_config",
        "        auto_complete_model_config.set_model_transaction_policy(dict(decoupled=True))\n"
        "        return auto_complete_model_config"))
    (tmp_path / "silent" / "1").mkdir(parents=True)
    (tmp_path / "silent" / "1" / "model.py").write_text(PLAIN)
    proc, ports = start_quern(QUERN, str(tmp_path))
    try:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{ports['HTTP']}")
        index = {m["name"]: m for m in client.get_model_repository_index()}
        # What Triton's auto_complete client checks, over HTTP: the completed configuration, its integers
        # as numbers and max_batch_size there even when 0.
        for name, max_batch in (("batching", 4), ("nobatching", 0)):
            assert index[name]["state"] == "READY", index[name]
            config = client.get_model_config(name)
            assert config["max_batch_size"] == max_batch, config
            assert [(i["name"], i["data_type"], i["dims"]) for i in config["input"]] == \
                [("INPUT0", "TYPE_FP32", [4]), ("INPUT1", "TYPE_FP32", [4])], config
            assert [(o["name"], o["data_type"], o["dims"]) for o in config["output"]] == \
                [("OUTPUT0", "TYPE_FP32", [4]), ("OUTPUT1", "TYPE_FP32", [4])], config
            assert ("dynamic_batching" in config) == (max_batch > 0), config
            a = np.arange(4, dtype=np.float32).reshape(1, 4) if max_batch else np.arange(4, dtype=np.float32)
            inputs = [httpclient.InferInput("INPUT0", list(a.shape), "FP32"), httpclient.InferInput("INPUT1", list(a.shape), "FP32")]
            inputs[0].set_data_from_numpy(a)
            inputs[1].set_data_from_numpy(a * 10)
            r = client.infer(name, inputs)
            np.testing.assert_allclose(r.as_numpy("OUTPUT0"), a * 11)
            np.testing.assert_allclose(r.as_numpy("OUTPUT1"), a * -9)
        expect = {"disagrees": "max_batch_size 8, auto_complete_config 4",
                  "wrong_type": "input 'INPUT0': the configuration says TYPE_INT32, auto_complete_config TYPE_FP32",
                  "silent": "needs TritonPythonModel.auto_complete_config to name its inputs and outputs"}
        for name, text in expect.items():
            assert index[name]["state"] != "READY" and text in index[name]["reason"], (name, index[name])
        assert index["decoupled"]["state"] == "READY", index["decoupled"]
        assert client.get_model_config("decoupled")["model_transaction_policy"] == {"decoupled": True}
    finally:
        proc.terminate()
        proc.wait(timeout=30)


# Triton's BLS example (python_backend/examples/bls), its sync and async forms: a model that calls the
# model named by its input MODEL_NAME and answers with that model's outputs.
BLS = '''
import asyncio
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            name = pb_utils.get_input_tensor_by_name(request, "MODEL_NAME").as_numpy().reshape(-1)[0]  # bytes
            inputs = [pb_utils.get_input_tensor_by_name(request, "INPUT0"),
                      pb_utils.get_input_tensor_by_name(request, "INPUT1")]
            answer = pb_utils.InferenceRequest(model_name=name, requested_output_names=["OUTPUT0", "OUTPUT1"],
                                               inputs=inputs).exec()
            if answer.has_error():
                raise pb_utils.TritonModelException(answer.error().message())
            responses.append(pb_utils.InferenceResponse(output_tensors=answer.output_tensors()))
        return responses
'''

BLS_ASYNC = '''
import asyncio
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def execute(self, requests):
        responses = []
        for request in requests:
            inputs = [pb_utils.get_input_tensor_by_name(request, "INPUT0"),
                      pb_utils.get_input_tensor_by_name(request, "INPUT1")]
            calls = [pb_utils.InferenceRequest(model_name=m, requested_output_names=["OUTPUT0", "OUTPUT1"],
                                               inputs=inputs).async_exec() for m in ("add_sub", "add_sub_onnx")]
            first, second = await asyncio.gather(*calls)
            # OUTPUT0 from the Python add_sub, OUTPUT1 from the ONNX one
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.get_output_tensor_by_name(first, "OUTPUT0"),
                pb_utils.get_output_tensor_by_name(second, "OUTPUT1")]))
        return responses
'''

BLS_CONFIG = '''
backend: "python"
max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] }, { name: "INPUT1" data_type: TYPE_FP32 dims: [ 4 ] },
        { name: "MODEL_NAME" data_type: TYPE_STRING dims: [ 1 ] optional: true } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] }, { name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 4 ] } ]
'''


def test_a_python_model_calls_other_models_bls_sync_and_async(tmp_path):
    import shutil
    write_model(tmp_path, "add_sub", ADD_SUB_CONFIG, ADD_SUB)
    shutil.copytree(os.path.join(os.environ["QUERN_TEST_MODELS"], "add_sub"), tmp_path / "add_sub_onnx")
    write_model(tmp_path, "bls_sync", BLS_CONFIG, BLS)
    write_model(tmp_path, "bls_async", BLS_CONFIG, BLS_ASYNC)
    for name, callee in (("loop_a", "loop_b"), ("loop_b", "loop_a")):
        write_model(tmp_path, name, BLS_CONFIG, BLS.replace(
            'name = pb_utils.get_input_tensor_by_name(request, "MODEL_NAME").as_numpy().reshape(-1)[0]  # bytes',
            f'name = "{callee}"'))
    proc, ports = start_quern(QUERN, str(tmp_path))
    try:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{ports['HTTP']}")
        a = np.array([[1, 2, 3, 4]], np.float32)
        b = np.array([[10, 20, 30, 40]], np.float32)

        def call(model, name=None):
            inputs = [httpclient.InferInput("INPUT0", [1, 4], "FP32"), httpclient.InferInput("INPUT1", [1, 4], "FP32")]
            inputs[0].set_data_from_numpy(a)
            inputs[1].set_data_from_numpy(b)
            if name is not None:
                inputs.append(httpclient.InferInput("MODEL_NAME", [1, 1], "BYTES"))
                inputs[-1].set_data_from_numpy(np.array([[name.encode()]], dtype=object))
            return client.infer(model, inputs)

        for target in ("add_sub", "add_sub_onnx"):  # a Python model and an ONNX model, each called
            r = call("bls_sync", target)
            np.testing.assert_allclose(r.as_numpy("OUTPUT0"), a + b)
            np.testing.assert_allclose(r.as_numpy("OUTPUT1"), a - b)
        r = call("bls_async")
        np.testing.assert_allclose(r.as_numpy("OUTPUT0"), a + b)
        np.testing.assert_allclose(r.as_numpy("OUTPUT1"), a - b)
        # The called models counted the calls as their own requests.
        stats = {s["name"]: s["inference_count"] for s in client.get_inference_statistics()["model_stats"]}
        assert stats["add_sub"] >= 2 and stats["add_sub_onnx"] >= 2, stats
        # A model that does not exist, a model calling itself, and a loop of calls (loop_a calls
        # loop_b, which calls loop_a back): the call's error, named, at once.
        for model, target, text in (("bls_sync", "undefined_model", "undefined_model"),
                                    ("bls_sync", "bls_sync", "called itself"),
                                    ("bls_sync", "loop_a", "which is waiting for it already")):
            with pytest.raises(InferenceServerException) as e:
                call(model, target)
            assert text in str(e.value), str(e.value)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


# A model that calls `echo_bytes` (a Python model answering its UINT8 input and its sum) twice, with
# N and then N // 3 bytes, and answers both sums and whether the first answer's array still holds
# what it held once the second call had answered (the calls' tensors share one shared memory).
BLS_LARGE = '''
import numpy as np
import triton_python_backend_utils as pb_utils


def call(data, name):
    return pb_utils.InferenceRequest(model_name="echo_bytes", inputs=[pb_utils.Tensor("data", data)],
                                     requested_output_names=["same", "total"]).exec()


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            n = int(pb_utils.get_input_tensor_by_name(request, "n").as_numpy().reshape(-1)[0])
            first = (np.arange(n, dtype=np.int64) % 251).astype(np.uint8)
            second = (np.arange(n // 3, dtype=np.int64) % 13).astype(np.uint8)
            a, b = call(first, "first"), call(second, "second")
            for r in (a, b):
                if r.has_error():
                    raise pb_utils.TritonModelException(r.error().message())
            same_a = pb_utils.get_output_tensor_by_name(a, "same").as_numpy()
            kept = bool(np.array_equal(same_a, first))
            sums = [int(pb_utils.get_output_tensor_by_name(r, "total").as_numpy()[0]) for r in (a, b)]
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("sums", np.array(sums, np.int64)),
                                                   pb_utils.Tensor("kept", np.array([kept]))]))
        return out
'''

# Eight calls awaited together (async_exec runs each on a thread of its own, and they take turns):
# how many came back with their own data, not another call's.
BLS_GATHER = '''
import asyncio
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def execute(self, requests):
        out = []
        for request in requests:
            arrays = [np.full(4096 + 64 * k, k + 1, np.uint8) for k in range(8)]
            answers = await asyncio.gather(*[pb_utils.InferenceRequest(
                model_name="echo_bytes", inputs=[pb_utils.Tensor("data", a)],
                requested_output_names=["same", "total"]).async_exec() for a in arrays])
            own = sum(int(np.array_equal(pb_utils.get_output_tensor_by_name(r, "same").as_numpy(), a))
                      for r, a in zip(answers, arrays))
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("sums", np.array([own, 0], np.int64)),
                                                   pb_utils.Tensor("kept", np.array([own == 8]))]))
        return out
'''

# A model that writes BLS frames itself (through the stub's own functions, as model code can): inputs
# of the same 1 MiB of the slot twice, and an input past the bytes the call says its inputs take.
BLS_FORGED = '''
import struct
import __main__ as stub
import numpy as np
import triton_python_backend_utils as pb_utils


def forged(call, slot_bytes, tensors):
    name = b"echo_bytes"
    frame = (b"B" + stub._BLS.pack(call, -1, 0, 0, slot_bytes) + struct.pack("<H", len(name)) + name +
             struct.pack("<H", 0) + struct.pack("<I", 0) + struct.pack("<H", 0) + struct.pack("<H", len(tensors)))
    for size, offset in tensors:
        frame += struct.pack("<HBB", 4, 2, 1) + b"data" + struct.pack("<q", size) + struct.pack("<QQ", size, offset)
    with stub._bls_lock:
        stub._bls_slot().grow(2 << 20)
        stub._send(frame)
        reply = stub._next_frame()
    call_back, _, failed, code, length = struct.unpack_from("<IQBBI", reply, 1)
    return call_back == call and failed == 1, reply[19:19 + length].decode()


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            a = forged(90001, 1 << 20, [(1 << 20, 0), (1 << 20, 0)])
            b = forged(90002, 1 << 20, [(4096, (1 << 20) - 1024)])
            ok = a[0] and b[0] and "over another input" in a[1] and "outside the call" in b[1]
            if not ok:
                raise pb_utils.TritonModelException(repr((a, b)))
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("sums", np.array([1, 1], np.int64)),
                                                   pb_utils.Tensor("kept", np.array([True]))]))
        return out
'''

ECHO_BYTES = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            data = pb_utils.get_input_tensor_by_name(request, "data").as_numpy()
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("same", data.copy()),
                                                   pb_utils.Tensor("total", np.array([int(data.sum(dtype=np.int64))]))]))
        return out
'''


# Arrays of each kind a model may pass (big-endian, strided, empty, bool, float16, strings) to a model
# answering them unchanged: kept is whether every one came back equal, in value, type and shape.
BLS_TYPES = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            cases = [
                {"a": np.arange(6, dtype=">f4").reshape(2, 3), "b": np.arange(12, dtype=np.int64).reshape(3, 4)[:, ::2],
                 "c": np.array([True, False, True]), "d": np.arange(3, dtype=np.float16) / 3,
                 "e": np.array([b"ab", b"", "\u00e9t\u00e9".encode()], dtype=np.object_)},
                {"a": np.zeros((0, 3), np.float32), "b": np.zeros((2, 0), np.int64), "c": np.zeros(0, bool),
                 "d": np.zeros(0, np.float16), "e": np.array([], dtype=np.object_)},
            ]
            kept = []
            for case in cases:
                answer = pb_utils.InferenceRequest(model_name="echo_types",
                                                   inputs=[pb_utils.Tensor(k, v) for k, v in case.items()],
                                                   requested_output_names=list(case)).exec()
                if answer.has_error():
                    raise pb_utils.TritonModelException(answer.error().message())
                for k, v in case.items():
                    got = pb_utils.get_output_tensor_by_name(answer, k).as_numpy()
                    want = v.astype(v.dtype.newbyteorder("=")) if v.dtype.kind != "O" else v
                    kept.append(got.shape == v.shape and got.dtype == want.dtype and np.array_equal(got, want))
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("sums", np.array([sum(kept), len(kept)], np.int64)),
                                                   pb_utils.Tensor("kept", np.array([all(kept)]))]))
        return out
'''

ECHO_TYPES = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(k, pb_utils.get_input_tensor_by_name(r, k).as_numpy())
                                            for k in "abcde"]) for r in requests]
'''


def test_a_call_passes_arrays_of_every_kind_unchanged(tmp_path):
    write_model(tmp_path, "echo_types", '''
backend: "python"
max_batch_size: 0
input [ { name: "a" data_type: TYPE_FP32 dims: [ -1, -1 ] }, { name: "b" data_type: TYPE_INT64 dims: [ -1, -1 ] },
        { name: "c" data_type: TYPE_BOOL dims: [ -1 ] }, { name: "d" data_type: TYPE_FP16 dims: [ -1 ] },
        { name: "e" data_type: TYPE_STRING dims: [ -1 ] } ]
output [ { name: "a" data_type: TYPE_FP32 dims: [ -1, -1 ] }, { name: "b" data_type: TYPE_INT64 dims: [ -1, -1 ] },
         { name: "c" data_type: TYPE_BOOL dims: [ -1 ] }, { name: "d" data_type: TYPE_FP16 dims: [ -1 ] },
         { name: "e" data_type: TYPE_STRING dims: [ -1 ] } ]
''', ECHO_TYPES)
    write_model(tmp_path, "bls_types", '''
backend: "python"
max_batch_size: 0
input [ { name: "n" data_type: TYPE_INT64 dims: [ 1 ] } ]
output [ { name: "sums" data_type: TYPE_INT64 dims: [ 2 ] }, { name: "kept" data_type: TYPE_BOOL dims: [ 1 ] } ]
''', BLS_TYPES)
    proc, ports = start_quern(QUERN, str(tmp_path))
    try:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{ports['HTTP']}")
        x = httpclient.InferInput("n", [1], "INT64")
        x.set_data_from_numpy(np.array([0], np.int64))
        r = client.infer("bls_types", [x])
        assert r.as_numpy("sums").tolist() == [10, 10] and r.as_numpy("kept").tolist() == [True], r.as_numpy("sums")
    finally:
        stop_quern(proc)


def test_a_call_to_another_model_takes_tensors_larger_than_a_frame_through_shared_memory(tmp_path):
    """80 MiB to a called model and back (a frame holds at most 64 MiB: the tensors go through the
    BLS shared memory), then a smaller call: both sums as numpy computes them, and the first call's
    answer unchanged by the second (the arrays the caller gets are its own); eight calls awaited
    together each get their own answer; forged call frames are refused."""
    write_model(tmp_path, "echo_bytes", '''
backend: "python"
max_batch_size: 0
input [ { name: "data" data_type: TYPE_UINT8 dims: [ -1 ] } ]
output [ { name: "same" data_type: TYPE_UINT8 dims: [ -1 ] }, { name: "total" data_type: TYPE_INT64 dims: [ 1 ] } ]
''', ECHO_BYTES)
    write_model(tmp_path, "bls_large", '''
backend: "python"
max_batch_size: 0
input [ { name: "n" data_type: TYPE_INT64 dims: [ 1 ] } ]
output [ { name: "sums" data_type: TYPE_INT64 dims: [ 2 ] }, { name: "kept" data_type: TYPE_BOOL dims: [ 1 ] } ]
''', BLS_LARGE)
    write_model(tmp_path, "bls_gather", (tmp_path / "bls_large" / "config.pbtxt").read_text(), BLS_GATHER)
    write_model(tmp_path, "bls_forged", (tmp_path / "bls_large" / "config.pbtxt").read_text(), BLS_FORGED)
    proc, ports = start_quern(QUERN, str(tmp_path))
    try:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{ports['HTTP']}", network_timeout=120)
        for n in (80 << 20, 1000, 0):
            x = httpclient.InferInput("n", [1], "INT64")
            x.set_data_from_numpy(np.array([n], np.int64))
            r = client.infer("bls_large", [x])
            want = [int(((np.arange(n, dtype=np.int64) % 251)).sum()), int((np.arange(n // 3, dtype=np.int64) % 13).sum())]
            assert r.as_numpy("sums").tolist() == want, (n, r.as_numpy("sums"), want)
            assert r.as_numpy("kept").tolist() == [True], n
        for _ in range(5):
            x = httpclient.InferInput("n", [1], "INT64")
            x.set_data_from_numpy(np.array([0], np.int64))
            assert client.infer("bls_gather", [x]).as_numpy("sums").tolist() == [8, 0]
        # Frames a model forges: inputs over one another, or past the bytes the call declared, are
        # refused, the call's own error; the model and the server go on.
        assert client.infer("bls_forged", [x]).as_numpy("kept").tolist() == [True]
        assert client.infer("bls_large", [x]).as_numpy("kept").tolist() == [True]
    finally:
        stop_quern(proc)


# Custom metrics as Triton's example (python_backend/examples/custom_metrics) defines them: a family
# per kind, a series by labels, updated in execute(); three instances add to one series.
METRICS = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.rows = pb_utils.MetricFamily(name="requests_rows", description="Rows this model was asked for",
                                          kind=pb_utils.MetricFamily.COUNTER).Metric(
                                              labels={"model": "metered", "version": "1"})
        self.last = pb_utils.MetricFamily(name="last_row_sum", description="The sum of the last request's row",
                                          kind=pb_utils.MetricFamily.GAUGE).Metric(labels={"model": "metered"})
        self.sizes = pb_utils.MetricFamily(name="row_values", description="Values seen",
                                           kind=pb_utils.MetricFamily.HISTOGRAM).Metric(
                                               labels={"model": "metered"}, buckets=[1.0, 10.0, 100.0])
        self.bad = pb_utils.MetricFamily(name="quern_mine", description="not allowed",
                                         kind=pb_utils.MetricFamily.COUNTER).Metric()

    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "x").as_numpy()
            self.rows.increment(x.shape[0])
            self.last.set(float(x[-1].sum()))
            for v in x.reshape(-1):
                self.sizes.observe(float(v))
            try:
                self.rows.increment(-1)
            except ValueError:
                pass
            else:
                raise AssertionError("a counter took a negative increment")
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("y", x * 2)]))
        return out
'''


def test_a_python_models_own_metrics_reach_metrics(tmp_path):
    write_model(tmp_path, "metered", '''
backend: "python"
max_batch_size: 8
input [ { name: "x" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 4 ] } ]
dynamic_batching { }
instance_group [ { count: 3 kind: KIND_CPU } ]
''', METRICS)
    log = []
    proc, ports = start_quern(QUERN, str(tmp_path), log=log)
    try:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{ports['HTTP']}")
        sent = []
        for i in range(6):
            x = np.full((1 + i % 2, 4), float(i * 7), np.float32)
            inp = httpclient.InferInput("x", list(x.shape), "FP32")
            inp.set_data_from_numpy(x)
            client.infer("metered", [inp])
            sent.append(x)
        conn = http_client.HTTPConnection("127.0.0.1", ports["metrics"], timeout=30)
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
        assert "# HELP requests_rows Rows this model was asked for\n# TYPE requests_rows counter\n" in text, text[-3000:]
        rows = sum(x.shape[0] for x in sent)
        assert f'requests_rows{{model="metered",version="1"}} {rows}\n' in text, text[-3000:]
        assert f'last_row_sum{{model="metered"}} {int(sent[-1][-1].sum())}\n' in text, text[-3000:]
        values = np.concatenate([x.reshape(-1) for x in sent])
        for le, bound in (("1", 1.0), ("10", 10.0), ("100", 100.0), ("+Inf", np.inf)):
            assert f'row_values_bucket{{model="metered",le="{le}"}} {int((values <= bound).sum())}\n' in text, text[-3000:]
        assert f'row_values_count{{model="metered"}} {values.size}\n' in text
        assert "quern_mine" not in text  # the server's prefix: refused, and the log says so
        assert any("quern_mine" in line and "prefixes" in line for line in log), log[-20:]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


# Metrics changed while no batch runs: in initialize(), and by a thread of the model's own that ticks
# 200 times (a counter incremented and a gauge set each time), with no request ever sent.
IDLE_METRICS = '''
import threading
import time
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        pb_utils.MetricFamily(name="initialized", description="Processes that initialized",
                              kind=pb_utils.MetricFamily.COUNTER).Metric(labels={"model": "idle"}).increment(5)
        self.ticks = pb_utils.MetricFamily(name="ticks", description="Ticks of the model's own thread",
                                           kind=pb_utils.MetricFamily.COUNTER).Metric(labels={"model": "idle"})
        self.last = pb_utils.MetricFamily(name="last_tick", description="The last tick",
                                          kind=pb_utils.MetricFamily.GAUGE).Metric(labels={"model": "idle"})
        threading.Thread(target=self.tick, daemon=True).start()

    def tick(self):
        for k in range(1, 201):
            self.ticks.increment(1)
            self.last.set(k)
            if k % 20 == 0:
                time.sleep(0.01)

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.get_input_tensor_by_name(r, "x")]) for r in requests]
'''


def test_metrics_changed_while_no_batch_runs_reach_metrics(tmp_path):
    write_model(tmp_path, "idle", '''
backend: "python"
max_batch_size: 8
input [ { name: "x" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "x" data_type: TYPE_FP32 dims: [ 1 ] } ]
instance_group [ { count: 2 kind: KIND_CPU } ]
''', IDLE_METRICS)
    proc, ports = start_quern(QUERN, str(tmp_path))

    def scrape():
        conn = http_client.HTTPConnection("127.0.0.1", ports["metrics"], timeout=30)
        conn.request("GET", "/metrics")
        return conn.getresponse().read().decode()

    # Each of the two processes: initialized +5, ticks +200, last_tick set to 1..200 in order.
    want = ['initialized{model="idle"} 10\n', 'ticks{model="idle"} 400\n', 'last_tick{model="idle"} 200\n']
    try:
        text = ""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            text = scrape()
            if all(w in text for w in want):
                break
            time.sleep(0.1)
        assert all(w in text for w in want), f"without a batch /metrics shows: {text[-1500:]}"
        # A batch after it changes none of them.
        client = httpclient.InferenceServerClient(f"127.0.0.1:{ports['HTTP']}")
        x = httpclient.InferInput("x", [1, 1], "FP32")
        x.set_data_from_numpy(np.ones((1, 1), np.float32))
        assert client.infer("idle", [x]).as_numpy("x").tolist() == [[1.0]]
        text = scrape()
        assert all(w in text for w in want), text[-1500:]
        # A process killed while idle, seen first by a scrape: the scrape answers, and the next
        # requests are served by a process started again.
        def read(path):
            try:
                with open(path, "rb") as f:
                    return f.read()
            except OSError:  # (a process that ended meanwhile)
                return b""

        pids = [int(p) for p in os.listdir("/proc") if p.isdigit() and b"quern-python:idle:" in read(f"/proc/{p}/cmdline")]
        assert len(pids) == 2, pids
        os.kill(pids[0], signal.SIGKILL)
        wait_until(lambda: dead(pids[0]), what="the killed process to die")
        assert "last_tick" in scrape()
        for _ in range(4):
            assert client.infer("idle", [x]).as_numpy("x").tolist() == [[1.0]]
    finally:
        stop_quern(proc)


def test_metric_updates_waiting_to_be_sent_are_bounded(capfd):
    """What a model's metrics wait to send, read from pb_utils itself (no server): one operation per
    counter or gauge series however often it changes, and at most 100,000 operations."""
    import importlib.util
    path = os.path.join(os.path.dirname(__file__), "..", "..", "src", "backends", "python",
                        "triton_python_backend_utils.py")
    spec = importlib.util.spec_from_file_location("pb_utils_alone", path)
    pb = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pb)
    counter = pb.MetricFamily("c", "a counter", pb.MetricFamily.COUNTER).Metric(labels={"k": "1"})
    gauge = pb.MetricFamily("g", "a gauge", pb.MetricFamily.GAUGE).Metric()
    for k in range(250000):
        counter.increment(2)
        gauge.set(k)
    gauge.increment(0.5)
    ops = pb._take_metric_ops()
    assert [(o["op"], o["name"], o.get("value")) for o in ops] == [
        ("declare", "c", None), ("add", "c", 500000.0), ("declare", "g", None), ("set", "g", 249999.5)]
    histogram = pb.MetricFamily("h", "a histogram", pb.MetricFamily.HISTOGRAM).Metric(buckets=[1.0, 10.0])
    for k in range(100005):
        histogram.observe(k)
    histogram.observe(0.5)
    ops = pb._take_metric_ops()
    assert [(o["op"], o["name"]) for o in ops] == [("declare", "h"), ("observe", "h")]
    # values 0..100004 and 0.5: <= 1: 0, 0.5, 1; <= 10: 2..10; the rest above
    assert ops[1]["counts"] == [3, 9, 100005 - 11] and ops[1]["value"] == sum(range(100005)) + 0.5
    many = pb.MetricFamily("many", "a counter of many series", pb.MetricFamily.COUNTER)
    for k in range(100005):
        many.Metric(labels={"k": str(k)})  # each series exists from its Metric(): one operation each
    ops = pb._take_metric_ops()
    assert len(ops) == 100000 and ops[0]["op"] == "declare" and ops[-1]["labels"] == {"k": "99998"}
    assert "6 metric updates dropped" in capfd.readouterr().err  # 100,005 - (the declaration + 99,999 kept)
    # What Prometheus could not read is refused where the model makes it.
    for labels, buckets in (({"le": "x"}, [1.0]), ({}, [1.0, float("inf")]), ({}, [float("nan")])):
        with pytest.raises(ValueError):
            pb.MetricFamily("h2", "", pb.MetricFamily.HISTOGRAM).Metric(labels=labels, buckets=buckets)
    pb._take_metric_ops()
    # A sum past the floats is not merged: the server gets each finite value.
    gauge.set(1e308)
    gauge.increment(1e308)
    assert [o["value"] for o in pb._take_metric_ops()] == [1e308, 1e308]
    assert pb._take_metric_ops() == []


# Answers with request.parameters() (the JSON text); given {"call": ...} it asks model "params" instead
# (BLS), passing parameters of its own, and answers with what that model saw.
PARAMS = '''
import json
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            seen = request.parameters()
            if "bad" in json.loads(seen):  # a BLS request's parameters that are no JSON object of scalars
                refused = []
                for bad in ({"x": float("nan")}, '{"x": NaN}', {"x": [1]}, "[1]"):
                    try:
                        pb_utils.InferenceRequest(model_name="params", requested_output_names=["seen"],
                                                  inputs=[], parameters=bad)
                    except pb_utils.TritonModelException:
                        refused.append(True)
                seen = json.dumps({"refused": len(refused)})
            elif "call" in json.loads(seen):
                call = pb_utils.InferenceRequest(model_name="params", requested_output_names=["seen"],
                                                 inputs=[pb_utils.get_input_tensor_by_name(request, "x")],
                                                 parameters={"from": "bls", "n": 7})
                answer = call.exec()
                if answer.has_error():
                    raise pb_utils.TritonModelException(answer.error().message())
                seen = pb_utils.get_output_tensor_by_name(answer, "seen").as_numpy()[0].decode()
            # One answer per row of x: [1] unbatched, [1, 1] when the model batches.
            shape = pb_utils.get_input_tensor_by_name(request, "x").as_numpy().shape
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("seen", np.full(shape, seen.encode(), dtype=np.object_))]))
        self.executes.append(len(requests))
        return out

    def initialize(self, args):
        self.executes = []  # requests per execute(), printed by finalize: how the batches mixed

    def finalize(self):
        print("params: requests per execute", self.executes, flush=True)
'''
PARAMS_CONFIG = '''
backend: "python"
max_batch_size: 0
input [ { name: "x" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "seen" data_type: TYPE_STRING dims: [ 1 ] } ]
'''


def test_request_parameters_reach_the_model_over_every_way_in(tmp_path):
    """Triton's parameters extension: a request's own parameters reach the Python model as
    request.parameters() (JSON), over HTTP, gRPC and the generate route, through an ensemble's step and
    from a BLS call; the ones the server reads or reserves (priority, timeout, binary_data_output,
    sequence_*, headers, triton_*) do not; a value that is not a bool, number or string, and more than
    64 KiB of them, are refused naming the parameter."""
    write_model(tmp_path, "params", PARAMS_CONFIG, PARAMS)
    write_model(tmp_path, "params_caller", PARAMS_CONFIG, PARAMS)
    write_one_step_ensemble(tmp_path, "params_ensemble", "params", "x", "TYPE_FP32", "seen", "TYPE_STRING")
    # Batched: requests queued together (up to 100 ms) reach one execute(), each with its own.
    write_model(tmp_path, "params_batched", PARAMS_CONFIG.replace("max_batch_size: 0", "max_batch_size: 8") +
                "dynamic_batching { max_queue_delay_microseconds: 100000 }\n", PARAMS)
    proc, ports = start_quern(QUERN, str(tmp_path))
    try:
        x = np.ones((1,), np.float32)

        def http_seen(model, parameters):
            status, body = http_post(ports["HTTP"], f"/v2/models/{model}/infer", {
                "parameters": parameters,
                "inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1.0]}]})
            return status, (json.loads(json.loads(body)["outputs"][0]["data"][0]) if status == 200 else body)

        # HTTP, with the server's own and the reserved ones left out.
        assert http_seen("params", {"temperature": 0.5, "n": 3, "stop": "x\u00e9", "flag": True, "priority": 0,
                                    "timeout": 0, "binary_data_output": False, "sequence_id": 4, "headers": "h",
                                    "triton_enable_empty_final_response": True}) == (
            200, {"temperature": 0.5, "n": 3, "stop": "x\u00e9", "flag": True})
        assert http_seen("params", {}) == (200, {})
        # tritonclient over HTTP and gRPC.
        hc = httpclient.InferenceServerClient(f"127.0.0.1:{ports['HTTP']}")
        hi = httpclient.InferInput("x", [1], "FP32")
        hi.set_data_from_numpy(x)
        seen = hc.infer("params", [hi], parameters={"a": 1, "b": "two"}).as_numpy("seen")[0]
        assert json.loads(seen) == {"a": 1, "b": "two"}
        assert hc.infer("params", [hi]).as_numpy("seen")[0] == b"{}"
        gc = grpcclient.InferenceServerClient(f"127.0.0.1:{ports['gRPC']}")
        gi = grpcclient.InferInput("x", [1], "FP32")
        gi.set_data_from_numpy(x)
        seen = gc.infer("params", [gi], parameters={"b": "two", "a": 1, "c": True, "d": 0.25}).as_numpy("seen")[0]
        assert json.loads(seen) == {"a": 1, "b": "two", "c": True, "d": 0.25}
        assert gc.infer("params", [gi]).as_numpy("seen")[0] == b"{}"  # none set over gRPC: none seen
        # Requests of different parameters in one batch: each caller's own reach the model for it.
        bi = grpcclient.InferInput("x", [1, 1], "FP32")
        bi.set_data_from_numpy(np.ones((1, 1), np.float32))

        def batched(i):
            call = {} if i % 4 == 0 else {"caller": i, "word": f"w{i}"}
            got = gc.infer("params_batched", [bi], parameters=call).as_numpy("seen")
            return got.shape, json.loads(got[0][0]), call

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            for shape, got, call in pool.map(batched, range(24)):
                assert shape == (1, 1) and got == call, (got, call)
        # The generate route's "parameters".
        status, body = http_post(ports["HTTP"], "/v2/models/params/generate",
                                 {"x": [1.0], "parameters": {"max_tokens": 5}})
        assert status == 200 and json.loads(json.loads(body)["seen"]) == {"max_tokens": 5}, body
        # An ensemble's step sees the caller's; a BLS call carries the caller model's own.
        assert http_seen("params_ensemble", {"e": 1}) == (200, {"e": 1})
        assert http_seen("params_caller", {"call": True}) == (200, {"from": "bls", "n": 7})
        assert http_seen("params", {"bad": True}) == (200, {"refused": 4})
        # Refused, naming what is wrong.
        status, body = http_seen("params", {"x": [1, 2]})
        assert status == 400 and b"parameter 'x' must be a bool, a number or a string" in body, body
        status, body = http_seen("params", {"big": "a" * 70000})
        assert status == 400 and b"at most 65536" in body, body
        # Bytes that are no UTF-8 in a value: refused, the model never sees them.
        c = http_client.HTTPConnection("127.0.0.1", ports["HTTP"], timeout=60)
        c.request("POST", "/v2/models/params/infer", b'{"parameters": {"stop": "ab\xc3"}, "inputs": [{"name": "x", '
                  b'"datatype": "FP32", "shape": [1], "data": [1.0]}]}', {"Content-Type": "application/json"})
        r = c.getresponse()
        body = r.read()
        assert r.status == 400 and b"parameter 'stop' is not valid UTF-8" in body, body
        with pytest.raises(InferenceServerException, match="at most 65536"):
            gc.infer("params", [gi], parameters={"big": "a" * 70000})
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def http_post(port, path, doc):
    c = http_client.HTTPConnection("127.0.0.1", port, timeout=60)
    c.request("POST", path, json.dumps(doc), {"Content-Type": "application/json"})
    r = c.getresponse()
    return r.status, r.read()
