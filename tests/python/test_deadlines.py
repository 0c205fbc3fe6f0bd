"""Deadline-aware admission through the front ends, with real clients: a request whose deadline (a gRPC
call's deadline) or queue timeout (the KServe `timeout` parameter) cannot be met behind the work already
in the model is refused at once (HTTP 503 with Retry-After, gRPC UNAVAILABLE) instead of failing after
waiting; one that can be met is served. The model is a Python model that sleeps, so the work ahead of a
request is known: 0.4 s per request, one at a time; while a gate file exists its run waits for it, so
that the work ahead stays queued for as long as the test looks at it (on a busy machine too)."""
import os
import textwrap
import threading
from concurrent.futures import ThreadPoolExecutor
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from quern_testing import start_quern, wait_until

QUERN = os.environ["QUERN_BIN"]
STEP_S = 0.4

SLOW = '''
import os
import time

def infer(inputs):
    while os.path.exists({gate!r}):
        time.sleep(0.01)
    time.sleep({step})
    return {{"y": inputs["x"] + 1}}
'''

SLOW_CONFIG = '''
backend: "python"
max_batch_size: 1
input [ { name: "x" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 1 ] } ]
dynamic_batching { }
instance_group [ { count: 1 kind: KIND_CPU } ]
'''


# Batches wait up to 3 s for company, but each request should be answered within 300 ms.
TARGETED = '''
import time

def infer(inputs):
    time.sleep(0.01)
    return {"y": inputs["x"] * 2}
'''

TARGETED_CONFIG = '''
backend: "python"
max_batch_size: 16
input [ { name: "x" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 1 ] } ]
dynamic_batching { max_queue_delay_microseconds: 3000000 }
instance_group [ { count: 1 kind: KIND_CPU } ]
parameters { key: "quern.latency_target_ms" value: { string_value: "300" } }
'''


GATE = {}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    GATE["path"] = str(tmp_path_factory.mktemp("gate") / "closed")
    untargeted = "\n".join(line for line in TARGETED_CONFIG.splitlines() if "latency_target" not in line)
    slow = SLOW.format(gate=GATE["path"], step=STEP_S)
    for name, config, code in (("slow", SLOW_CONFIG, slow), ("targeted", TARGETED_CONFIG, TARGETED),
                               ("untargeted", untargeted, TARGETED)):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "config.pbtxt").write_text(textwrap.dedent(config))
        (repo / name / "1" / "model.py").write_text(code)
    proc, ports = start_quern(QUERN, str(repo))
    yield ports
    proc.terminate()
    proc.wait(timeout=30)


def http_inputs(value):
    x = httpclient.InferInput("x", [1, 1], "FP32")
    x.set_data_from_numpy(np.full((1, 1), value, np.float32))
    return [x]


def grpc_inputs(value):
    x = grpcclient.InferInput("x", [1, 1], "FP32")
    x.set_data_from_numpy(np.full((1, 1), value, np.float32))
    return [x]


