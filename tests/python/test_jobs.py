"""Asynchronous jobs over HTTP against a real `quern serve`: submit (POST /v2/models/{m}/jobs), poll
(GET /v2/jobs/{id}) and cancel (DELETE), with the embedded result store and with Redis. Expected outputs
come from numpy."""
import http.client
import json
import os
import re
import shutil
import threading
import time

import numpy as np
import pytest

from quern_testing import RedisServer, start_quern

QUERN = os.environ["QUERN_BIN"]
MODELS = os.environ["QUERN_TEST_MODELS"]
ID_RE = re.compile(r"[0-9a-f]{12}-[0-9a-f]{32}$")
TS_RE = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    d = tmp_path_factory.mktemp("repo")
    for m in ("add_sub", "slow_batch", "fail_on_3"):
        shutil.copytree(os.path.join(MODELS, m), d / m)
    # slow_batch with a queue of two: a third queued request is refused at once.
    os.makedirs(d / "small_queue" / "1")
    shutil.copy(os.path.join(MODELS, "slow_batch", "1", "model.onnx"), d / "small_queue" / "1" / "model.onnx")
    # (Batches that wait up to 30 s for company: what the tests do meanwhile cannot be too late, on a
    # busy machine too; they fill the batch, or cancel, rather than wait the delay out.)
    (d / "small_queue" / "config.pbtxt").write_text(
        "max_batch_size: 4\ndynamic_batching { max_queue_delay_microseconds: 30000000 "
        "default_queue_policy { max_queue_size: 2 } }\n")
    os.makedirs(d / "slow_cancel" / "1")
    shutil.copy(os.path.join(MODELS, "slow_batch", "1", "model.onnx"), d / "slow_cancel" / "1" / "model.onnx")
    (d / "slow_cancel" / "config.pbtxt").write_text(
        "max_batch_size: 4\ndynamic_batching { max_queue_delay_microseconds: 30000000 }\n")
    return str(d)


def start(repo, *extra):
    proc, ports = start_quern(QUERN, repo, *extra)
    return proc, ports["HTTP"], ports["metrics"]


@pytest.fixture(scope="module", params=["memory", "redis"])
def server(request, repo, tmp_path_factory):
    """A server with each result store: the embedded one, and a real redis-server."""
    redis_server, extra = None, []
    if request.param == "redis":
        redis_server = RedisServer(tmp_path_factory.mktemp("redis"))
        extra = ["--redis-url", redis_server.url(1)]
    proc, port, _ = start(repo, *extra)
    yield port
    proc.terminate()
    proc.wait(timeout=30)
    if redis_server:
        redis_server.stop()


@pytest.fixture
def store_kind(request):
    """The result store of the `server` this test runs against: "memory" or "redis"."""
    return request.node.callspec.params["server"]


def request(port, method, path, body=None, headers=None):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    if isinstance(body, (dict, list)):
        body = json.dumps(body)
    c.request(method, path, body=body, headers=headers or {})
    r = c.getresponse()
    data = r.read()
    out = (r.status, {k.lower(): v for k, v in r.getheaders()}, data)
    c.close()
    return out


def add_sub_body(a, b, **params):
    body = {"inputs": [{"name": "INPUT0", "shape": list(a.shape), "datatype": "FP32", "data": a.flatten().tolist()},
                       {"name": "INPUT1", "shape": list(b.shape), "datatype": "FP32", "data": b.flatten().tolist()}]}
    if params:
        body["parameters"] = params
    return body


def submit(port, model, body, headers=None):
    status, h, data = request(port, "POST", f"/v2/models/{model}/jobs", body, headers)
    assert status == 202, data
    j = json.loads(data)
    assert ID_RE.match(j["job_id"]) and j["status"] == "queued"
    assert h["location"] == f"/v2/jobs/{j['job_id']}"
    return j["job_id"]


def wait_finished(port, job_id, query="", timeout=20):
    deadline = time.time() + timeout
    while time.time() < deadline:
        status, h, data = request(port, "GET", f"/v2/jobs/{job_id}{query}")
        assert status == 200, data
        if h.get("content-type") == "application/octet-stream":
            return h, data
        j = json.loads(data)
        if j["status"] not in ("queued", "running"):
            return h, data
        time.sleep(0.01)
    raise AssertionError(f"job {job_id} did not finish")


