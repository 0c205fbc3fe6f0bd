"""`quern perf` against a real `quern serve`: what the tool says it sent is what the server counted
(the server's own quern_request_success_total, read by this test), its figures are self-consistent,
and bad options, unknown models and failing requests give clear errors and exit codes."""
import json
import os
import re
import shutil
import subprocess
import time

import numpy as np
import pytest

from quern_testing import http_request, start_quern

QUERN = os.environ["QUERN_BIN"]
MODELS = os.environ["QUERN_TEST_MODELS"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    for m in ("add_sub", "fail_on_3"):
        shutil.copytree(os.path.join(MODELS, m), repo / m)
    proc, ports = start_quern(QUERN, str(repo))
    yield ports
    proc.terminate()
    proc.wait(timeout=30)


def successes(ports, model):
    _, _, body = http_request(ports["metrics"], "GET", "/metrics")
    return sum(float(m.group(1)) for m in re.finditer(
        r'^quern_request_success_total\{[^}]*model="' + re.escape(model) + r'"[^}]*\} (\S+)$', body.decode(), re.M))


def perf(ports, *args, expect=0, grpc=False):
    url = f"grpc://127.0.0.1:{ports['gRPC']}" if grpc else f"http://127.0.0.1:{ports['HTTP']}"
    r = subprocess.run([QUERN, "perf", "--url", url, *args], capture_output=True, text=True, timeout=120)
    assert expect is None or r.returncode == expect, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    return r


def levels(r):
    return json.loads(r.stdout)["levels"]


@pytest.mark.parametrize("tensors,grpc,kind", [([], False, "binary"), (["--json"], False, "json"),
                                               ([], True, "grpc"), (["--grpc-stream"], True, "grpc_stream")],
                         ids=["binary", "json", "grpc", "grpc-stream"])
def test_closed_loop_sends_what_the_server_counts(server, tensors, grpc, kind):
    before = successes(server, "add_sub")
    r = perf(server, "-m", "add_sub", "-c", "1", "3", "-s", "0.7", "--warmup", "0.2", "--format", "json",
             "--metrics-url", f"http://127.0.0.1:{server['metrics']}/metrics", *tensors, grpc=grpc)
    after = successes(server, "add_sub")
    assert json.loads(r.stdout)["tensors"] == kind
    out = levels(r)
    assert [(lv["mode"], lv["value"]) for lv in out] == [("concurrency", 1), ("concurrency", 3)]
    # Every request the tool counted answered was one the server counted, and no other.
    assert after - before == sum(lv["completed_total"] for lv in out)
    for lv in out:
        assert lv["errors"] == 0 and lv["error_kinds"] == {}
        assert lv["ok"] > 0 and lv["completed_total"] >= lv["ok"]
        assert abs(lv["requests_per_s"] - lv["ok"] / 0.7) < 1e-6 * lv["ok"] + 1e-9
        p = lv["latency_ms"]
        assert 0 < p["p50"] <= p["p90"] <= p["p95"] <= p["p99"]
        # The server's figures over the window: its CPU per request, and add_sub's batches.
        assert lv["server_cpu_us_per_request"] > 0 and lv["client_cpu_us_per_request"] > 0
        assert lv["server_batch_size"] >= 1 and lv["server_compute_us"] >= 0 and lv["server_queue_us"] >= 0


def test_several_requests_in_flight_per_stream(server):
    before = successes(server, "add_sub")
    r = perf(server, "-m", "add_sub", "--grpc-stream", "--stream-inflight", "8", "-c", "2", "-s", "0.8", "--warmup",
             "0.2", "--format", "json", grpc=True)
    after = successes(server, "add_sub")
    (lv,) = levels(r)
    assert lv["errors"] == 0 and lv["ok"] > 0, lv
    # Every answer read was one the server counted; at the end, at most the 2 x 8 in flight were
    # answered by the server and not read.
    assert lv["completed_total"] <= after - before <= lv["completed_total"] + 16
    # Latency runs from each request's own send (answers matched by id): with 16 in flight,
    # requests/s x mean latency is about 16 (Little's law), where timing the reads would give 2.
    in_flight = lv["requests_per_s"] * lv["latency_ms"]["mean"] / 1000
    assert 10 < in_flight < 20, (in_flight, lv)
    # Failing requests come back matched too, counted by kind.
    r = perf(server, "-m", "fail_on_3", "--shape", "x=1,3", "-s", "0.3", "--warmup", "0", "--format", "json",
             "--grpc-stream", "--stream-inflight", "4", expect=1, grpc=True)
    (lv,) = levels(r)
    assert lv["ok"] == 0 and list(lv["error_kinds"]) == ["stream error"], lv["error_kinds"]
    for args, says in ((["--stream-inflight", "0", "--grpc-stream"], "--stream-inflight is 1-1024"),
                       (["--stream-inflight", "2"], "needs --grpc-stream"),
                       (["--stream-inflight", "2", "--grpc-stream", "-r", "100"], "closed loop")):
        r = perf(server, "-m", "add_sub", *args, expect=2, grpc=True)
        assert says in r.stderr, (args, r.stderr)


def test_open_loop_sends_at_the_rate_asked(server):
    before = successes(server, "add_sub")
    r = perf(server, "-m", "add_sub", "-r", "300", "-s", "1", "--warmup", "0.3", "--format", "json")
    after = successes(server, "add_sub")
    (lv,) = levels(r)
    assert lv["mode"] == "rate" and lv["errors"] == 0
    # Requests were due at 300/s over the 1 s window: those answered inside it (a slow machine
    # answers the last few after the window; a busy one, more of them). Never more than were due:
    # the rate is what is tested; how many a loaded machine answers in time is not.
    assert 100 <= lv["ok"] <= 301, lv
    assert after - before == lv["completed_total"]
    assert lv["ok"] <= lv["completed_total"] <= 1.3 * 300 + 1


def test_inputs_from_npy_files_and_shapes_for_open_dimensions(server, tmp_path):
    a = tmp_path / "a.npy"
    np.save(a, np.arange(8, dtype=np.float32).reshape(2, 4))
    r = perf(server, "-m", "add_sub", "-i", f"INPUT0={a}", "--shape", "INPUT1=2,4", "-s", "0.3", "--warmup", "0",
             "--format", "json")
    (lv,) = levels(r)
    assert lv["ok"] > 0 and lv["errors"] == 0
    # A file whose type is not the model's, a shape of the wrong rank, an input the model lacks.
    b = tmp_path / "b.npy"
    np.save(b, np.zeros((1, 4), np.float64))
    for args, says in ((["-i", f"INPUT0={b}"], "FP64"), (["--shape", "INPUT1=4"], "2 dimensions"),
                       (["-i", "NOPE=zeros"], "no such input"), (["-i", f"INPUT0={tmp_path}/missing.npy"], "INPUT0")):
        r = perf(server, "-m", "add_sub", "-s", "0.2", *args, expect=2)
        assert says in r.stderr, r.stderr


def test_failing_requests_are_counted_by_kind(server):
    # fail_on_3 reshapes its input to [N, 4]: given [1, 3] every request fails in the backend.
    r = perf(server, "-m", "fail_on_3", "--shape", "x=1,3", "-c", "2", "-s", "0.4", "--warmup", "0", "--format",
             "json", expect=1)
    (lv,) = levels(r)
    assert lv["ok"] == 0 and lv["errors"] > 0
    assert list(lv["error_kinds"]) == ["HTTP 500"]
    kind = lv["error_kinds"]["HTTP 500"]
    assert kind["count"] == lv["errors"] and "fail_on_3" in kind["first"]
    assert lv["latency_ms"]["p50"] is None
    # The same model with the shape it takes: no errors.
    (lv,) = levels(perf(server, "-m", "fail_on_3", "--shape", "x=1,4", "-s", "0.3", "--warmup", "0", "--format",
                        "json"))
    assert lv["ok"] > 0 and lv["errors"] == 0


def test_unknown_model_closed_port_and_bad_options_are_clear(server):
    r = perf(server, "-m", "nope", "-s", "0.2", expect=2)
    assert "model 'nope'" in r.stderr and "404" in r.stderr
    r = subprocess.run([QUERN, "perf", "--url", "http://127.0.0.1:1", "-m", "add_sub", "-s", "0.2"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "connect" in r.stderr
    for args, says in ((["-c", "0"], "--concurrency"), (["-c", "1", "-r", "10"], "not both"),
                       (["--format", "xml"], "--format"), (["-s", "0"], "--seconds"),
                       (["--metrics-url", "ftp://x"], "--metrics-url")):
        r = perf(server, "-m", "add_sub", *args, expect=2)
        assert says in r.stderr, (args, r.stderr)


def test_table_and_csv_formats(server):
    r = perf(server, "-m", "add_sub", "-c", "2", "-s", "0.3", "--warmup", "0")
    lines = r.stdout.splitlines()
    assert lines[0].startswith("model add_sub at") and "INPUT0 FP32 [1,4]" in lines[0]
    assert lines[1].split()[:2] == ["concurrency", "req/s"]
    assert lines[2].split()[0] == "2" and float(lines[2].split()[1]) > 0
    r = perf(server, "-m", "add_sub", "-c", "1", "2", "-s", "0.3", "--warmup", "0", "--format", "csv")
    rows = [line.split(",") for line in r.stdout.strip().splitlines()]
    assert rows[0][:3] == ["mode", "value", "requests_per_s"] and len(rows) == 3
    assert all(len(row) == len(rows[0]) for row in rows) and [row[1] for row in rows[1:]] == ["1", "2"]


def test_failing_requests_are_counted_by_kind_over_grpc_too(server):
    r = perf(server, "-m", "fail_on_3", "--shape", "x=1,3", "-c", "2", "-s", "0.4", "--warmup", "0", "--format",
             "json", expect=1, grpc=True)
    (lv,) = levels(r)
    assert lv["ok"] == 0 and list(lv["error_kinds"]) == ["gRPC INTERNAL"], lv["error_kinds"]
    assert "fail_on_3" in lv["error_kinds"]["gRPC INTERNAL"]["first"]
    r = perf(server, "-m", "fail_on_3", "--shape", "x=1,3", "-s", "0.3", "--warmup", "0", "--format", "json",
             "--grpc-stream", expect=1, grpc=True)
    (lv,) = levels(r)
    assert lv["ok"] == 0 and list(lv["error_kinds"]) == ["stream error"], lv["error_kinds"]
    assert "fail_on_3" in lv["error_kinds"]["stream error"]["first"]


def test_deadlines_are_sent_and_answers_after_them_counted(server):
    # A deadline every answer meets: none counted late, none refused.
    for args, grpc in ((["--deadline-ms", "5000"], False), (["--deadline-ms", "5000"], True),
                       (["--deadline-ms", "5000", "--grpc-stream"], True)):
        r = perf(server, "-m", "add_sub", "-c", "2", "-s", "0.4", "--warmup", "0", "--format", "json", *args,
                 grpc=grpc)
        doc = json.loads(r.stdout)
        assert doc["deadline_ms"] == 5000
        (lv,) = doc["levels"]
        assert lv["ok"] > 0 and lv["errors"] == 0 and lv["past_deadline"] == 0, lv
    # A deadline shorter than any answer can come (1 µs): each call fails at its deadline, is refused by
    # the server (which knows add_sub takes longer), or is answered and counted as after its deadline.
    r = perf(server, "-m", "add_sub", "-s", "0.3", "--warmup", "0", "--format", "json", "--deadline-ms", "0.001",
             expect=None, grpc=True)
    (lv,) = levels(r)
    assert lv["ok"] + lv["errors"] > 0 and lv["ok"] == lv["past_deadline"], lv
    assert set(lv["error_kinds"]) <= {"gRPC DEADLINE_EXCEEDED", "gRPC UNAVAILABLE"}, lv["error_kinds"]
    assert r.returncode == (0 if lv["ok"] else 1)


def test_grpc_unknown_model_closed_port_and_bad_options_are_clear(server):
    r = perf(server, "-m", "nope", "-s", "0.2", expect=2, grpc=True)
    assert "model 'nope'" in r.stderr, r.stderr
    r = subprocess.run([QUERN, "perf", "--url", "grpc://127.0.0.1:1", "-m", "add_sub", "-s", "0.2", "--timeout", "2"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "UNAVAILABLE" in r.stderr, r.stderr
    for args, says in ((["--json"], "--json is for HTTP"), (["--deadline-ms", "-1"], "--deadline-ms")):
        r = perf(server, "-m", "add_sub", *args, expect=2, grpc=True)
        assert says in r.stderr, (args, r.stderr)
    r = perf(server, "-m", "add_sub", "--grpc-stream", expect=2)
    assert "--grpc-stream needs a grpc://" in r.stderr, r.stderr
    r = subprocess.run([QUERN, "perf", "--url", "grpc://127.0.0.1", "-m", "add_sub"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "--url" in r.stderr, r.stderr


def test_a_server_that_stops_answering_ends_each_protocol_at_the_timeout(tmp_path):
    """A model that hangs (the Python model sleeps; the server kills it after 4 s): every protocol gives
    up at --timeout past the level, counts the requests as failed, and the tool exits."""
    (tmp_path / "hang" / "1").mkdir(parents=True)
    (tmp_path / "hang" / "config.pbtxt").write_text(
        'backend: "python"\nmax_batch_size: 1\n'
        'input [ { name: "x" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
        'output [ { name: "y" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
        'parameters { key: "quern.execute_timeout_ms" value { string_value: "4000" } }\n')
    (tmp_path / "hang" / "1" / "model.py").write_text("import time\n\ndef infer(inputs):\n    time.sleep(60)\n")
    proc, ports = start_quern(QUERN, str(tmp_path))
    try:
        for args, grpc in (([], False), ([], True), (["--grpc-stream"], True)):
            t0 = time.monotonic()
            r = perf(ports, "-m", "hang", "-s", "0.3", "--warmup", "0", "--timeout", "1", "--format", "json", *args,
                     expect=1, grpc=grpc)
            took = time.monotonic() - t0
            (lv,) = levels(r)
            assert lv["ok"] == 0, (args, grpc, lv)
            assert took < 15, (args, grpc, took)  # ended by its 1 s timeout, not hung on the model
    finally:
        proc.terminate()
        proc.wait(timeout=30)