def queue_work(ports, n):
    """n requests without a deadline, sent at once from threads; returns the threads and their answers."""
    answers = {}

    def send(i):
        c = httpclient.InferenceServerClient(f"127.0.0.1:{ports['HTTP']}", network_timeout=60)
        answers[i] = c.infer("slow", http_inputs(i)).as_numpy("y")[0, 0]

    threads = [threading.Thread(target=send, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    return threads, answers


def runs_done(ports):
    """Items the model has run, from the statistics API."""
    c = httpclient.InferenceServerClient(f"127.0.0.1:{ports['HTTP']}")
    return int(c.get_inference_statistics("slow")["model_stats"][0]["inference_count"])


def test_a_request_that_cannot_meet_its_deadline_is_refused_at_once(server):
    http = httpclient.InferenceServerClient(f"127.0.0.1:{server['HTTP']}", network_timeout=60)
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{server['gRPC']}")
    assert grpc.is_server_live()  # (the channel connected: the deadline below is the call's alone)
    # One request alone: the model's time per request is measured (0.4 s).
    assert http.infer("slow", http_inputs(1)).as_numpy("y")[0, 0] == 2
    done_before = runs_done(server)
    open(GATE["path"], "w").close()  # the next run waits for the gate: the queue stays as it is
    try:
        threads, answers = queue_work(server, 4)
        # Wait until the four are in the model: one running (held), three queued (1.2 s of work and more).
        wait_until(lambda: _queued(server) >= 3, timeout=30, what="three requests queued behind a running one")

        # gRPC: a deadline of 1 s cannot be met behind ~1.2-1.6 s of work: UNAVAILABLE, at once. (Had
        # it waited, the client's own deadline would have ended the call first: DEADLINE_EXCEEDED.)
        with pytest.raises(InferenceServerException) as e:
            grpc.infer("slow", grpc_inputs(5), client_timeout=1.0)
        assert e.value.status() == "StatusCode.UNAVAILABLE", (e.value.status(), e.value.message())
        assert "after its deadline" in e.value.message() and "refused at once" in e.value.message()

        # HTTP: the KServe `timeout` parameter (the most it may wait in the queue) of 0.3 s: 503 with
        # Retry-After, refused on arrival (a request that waited out its timeout says so otherwise).
        with pytest.raises(InferenceServerException) as e:
            http.infer("slow", http_inputs(6), timeout=300_000)
        assert e.value.status() == "503", (e.value.status(), e.value.message())
        assert "longer than its queue timeout of 300 ms" in e.value.message(), e.value.message()
        raw = _raw_post(server["HTTP"], "/v2/models/slow/infer",
                        b'{"inputs":[{"name":"x","shape":[1,1],"datatype":"FP32","data":[7]}],'
                        b'"parameters":{"timeout":300000}}')
        assert raw[0] == 503 and raw[1].get("retry-after") == "1", raw
        assert _queued(server) >= 3, "the work ahead was still queued while the refusals were checked"
    finally:
        if os.path.exists(GATE["path"]):
            os.unlink(GATE["path"])  # the held run goes on
    # A deadline that leaves room for the work ahead is served, with its own answer.
    assert grpc.infer("slow", grpc_inputs(8), client_timeout=20).as_numpy("y")[0, 0] == 9
    for t in threads:
        t.join(timeout=30)
    assert answers == {i: i + 1 for i in range(4)}, answers
    assert runs_done(server) == done_before + 5, "the refused requests never ran"


def _queued(ports):
    """Requests waiting in the model's queue, from the server's own gauge."""
    import urllib.request
    body = urllib.request.urlopen(f"http://127.0.0.1:{ports['metrics']}/metrics", timeout=10).read().decode()
    total = 0.0
    for line in body.splitlines():
        if line.startswith("quern_pending_requests{") and 'model="slow"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def _raw_post(port, path, body):
    import http.client
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    c.request("POST", path, body=body, headers={"Content-Type": "application/json"})
    r = c.getresponse()
    data = r.read()
    headers = {k.lower(): v for k, v in r.getheaders()}
    c.close()
    return r.status, headers, data


def test_a_latency_target_sends_a_batch_in_time_instead_of_waiting_out_the_batching_delay(server):
    def timed(model, value):
        # A client per call: tritonclient's HTTP client belongs to the thread that made it.
        http = httpclient.InferenceServerClient(f"127.0.0.1:{server['HTTP']}", network_timeout=60)
        t0 = time.monotonic()
        y = http.infer(model, http_inputs(value)).as_numpy("y")[0, 0]
        assert y == 2 * value
        return time.monotonic() - t0
    # Without a target, a lone request waits out the 3 s batching delay for company.
    assert timed("untargeted", 1) >= 2.5
    # With one, a request alone in the model (as many as it held on average lately) brings no company to
    # wait for: it leaves at once, measured or not. (How long a batch that does expect company waits is
    # in batch_queue_test: until its target, less its running time.)
    # (Under 2 s: far from the 3 s delay, with room for a busy machine.)
    for value in (1, 2, 3):
        assert timed("targeted", value) < 2.0
    # Two clients at a time, each on its own answer.
    with ThreadPoolExecutor(2) as pool:
        assert all(t < 2.0 for t in pool.map(lambda v: timed("targeted", v), range(4, 12)))


def test_timeouts_at_the_ends_of_their_range_are_served(server):
    """The KServe `timeout` parameter is any unsigned 64-bit number of microseconds: the largest values
    (once negative as signed, once overflowing when made nanoseconds) mean "wait as long as it takes"."""
    for timeout in (2**64 - 1, 2**63 - 1, 9_223_372_036_854_775):
        status, _, body = _raw_post(server["HTTP"], "/v2/models/targeted/infer",
                                    b'{"inputs":[{"name":"x","shape":[1,1],"datatype":"FP32","data":[7]}],'
                                    b'"parameters":{"timeout":%d}}' % timeout)
        assert status == 200, (timeout, body)