def outputs_by_name(result):
    return {o["name"]: np.array(o["data"], np.float32).reshape(o["shape"]) for o in result["outputs"]}


def stats(port, model):
    status, _, data = request(port, "GET", f"/v2/models/{model}/stats")
    assert status == 200, data
    return json.loads(data)["model_stats"][0]


def test_submit_poll_json_result(server):
    a = np.arange(8, dtype=np.float32).reshape(2, 4)
    b = np.full((2, 4), 0.5, np.float32)
    job = submit(server, "add_sub", add_sub_body(a, b))
    _, data = wait_finished(server, job)
    j = json.loads(data)
    assert j["job_id"] == job and j["status"] == "done" and j["model_name"] == "add_sub" and j["model_version"] == "1"
    assert all(TS_RE.match(j[k]) for k in ("submitted", "started", "finished"))
    assert j["submitted"] <= j["started"] <= j["finished"]
    out = outputs_by_name(j["result"])
    np.testing.assert_array_equal(out["OUTPUT0"], a + b)
    np.testing.assert_array_equal(out["OUTPUT1"], a - b)
    # Polling again gives the same result (it stays until it expires).
    assert json.loads(request(server, "GET", f"/v2/jobs/{job}")[2])["result"] == j["result"]


def test_binary_inputs_and_outputs(server):
    a = np.random.default_rng(1).standard_normal((3, 4)).astype(np.float32)
    b = np.random.default_rng(2).standard_normal((3, 4)).astype(np.float32)
    header = json.dumps({
        "inputs": [{"name": n, "shape": [3, 4], "datatype": "FP32", "parameters": {"binary_data_size": 48}}
                   for n in ("INPUT0", "INPUT1")],
        "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": True}}, {"name": "OUTPUT1"}]}).encode()
    job = submit(server, "add_sub", header + a.tobytes() + b.tobytes(),
                 {"Inference-Header-Content-Length": str(len(header)), "Content-Type": "application/octet-stream"})
    h, data = wait_finished(server, job)
    n = int(h["inference-header-content-length"])
    j = json.loads(data[:n])
    assert j["status"] == "done"
    o0, o1 = j["result"]["outputs"]
    assert o0["name"] == "OUTPUT0" and o0["parameters"]["binary_data_size"] == 48 and "data" not in o0
    np.testing.assert_array_equal(np.frombuffer(data[n:n + 48], np.float32).reshape(3, 4), a + b)
    np.testing.assert_allclose(np.array(o1["data"], np.float32).reshape(3, 4), a - b, rtol=1e-6)
    assert len(data) == n + 48
    # The query overrides the submission's choice: everything as JSON, or everything binary.
    status, h, data = request(server, "GET", f"/v2/jobs/{job}?binary_data_output=false")
    assert status == 200 and "inference-header-content-length" not in h
    np.testing.assert_allclose(outputs_by_name(json.loads(data)["result"])["OUTPUT0"], a + b, rtol=1e-6)
    status, h, data = request(server, "GET", f"/v2/jobs/{job}?binary_data_output=true")
    n = int(h["inference-header-content-length"])
    assert len(data) == n + 96
    np.testing.assert_array_equal(np.frombuffer(data[n + 48:], np.float32).reshape(3, 4), a - b)


def test_bad_submissions_get_no_job_id(server):
    a = np.zeros((1, 4), np.float32)
    cases = [
        ("no_such_model", add_sub_body(a, a), 404, "no_such_model"),
        ("add_sub", add_sub_body(np.zeros((1, 3), np.float32), np.zeros((1, 3), np.float32)), 400, "INPUT0"),
        ("add_sub", "{not json", 400, "malformed JSON"),
        ("add_sub", {"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "INT32", "data": [1, 2, 3, 4]},
                                {"name": "INPUT1", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]},
         400, "INT32"),
    ]
    for model, body, code, needle in cases:
        status, _, data = request(server, "POST", f"/v2/models/{model}/jobs", body)
        assert status == code and needle in json.loads(data)["error"], (model, status, data)
        assert "job_id" not in json.loads(data)
    status, _, data = request(server, "GET", "/v2/models/add_sub/jobs")
    assert status == 405 and "POST" in json.loads(data)["error"]


def test_unknown_and_malformed_ids(server):
    unknown = f"{int(time.time() * 1000):012x}-0123456789abcdef"  # a job id of now that was never submitted
    status, _, data = request(server, "GET", f"/v2/jobs/{unknown}")
    assert status == 404 and f"no job '{unknown}'" in json.loads(data)["error"]
    status, _, data = request(server, "GET", "/v2/jobs/not-a-job")
    assert status == 404 and "not-a-job" in json.loads(data)["error"]
    status, _, data = request(server, "DELETE", "/v2/jobs/not-a-job")
    assert status == 404


def test_in_memory_jobs_from_before_a_restart_are_gone_not_unknown(repo):
    """Without Redis a job lives in the process: the 202 says "durable": false, and after a restart
    its id answers 410 with the reason, while an id never issued answers 404."""
    proc, port, _ = start(repo)
    try:
        status, _, data = request(port, "POST", "/v2/models/add_sub/jobs",
                                  add_sub_body(np.ones((1, 4), np.float32), np.ones((1, 4), np.float32)))
        job = json.loads(data)
        assert status == 202 and job["durable"] is False, data
        wait_finished(port, job["job_id"])
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    proc, port, _ = start(repo)
    try:
        for method in ("GET", "DELETE"):
            status, _, data = request(port, method, f"/v2/jobs/{job['job_id']}")
            assert status == 410, (method, status, data)
            assert "the server restarted after this job was accepted; its result is lost" in json.loads(data)["error"]
        never = f"{int(time.time() * 1000) + 60_000:012x}-{'0' * 32}"
        assert request(port, "GET", f"/v2/jobs/{never}")[0] == 404
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_failed_job_keeps_its_error(server):
    # fail_on_3 reshapes x to [N, 4]: an input of [1, 3] fails inside ONNX Runtime.
    body = {"inputs": [{"name": "x", "shape": [1, 3], "datatype": "FP32", "data": [1.0, 2.0, 3.0]}]}
    job = submit(server, "fail_on_3", body)
    j = json.loads(wait_finished(server, job)[1])
    assert j["status"] == "failed" and "fail_on_3" in j["error"] and "result" not in j


def test_cancel_a_queued_job_is_never_computed(server, store_kind):
    if store_kind == "redis":
        pytest.skip("with Redis a job waits in the stream until an instance takes it: test_redis.py cancels there")
    before = stats(server, "slow_cancel")
    body = {"inputs": [{"name": "x", "shape": [1, 3], "datatype": "FP32", "data": [1, 2, 3]}]}
    job = submit(server, "slow_cancel", body)  # waits up to 30 s for a batch of 4 to fill
    j = json.loads(request(server, "GET", f"/v2/jobs/{job}")[2])
    assert j["status"] == "queued" and j["started"] is None and j["finished"] is None
    status, _, data = request(server, "DELETE", f"/v2/jobs/{job}")
    assert status == 200 and json.loads(data) == {"job_id": job, "status": "cancelled"}
    status, _, data = request(server, "DELETE", f"/v2/jobs/{job}")
    assert status == 409 and "cancelled" in json.loads(data)["error"]
    j = json.loads(wait_finished(server, job)[1])
    assert j["status"] == "cancelled" and "cancelled" in j["error"] and j["started"] is None
    # Four more fill a batch at once: it holds those four, not the cancelled one.
    full = [submit(server, "slow_cancel", body) for _ in range(4)]
    for other in full:
        assert json.loads(wait_finished(server, other)[1])["status"] == "done"
    after = stats(server, "slow_cancel")
    assert after["execution_count"] - before["execution_count"] == 1, after
    assert after["inference_count"] - before["inference_count"] == 4, after
    # A finished job cannot be cancelled.
    done = submit(server, "add_sub", add_sub_body(np.ones((1, 4), np.float32), np.ones((1, 4), np.float32)))
    wait_finished(server, done)
    status, _, data = request(server, "DELETE", f"/v2/jobs/{done}")
    assert status == 409 and "already finished (done)" in json.loads(data)["error"]


def test_full_queue_refuses_the_submission_at_once(server, store_kind):
    if store_kind == "redis":
        pytest.skip("with Redis the stream is the queue: a submission waits there for an instance to take it")
    body = {"inputs": [{"name": "x", "shape": [1, 3], "datatype": "FP32", "data": [1, 2, 3]}]}
    jobs = [submit(server, "small_queue", body) for _ in range(2)]
    # Refused, not held until there is room: the two wait for company (up to 30 s).
    status, _, data = request(server, "POST", "/v2/models/small_queue/jobs", body)
    assert status == 503 and "queue" in json.loads(data)["error"], data
    for job in jobs:  # (cancelled: the delay is not waited out)
        status, _, data = request(server, "DELETE", f"/v2/jobs/{job}")
        assert status == 200, data
        assert json.loads(wait_finished(server, job)[1])["status"] == "cancelled"
    # The cancelled ones left the queue: two more are taken (and cancelled, so
    # that nothing waits out the delay, a stop neither).
    for _ in range(2):
        again = submit(server, "small_queue", body)
        status, _, data = request(server, "DELETE", f"/v2/jobs/{again}")
        assert status == 200, data


def test_many_concurrent_jobs_each_get_their_own_result(server):
    results, errors = {}, []

    def client(k):
        try:
            a = np.full((1, 4), k, np.float32)
            b = np.arange(4, dtype=np.float32).reshape(1, 4) * k
            job = submit(server, "add_sub", add_sub_body(a, b))
            out = outputs_by_name(json.loads(wait_finished(server, job)[1])["result"])
            results[k] = (out["OUTPUT0"], a + b, out["OUTPUT1"], a - b)
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(48)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert len(results) == 48
    for got0, want0, got1, want1 in results.values():
        np.testing.assert_array_equal(got0, want0)
        np.testing.assert_array_equal(got1, want1)


def test_ttl_and_eviction(repo):
    proc, port, metrics = start(repo, "--job-result-ttl-secs", "1", "--job-store-max-bytes", "3000")
    try:
        one = np.ones((1, 4), np.float32)
        first = submit(port, "add_sub", add_sub_body(one, one))
        wait_finished(port, first)
        # Each add_sub result holds two 16-byte outputs plus bookkeeping (~700 bytes): a handful fit
        # in 3000 bytes, so later results evict the first one.
        later = []
        for k in range(8):
            later.append(submit(port, "add_sub", add_sub_body(one * k, one)))
            wait_finished(port, later[-1])
        status, _, data = request(port, "GET", f"/v2/jobs/{first}")
        assert status == 404 and "evicted" in json.loads(data)["error"]
        status, _, data = request(port, "GET", f"/v2/jobs/{later[-1]}")
        assert status == 200
        time.sleep(1.3)
        status, _, data = request(port, "GET", f"/v2/jobs/{later[-1]}")
        assert status == 404 and "expired" in json.loads(data)["error"]
        # An id from more than a TTL ago that this server never held also reads as expired...
        never_held = f"{int(first.split('-')[0], 16) + 1:012x}-{'0' * 32}"
        status, _, data = request(port, "GET", f"/v2/jobs/{never_held}")
        assert status == 404 and "expired" in json.loads(data)["error"], data
        # ... and one from before the server started as gone with the process before it.
        old = f"{int(time.time() * 1000) - 60_000:012x}-0123456789abcdef"
        status, _, data = request(port, "GET", f"/v2/jobs/{old}")
        assert status == 410 and "restarted" in json.loads(data)["error"], data
        text = request(metrics, "GET", "/metrics")[2].decode()
        assert re.search(r'^quern_jobs_finished_total\{status="done"\} 9$', text, re.M), text
        assert re.search(r"^quern_jobs_submitted_total 9$", text, re.M)
        assert re.search(r"^quern_jobs_pending 0$", text, re.M)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
