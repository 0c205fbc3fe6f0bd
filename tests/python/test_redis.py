"""Quern with a real redis-server (started here on a free port, with its own data directory): the
result layout, TTLs, a Redis restart, AUTH and TLS, and the job streams (XADD by a producer using
`redis` from PyPI; one or two `quern serve --consume` instances; SIGKILL; dead letters; pipelining
counted by Redis itself in INFO commandstats). Expected outputs come from numpy."""
import http.client
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time

import numpy as np
import pytest

from quern_testing import RedisServer, sanitized, start_quern, wait_until

QUERN = os.environ["QUERN_BIN"]
MODELS = os.environ["QUERN_TEST_MODELS"]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    d = tmp_path_factory.mktemp("repo")
    for m in ("add_sub", "slow_batch", "fail_on_3", "tile4"):
        shutil.copytree(os.path.join(MODELS, m), d / m)
    return str(d)


@pytest.fixture
def redis_server(tmp_path):
    r = RedisServer(tmp_path)
    yield r
    r.stop()


class Quern:
    def __init__(self, repo, *extra):
        self.proc, ports = start_quern(QUERN, repo, *extra)
        self.port, self.metrics = ports["HTTP"], ports["metrics"]

    def request(self, method, path, body=None, headers=None, port=None):
        c = http.client.HTTPConnection("127.0.0.1", port or self.port, timeout=30)
        if isinstance(body, (dict, list)):
            body = json.dumps(body)
        c.request(method, path, body=body, headers=headers or {})
        r = c.getresponse()
        out = r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
        c.close()
        return out

    def metric(self, series):
        text = self.request("GET", "/metrics", port=self.metrics)[2].decode()
        m = re.search("^" + re.escape(series) + r" (\S+)$", text, re.M)
        return float(m.group(1)) if m else None

    def ready(self):
        return self.request("GET", "/v2/health/ready")

    def stop(self, sig=signal.SIGTERM):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=30)


def add_sub_body(a, b):
    return {"inputs": [{"name": "INPUT0", "shape": list(a.shape), "datatype": "FP32", "data": a.flatten().tolist()},
                       {"name": "INPUT1", "shape": list(b.shape), "datatype": "FP32", "data": b.flatten().tolist()}]}


def slow_body(x):
    return {"inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32", "data": x.flatten().tolist()}]}


def submit(q, model, body):
    status, _, data = q.request("POST", f"/v2/models/{model}/jobs", body)
    assert status == 202, data
    return json.loads(data)["job_id"]


def stored(r, job_id):
    """The finished job's record in Redis; None while there is none or it is queued or running."""
    raw = r.get(f"results:{job_id}")
    doc = json.loads(raw) if raw else None
    return doc if doc and doc["status"] not in ("queued", "running") else None


def all_taken(r, stream, last_id=None, group="quern"):
    """Every entry up to `last_id` delivered to `group` and acknowledged: first that the last was
    delivered, then that nothing is pending (in that order, nothing can be delivered in between).
    The opposite order, pending 0 and then lag 0, let a consumer read the last entries between the
    two calls: the check passed with 25 jobs still running."""
    def text(v):
        return v.decode() if isinstance(v, bytes) else v
    last_id = last_id or r.xinfo_stream(stream)["last-generated-id"]  # None: the stream's last entry
    info = next(g for g in r.xinfo_groups(stream) if text(g["name"]) == group)
    return text(info["last-delivered-id"]) == text(last_id) and r.xpending(stream, group)["pending"] == 0


def outputs_of(doc, r=None):
    """The outputs of a stored result as numpy arrays, reading binary values from Redis."""
    out, k = {}, 0
    dtypes = {"FP32": np.float32, "INT64": np.int64}
    for o in doc["result"]["outputs"]:
        if "data" in o:
            out[o["name"]] = np.array(o["data"], dtypes[o["datatype"]]).reshape(o["shape"])
        else:
            raw = r.get(doc["binary_keys"][k])
            k += 1
            assert len(raw) == o["parameters"]["binary_data_size"]
            out[o["name"]] = np.frombuffer(raw, dtypes[o["datatype"]]).reshape(o["shape"])
    return out


def test_result_layout_in_redis(repo, redis_server):
    r = redis_server.client()
    q = Quern(repo, "--redis-url", redis_server.url(), "--job-result-ttl-secs", "600")
    try:
        small_a, small_b = np.arange(8, dtype=np.float32).reshape(2, 4), np.full((2, 4), 0.5, np.float32)
        job = submit(q, "add_sub", add_sub_body(small_a, small_b))
        doc = wait_until(lambda: stored(r, job), what="the result in redis")
        assert doc["job_id"] == job and doc["status"] == "done" and doc["model_name"] == "add_sub"
        assert doc["model_version"] == "1" and doc["binary_keys"] == []
        assert doc["submitted_ms"] <= doc["started_ms"] <= doc["finished_ms"]
        assert [(o["name"], o["datatype"], o["shape"]) for o in doc["result"]["outputs"]] == [
            ("OUTPUT0", "FP32", [2, 4]), ("OUTPUT1", "FP32", [2, 4])]
        out = outputs_of(doc)
        np.testing.assert_array_equal(out["OUTPUT0"], small_a + small_b)
        np.testing.assert_array_equal(out["OUTPUT1"], small_a - small_b)
        assert 590_000 < r.pttl(f"results:{job}") <= 600_000

        # tile4's output of 2x1200 FP32 (9600 bytes) is kept as a binary value, not JSON numbers.
        x = np.random.default_rng(5).standard_normal((2, 300)).astype(np.float32)
        body = {"inputs": [{"name": "x", "shape": [2, 300], "datatype": "FP32", "data": x.flatten().tolist()}]}
        job = submit(q, "tile4", body)
        doc = wait_until(lambda: stored(r, job), what="the result in redis")
        assert doc["binary_keys"] == [f"results:{job}:bin:0"]
        assert "data" not in doc["result"]["outputs"][0]
        assert len(r.get(f"results:{job}")) < 1000  # no bloated JSON
        np.testing.assert_array_equal(outputs_of(doc, r)["y"], np.tile(x, (1, 4)))
        assert 590_000 < r.pttl(f"results:{job}:bin:0") <= 600_000
        # Read back through the job API (from Redis: this server holds nothing in memory now).
        status, _, data = q.request("GET", f"/v2/jobs/{job}")
        assert status == 200
        (o,) = json.loads(data)["result"]["outputs"]
        np.testing.assert_array_equal(np.array(o["data"], np.float32).reshape(o["shape"]), np.tile(x, (1, 4)))
    finally:
        q.stop()

    # Another instance on the same Redis serves the result it never computed.
    q2 = Quern(repo, "--redis-url", redis_server.url())
    try:
        status, _, data = q2.request("GET", f"/v2/jobs/{job}")
        assert status == 200 and json.loads(data)["status"] == "done"
    finally:
        q2.stop()


def test_ttl_expiry_in_redis(repo, redis_server):
    r = redis_server.client()
    q = Quern(repo, "--redis-url", redis_server.url(), "--job-result-ttl-secs", "1")
    try:
        one = np.ones((1, 4), np.float32)
        job = submit(q, "add_sub", add_sub_body(one, one))
        wait_until(lambda: stored(r, job), what="the result in redis")
        assert q.request("GET", f"/v2/jobs/{job}")[0] == 200
        wait_until(lambda: r.exists(f"results:{job}") == 0, timeout=5, what="redis to expire the key")
        time.sleep(0.2)
        status, _, data = q.request("GET", f"/v2/jobs/{job}")
        assert status == 404 and "expired" in json.loads(data)["error"]
    finally:
        q.stop()


def test_redis_restart_loses_no_finished_result(repo, redis_server):
    """Redis killed (-9; append-only, fsync always) while jobs run and while others wait in the
    stream: the running jobs' results wait in memory and are written once Redis is back, the
    accepted jobs nobody had taken yet run after the restart, and submissions while Redis is away
    are refused (503) rather than accepted unrecorded."""
    r = redis_server.client()
    q = Quern(repo, "--redis-url", redis_server.url(), "--consume-models", "add_sub,slow_batch")
    accepter = Quern(repo, "--redis-url", redis_server.url(), "--no-consume")  # accepts, runs nothing
    runner = None
    try:
        wait_until(lambda: q.ready()[0] == 200, what="readiness")
        expected = {}

        def run(quern, model, k):
            if model == "add_sub":
                a, b = np.full((1, 4), k, np.float32), np.arange(4, dtype=np.float32).reshape(1, 4)
                job = submit(quern, "add_sub", add_sub_body(a, b))
                expected[job] = ("OUTPUT0", a + b)
            elif model == "tile4":
                x = np.full((1, 300), k, np.float32)
                job = submit(quern, "tile4", slow_body(x))
                expected[job] = ("y", np.tile(x, (1, 4)))
            else:
                x = np.full((1, 3), k, np.float32)
                job = submit(quern, "slow_batch", slow_body(x))
                expected[job] = ("y", 2 * x)
            return job

        before = [run(q, "add_sub", k) for k in range(10)]
        wait_until(lambda: all(stored(r, j) for j in before), what="results before the restart")
        # Three slow_batch jobs taken (they wait 1 s for a batch of 4), and five tile4 jobs accepted
        # by an instance that takes none (nobody takes tile4's yet).
        running = [run(q, "slow_batch", k) for k in range(3)]
        wait_until(lambda: q.metric("quern_stream_inflight") == 3, what="the slow jobs to be taken")
        waiting = [run(accepter, "tile4", k) for k in range(20, 25)]
        redis_server.stop(kill=True)
        # Redis is away: readiness says so, the taken jobs finish, their results wait in memory.
        status, _, data = wait_until(lambda: (lambda s: s if s[0] == 503 else None)(q.ready()),
                                     what="readiness to drop")
        assert "redis" in json.loads(data)["error"]
        status, _, data = q.request("POST", "/v2/models/add_sub/jobs",
                                    add_sub_body(np.ones((1, 4), np.float32), np.ones((1, 4), np.float32)))
        assert status == 503 and "not accepted" in json.loads(data)["error"], data
        for job in running:  # (503 until it is done: its record is in Redis, away)
            wait_until(lambda: (lambda s: s if s[0] == 200 and json.loads(s[2])["status"] == "done" else None)(
                q.request("GET", f"/v2/jobs/{job}")), what="a job to finish while redis is away")
        assert q.metric("quern_redis_backlog") == 3
        redis_server.start()
        wait_until(lambda: q.ready()[0] == 200, what="readiness after the restart")
        wait_until(lambda: q.metric("quern_redis_backlog") == 0, what="the backlog to be written")
        r = redis_server.client()
        assert r.xlen("quern:jobs:tile4") == 5  # accepted before the kill, kept by the append-only file
        runner = Quern(repo, "--redis-url", redis_server.url(), "--consume-models", "tile4")
        wait_until(lambda: all(stored(r, j) for j in waiting), what="the jobs accepted before the kill")
        for job, (name, want) in expected.items():
            doc = stored(r, job)
            assert doc is not None, f"result of {job} lost"
            np.testing.assert_array_equal(outputs_of(doc, r)[name], want)
        assert q.metric("quern_redis_reconnects_total") >= 1
    finally:
        q.stop()
        accepter.stop()
        if runner:
            runner.stop()


def test_results_wait_for_a_replica_when_asked(repo, tmp_path):
    # ?wait_replicas=1: a result counts as written once a replica has it (WAIT after the EXEC; 2 s,
    # as a loaded machine can delay the replica's acknowledgement);
    # with the replica gone, results are still written, after the wait, and counted as such.
    (tmp_path / "m").mkdir()
    (tmp_path / "r").mkdir()
    master = RedisServer(tmp_path / "m", "--repl-diskless-sync-delay", "0")
    replica = RedisServer(tmp_path / "r", "--replicaof", "127.0.0.1", str(master.port))
    q = None
    try:
        m = master.client()
        wait_until(lambda: m.info("replication").get("slave0", {}).get("state") == "online", what="replica in sync")
        q = Quern(repo, "--redis-url", master.url() + "?wait_replicas=1&wait_timeout_ms=2000")
        wait_until(lambda: q.ready()[0] == 200, what="readiness")
        a, b = np.full((1, 4), 3, np.float32), np.arange(4, dtype=np.float32).reshape(1, 4)
        first = submit(q, "add_sub", add_sub_body(a, b))
        wait_until(lambda: stored(replica.client(), first), what="the result on the replica")
        assert q.metric("quern_redis_unreplicated_writes_total") == 0
        assert m.info("commandstats")["cmdstat_wait"]["calls"] >= 1  # counted by Redis itself

        replica.stop(kill=True)
        second = submit(q, "add_sub", add_sub_body(a + 1, b))
        doc = wait_until(lambda: stored(m, second), what="a result written with no replica to confirm it")
        np.testing.assert_array_equal(outputs_of(doc)["OUTPUT0"], a + 1 + b)
        wait_until(lambda: q.metric("quern_redis_unreplicated_writes_total") >= 1, what="the write counted")
    finally:
        if q:
            q.stop()
        replica.stop()
        master.stop()


def test_a_server_turned_replica_is_left_for_a_new_connection(repo, tmp_path):
    # A failover demotes the master Quern writes to: it answers READONLY, and Quern must drop the
    # connection (a new one reaches the master: with sentinels, the one they name) rather than
    # retry on it. Here the same server is demoted and promoted again by hand.
    (tmp_path / "m").mkdir()
    (tmp_path / "o").mkdir()
    master = RedisServer(tmp_path / "m")
    other = RedisServer(tmp_path / "o")
    q = None
    try:
        m = master.client()
        q = Quern(repo, "--redis-url", master.url())
        wait_until(lambda: q.ready()[0] == 200, what="readiness")
        a, b = np.full((1, 4), 5, np.float32), np.arange(4, dtype=np.float32).reshape(1, 4)
        first = submit(q, "add_sub", add_sub_body(a, b))
        wait_until(lambda: stored(m, first), what="a first result")
        assert q.metric("quern_redis_reconnects_total") == 0
        # Demoted: a submission's write answers READONLY, and the job is refused rather than
        # accepted unrecorded; promoted again, the next one is written over a new connection.
        m.execute_command("REPLICAOF", "127.0.0.1", str(other.port))  # demoted: writes answer READONLY
        status, _, data = q.request("POST", "/v2/models/add_sub/jobs", add_sub_body(a + 1, b))
        assert status == 503 and "not accepted" in json.loads(data)["error"], data
        assert q.metric("quern_redis_write_errors_total") >= 1
        m.execute_command("REPLICAOF", "NO", "ONE")
        wait_until(lambda: q.ready()[0] == 200, what="readiness once the server is a master again")
        job = submit(q, "add_sub", add_sub_body(a + 1, b))
        doc = wait_until(lambda: stored(m, job), what="the result written once the server is a master again")
        np.testing.assert_array_equal(outputs_of(doc)["OUTPUT0"], a + 1 + b)
        assert q.metric("quern_redis_reconnects_total") >= 1
    finally:
        if q:
            q.stop()
        other.stop()
        master.stop()


def test_auth_and_tls(repo, tmp_path):
    # A CA and a server certificate for 127.0.0.1, made here.
    def ssl(*args):
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=tmp_path)
    ssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
        "-subj", "/CN=quern test CA")
    ssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1")
    (tmp_path / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    ssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-out",
        "server.pem", "-days", "2", "-extfile", "ext.cnf")
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    rs = RedisServer(data_dir, "--requirepass", "s3cret", "--tls-cert-file", str(tmp_path / "server.pem"),
                     "--tls-key-file", str(tmp_path / "server.key"), "--tls-ca-cert-file", str(tmp_path / "ca.pem"),
                     "--tls-auth-clients", "no", tls=True)
    try:
        r = rs.client(password="s3cret", ssl=True, ssl_ca_certs=str(tmp_path / "ca.pem"))
        url = f"rediss://:s3cret@127.0.0.1:{rs.port}/0"
        q = Quern(repo, "--redis-url", url, "--redis-tls-ca-file", str(tmp_path / "ca.pem"))
        try:
            wait_until(lambda: q.ready()[0] == 200, what="readiness over TLS")
            one = np.ones((1, 4), np.float32)
            job = submit(q, "add_sub", add_sub_body(one * 3, one))
            doc = wait_until(lambda: stored(r, job), what="the result over TLS")
            np.testing.assert_array_equal(outputs_of(doc)["OUTPUT1"], one * 2)
        finally:
            q.stop()
        # A wrong password, or a certificate nobody vouched for: not ready, and the reason says why.
        for extra, needle in ((["--redis-url", f"rediss://:wrong@127.0.0.1:{rs.port}/0", "--redis-tls-ca-file",
                                str(tmp_path / "ca.pem")], "AUTH"),
                              (["--redis-url", url, "--redis-tls-ca-file", str(tmp_path / "server.pem")], "TLS")):
            q = Quern(repo, *extra)
            try:
                # Until its first try at Redis ends (a TLS handshake), readiness says "not connected yet".
                last = []

                def refused():
                    status, _, data = q.ready()
                    last[:] = [status, data]
                    return status == 503 and needle in json.loads(data).get("error", "")

                try:
                    wait_until(refused, timeout=30, what=f"readiness to say why ({needle})")
                except AssertionError as e:
                    raise AssertionError(f"{e}; the last answer: {last}") from None
            finally:
                q.stop()
    finally:
        rs.stop()


# ---- job streams ----

def xadd_jobs(r, model, bodies, prefix):
    """Adds jobs to quern:jobs:{model} in one pipeline; returns their ids."""
    p = r.pipeline(transaction=False)
    ids = []
    for k, body in enumerate(bodies):
        ids.append(f"{prefix}-{k}")
        p.xadd(f"quern:jobs:{model}", {"id": ids[-1], "body": json.dumps(body)})
    p.execute()
    return ids


def cmdstats(r):
    s = r.info("commandstats")
    return {k[len("cmdstat_"):]: v["calls"] for k, v in s.items()}


def test_stream_results_and_one_round_trip_per_batch(repo, redis_server):
    r = redis_server.client()
    xs = [np.arange(3, dtype=np.float32).reshape(1, 3) + 10 * k for k in range(8)]
    ids = xadd_jobs(r, "slow_batch", [slow_body(x) for x in xs], "pipe")  # before any consumer exists
    before = cmdstats(r)
    q = Quern(repo, "--redis-url", redis_server.url(), "--consume", "--consume-models", "slow_batch")
    try:
        wait_until(lambda: all(stored(r, j) for j in ids), what="the stream's results")
        for job, x in zip(ids, xs):
            doc = stored(r, job)
            assert doc["status"] == "done" and doc["model_name"] == "slow_batch"
            np.testing.assert_array_equal(outputs_of(doc)["y"], 2 * x)
        wait_until(lambda: r.xpending("quern:jobs:slow_batch", "quern")["pending"] == 0, what="the acks")
        after = cmdstats(r)
        status, _, data = q.request("GET", "/v2/models/slow_batch/stats")
        batches = json.loads(data)["model_stats"][0]["execution_count"]
        # Two full batches of 4 ran at once (no 1 s wait) and each wrote its results and acks in
        # one MULTI/EXEC: 8 SETs and 8 XACKs in at most 2 transactions (two batches that finish
        # together on the two instances may share one: the store commits what is queued at once).
        assert batches == 2
        assert 1 <= after.get("exec", 0) - before.get("exec", 0) <= batches
        assert after.get("set", 0) - before.get("set", 0) == 8
        assert after.get("xack", 0) - before.get("xack", 0) == 8
        assert q.metric('quern_stream_entries_total{outcome="done"}') == 8
        wait_until(lambda: q.metric('quern_stream_length{model="slow_batch"}') == 8, what="the length metric")
        assert q.metric('quern_stream_pending{model="slow_batch"}') == 0
        # The job API serves stream jobs too.
        status, _, data = q.request("GET", f"/v2/jobs/{ids[3]}")
        assert status == 200 and json.loads(data)["result"]["outputs"][0]["data"] == (2 * xs[3]).flatten().tolist()
    finally:
        q.stop()


def test_the_stream_keeps_only_what_a_group_still_needs(repo, redis_server):
    """10,000 jobs (5,000 under the sanitizers) through one stream: entries every group has acknowledged are trimmed as the
    consumer goes, so XLEN stays bounded (at most a node of 100 entries and what is not yet
    acknowledged, and the 1,000 acknowledged between two trims); a group that has read nothing
    holds everything; --stream-retain-secs keeps the
    acknowledged entries of that long."""
    r = redis_server.client()
    one = np.ones((1, 4), np.float32)
    body = json.dumps(add_sub_body(one, one))
    q = Quern(repo, "--redis-url", redis_server.url(), "--consume", "--consume-models", "add_sub")
    try:
        wait_until(lambda: r.exists("quern:jobs:add_sub") and r.xinfo_groups("quern:jobs:add_sub"),
                   what="the consumer group")
        longest = 0
        chunks = 10 if sanitized(QUERN) else 20  # the bound is a chunk's, whatever their number
        for chunk in range(chunks):  # chunks of 500 jobs, each added at once
            p = r.pipeline(transaction=False)
            for k in range(500):
                p.xadd("quern:jobs:add_sub", {"id": f"trim-{chunk}-{k}", "body": body})
            last = p.execute()[-1]
            wait_until(lambda: all_taken(r, "quern:jobs:add_sub", last), timeout=60, what="the chunk's jobs")
            longest = max(longest, r.xlen("quern:jobs:add_sub"))
        wait_until(lambda: r.xlen("quern:jobs:add_sub") <= 100, timeout=10, what="the stream trimmed")
        print(f"{chunks * 500} jobs: XLEN at most {longest} after a chunk, {r.xlen('quern:jobs:add_sub')} at the end")
        # A chunk of 500, the 1,000 acknowledged between two trims, a node of 100 a trim leaves.
        assert longest <= 1600, longest
        assert stored(r, f"trim-{chunks - 1}-499")["status"] == "done"
        wait_until(lambda: (q.metric('quern_stream_trimmed_total{model="add_sub"}') or 0) >= chunks * 500 - 100,
                   what="the trimmed counter")
        # Another group that has read nothing: nothing it still needs is trimmed.
        r.xgroup_create("quern:jobs:add_sub", "audit", id="0")
        before = r.xlen("quern:jobs:add_sub")
        ids = xadd_jobs(r, "add_sub", [add_sub_body(one, one)] * 300, "held")
        wait_until(lambda: all(stored(r, j) for j in ids), what="the held jobs")
        time.sleep(2.5)  # two trims
        assert r.xlen("quern:jobs:add_sub") == before + 300
    finally:
        q.stop()
    r.delete("quern:jobs:add_sub")
    q = Quern(repo, "--redis-url", redis_server.url(), "--consume", "--consume-models", "add_sub",
              "--stream-retain-secs", "3600")
    try:
        ids = xadd_jobs(r, "add_sub", [add_sub_body(one, one)] * 300, "kept")
        wait_until(lambda: all(stored(r, j) for j in ids), what="the kept jobs")
        time.sleep(2.5)
        assert r.xlen("quern:jobs:add_sub") == 300
    finally:
        q.stop()


def test_text_outputs_are_json_strings_any_redis_client_reads(tmp_path, redis_server):
    """A Python model's BYTES output (class names, with non-ASCII ones written by the test) is JSON
    strings in results:{id}, read with redis-py and json alone."""
    repo = tmp_path / "repo"
    shutil.copytree(os.path.join(ROOT, "examples", "models", "imagenet_top5"), repo / "imagenet_top5")
    names = [f"class {k}" for k in range(1000)]
    names[7] = "Zo\u00eb's \u5f20\u4f1f \"cat\""
    os.makedirs(repo / "imagenet")
    (repo / "imagenet" / "labels.txt").write_text("\n".join(names) + "\n", encoding="utf-8")
    r = redis_server.client()
    logits = np.zeros((1, 1000), np.float32)
    logits[0, 7], logits[0, 3] = 9, 8
    body = {"inputs": [{"name": "logits", "shape": [1, 1000], "datatype": "FP32", "data": logits.ravel().tolist()}]}
    q = Quern(str(repo), "--redis-url", redis_server.url(), "--consume")
    try:
        xadd_jobs(r, "imagenet_top5", [body], "text")
        wait_until(lambda: stored(r, "text-0"), what="the result")
        doc = json.loads(r.get("results:text-0").decode("utf-8"))
        labels = next(o for o in doc["result"]["outputs"] if o["name"] == "labels")
        assert labels["datatype"] == "BYTES" and labels["data"][:2] == [names[7], names[3]], labels
        assert "binary_keys" not in doc or len(doc["binary_keys"]) == 0, doc
    finally:
        q.stop()


def test_a_flooded_slow_model_does_not_starve_another_models_stream(repo, tmp_path, redis_server):
    """300 jobs of a model that takes 0.1 s each, then 20 add_sub jobs: each model has its share of
    the jobs an instance takes at once, so add_sub's are done while most of the flood still waits,
    not after it (30 s of sleeps, paced by the clock, not by how much CPU the machine lends)."""
    flood_repo = tmp_path / "repo"
    shutil.copytree(os.path.join(repo, "add_sub"), flood_repo / "add_sub")
    os.makedirs(flood_repo / "sleepy" / "1")
    (flood_repo / "sleepy" / "config.pbtxt").write_text(
        'backend: "python"\nmax_batch_size: 1\n'
        'input [ { name: "x" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
        'output [ { name: "y" data_type: TYPE_FP32 dims: [ 1 ] } ]\n')
    (flood_repo / "sleepy" / "1" / "model.py").write_text(
        "import time\n\ndef infer(inputs):\n    time.sleep(0.1)\n    return {'y': inputs['x']}\n")
    r = redis_server.client()
    q = Quern(str(flood_repo), "--redis-url", redis_server.url(), "--consume")
    try:
        flood = xadd_jobs(r, "sleepy", [slow_body(np.ones((1, 1), np.float32))] * 300, "flood")
        wait_until(lambda: stored(r, flood[0]), timeout=60, what="the flood's first job")  # under way
        one = np.ones((1, 4), np.float32)
        start = time.monotonic()
        quick = xadd_jobs(r, "add_sub", [add_sub_body(one * k, one) for k in range(20)], "quick")
        wait_until(lambda: all(stored(r, j) for j in quick), timeout=60, what="add_sub's jobs")
        took = time.monotonic() - start
        flood_done = sum(1 for j in flood if stored(r, j))
        print(f"20 add_sub jobs behind a flood of 300 x 0.1 s: done in {took:.2f} s ({flood_done} of the flood done)")
        # Behind the flood they would have waited for all 300 (and the flood's last 100 alone are 10 s).
        assert flood_done < 200, f"add_sub's jobs ended after {flood_done} of the flood's 300: they waited behind it"
    finally:
        q.stop(signal.SIGKILL)


def test_http_jobs_survive_the_instance_that_accepted_them(tmp_path, redis_server):
    """100 HTTP jobs accepted by instance A (a model taking 0.05 s a job once a gate opens, counting
    its runs in a file), A killed -9 with all of them waiting: every job ends done, with its own result, read
    from B; none ran more than twice (the one A was running may run again). A job that B saw
    queued and cancelled never runs. Status reads on B: queued, then running or done."""
    repo = tmp_path / "repo"
    os.makedirs(repo / "counted" / "1")
    runs = tmp_path / "runs.txt"
    (repo / "counted" / "config.pbtxt").write_text(
        'backend: "python"\nmax_batch_size: 1\n'
        'input [ { name: "x" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
        'output [ { name: "y" data_type: TYPE_FP32 dims: [ 1 ] } ]\n')
    # Jobs wait at a gate the test opens once A is dead: A dies with all of them queued or running,
    # however fast or slow the machine is.
    gate = tmp_path / "gate"
    (repo / "counted" / "1" / "model.py").write_text(
        "import os, time\n\n"
        "def infer(inputs):\n"
        "    while not os.path.exists(%r):\n"
        "        time.sleep(0.01)\n"
        "    with open(%r, 'a') as f:\n"
        "        f.write(f\"{float(inputs['x'].ravel()[0])}\\n\")\n"
        "    time.sleep(0.05)\n"
        "    return {'y': inputs['x'] * 3}\n" % (str(gate), str(runs)))
    r = redis_server.client()
    common = ["--redis-url", redis_server.url(), "--consume-claim-idle-ms", "1000"]
    a = Quern(str(repo), *common, "--consumer-name", "a")
    b = Quern(str(repo), *common, "--no-consume")  # reads and cancels; takes nothing yet
    try:
        ids = {}
        for k in range(100):
            status, _, data = a.request("POST", "/v2/models/counted/jobs",
                                        {"inputs": [{"name": "x", "shape": [1, 1], "datatype": "FP32", "data": [k]}]})
            answer = json.loads(data)
            assert status == 202 and answer["durable"] is True, data
            ids[answer["job_id"]] = k
        a.stop(signal.SIGKILL)
        gate.write_text("")
        done_before = sum(1 for j in ids if stored(r, j))
        # B answers for A's jobs: the ones not run yet are queued (or running: taken by A).
        states = {json.loads(b.request("GET", f"/v2/jobs/{j}")[2])["status"] for j in ids}
        assert states <= {"queued", "running", "done"} and "queued" in states, states
        # One of them cancelled on B: nobody runs it.
        victim = next(j for j in ids if json.loads(b.request("GET", f"/v2/jobs/{j}")[2])["status"] == "queued")
        status, _, data = b.request("DELETE", f"/v2/jobs/{victim}")
        assert status == 200, data
        b.stop()
        b = Quern(str(repo), *common, "--consumer-name", "b")  # now B takes jobs: A's too
        wait_until(lambda: all(stored(r, j) for j in ids), timeout=60, what="every job to end")
        for job, k in ids.items():
            doc = stored(r, job)
            if job == victim:
                assert doc["status"] == "cancelled", doc
                continue
            assert doc["status"] == "done", doc
            assert outputs_of(doc)["y"].ravel().tolist() == [3.0 * k], (job, doc)
            status, _, data = b.request("GET", f"/v2/jobs/{job}")
            assert status == 200 and json.loads(data)["result"]["outputs"][0]["data"] == [3.0 * k]
        counts = {}
        for line in runs.read_text().split():
            counts[float(line)] = counts.get(float(line), 0) + 1
        print(f"100 jobs, A killed after {done_before} done: {sum(counts.values())} runs, "
              f"{sum(1 for c in counts.values() if c > 1)} jobs run twice")
        assert float(ids[victim]) not in counts
        assert all(counts.get(float(k), 0) >= 1 for j, k in ids.items() if j != victim)
        assert max(counts.values()) <= 2, counts
        assert done_before == 0, "A finished jobs behind its closed gate"
        # B read A's jobs' bodies from Redis (A kept them in memory, and died), and each body went
        # with its job's acknowledgement, the cancelled one's too.
        assert b.metric('quern_stream_entries_total{outcome="local"}') == 0
        assert list(r.scan_iter("quern:jobs:counted:body:*")) == []
    finally:
        a.stop(signal.SIGKILL)
        b.stop()


def test_http_jobs_run_from_memory_where_accepted_and_leave_no_body_behind(repo, redis_server):
    """An HTTP job's entry names its body (under its stream's :body: keys) rather than holding it;
    the instance that accepted it runs it from the request it parsed then, and its body goes with
    its acknowledgement. Results checked against numpy."""
    r = redis_server.client()
    q = Quern(repo, "--redis-url", redis_server.url(), "--consume-models", "add_sub", "--stream-retain-secs", "3600")
    try:
        rng = np.random.default_rng(7)
        jobs = {}
        for _ in range(20):
            a, b = rng.standard_normal((2, 1, 4)).astype(np.float32)
            jobs[submit(q, "add_sub", add_sub_body(a, b))] = (a, b)
        wait_until(lambda: all(stored(r, j) for j in jobs), timeout=30, what="every job to end")
        for job, (a, b) in jobs.items():
            out = outputs_of(stored(r, job), r)
            np.testing.assert_allclose(out["OUTPUT0"], a + b, rtol=1e-6)
            np.testing.assert_allclose(out["OUTPUT1"], a - b, rtol=1e-6)
        # Kept (--stream-retain-secs) to be read here: the entries hold no body, only its key.
        entries = {f[b"id"].decode(): f for _, f in r.xrange("quern:jobs:add_sub")}
        assert set(entries) == set(jobs)
        for job, fields in entries.items():
            assert b"body" not in fields and fields[b"body_key"].decode() == f"quern:jobs:add_sub:body:{job}"
        wait_until(lambda: q.metric('quern_stream_entries_total{outcome="local"}') == 20, what="the local count")
        assert list(r.scan_iter("quern:jobs:add_sub:body:*")) == []
    finally:
        q.stop()


def test_a_submission_redis_half_refused_leaves_nothing_behind(repo, redis_server):
    """The stream key holds something else: the XADD fails inside the transaction that also wrote the
    job's queued record and its body. The job is refused (503), and what was written of it is deleted:
    a client that submits again would leave another copy each time, and nothing deletes them."""
    r = redis_server.client()
    r.set("quern:jobs:add_sub", "not a stream")
    q = Quern(repo, "--redis-url", redis_server.url(), "--no-consume")
    try:
        one = np.ones((1, 4), np.float32)
        for _ in range(3):
            status, _, data = q.request("POST", "/v2/models/add_sub/jobs", add_sub_body(one, one))
            assert status == 503 and "not accepted" in json.loads(data)["error"], data
        assert list(r.scan_iter("results:*")) == []
        assert list(r.scan_iter("quern:jobs:add_sub:body:*")) == []
        assert r.get("quern:jobs:add_sub") == b"not a stream"
    finally:
        q.stop()


def test_entries_that_name_their_body_by_key(repo, redis_server):
    """A producer may put a body under {stream}:body:{id} and name it (body_key): run, then the key is
    deleted. A body_key that is not the job's own (outside the stream's keys, or another job's) is
    refused and the key it named left alone; one naming a key that holds no string fails and is kept;
    one naming a key that is not there fails saying so, unless the job has finished (its body went
    with an earlier delivery's acknowledgement): then the entry is only acknowledged, its result kept."""
    r = redis_server.client()
    q = Quern(repo, "--redis-url", redis_server.url(), "--consume-models", "add_sub")
    try:
        a = np.arange(4, dtype=np.float32).reshape(1, 4)
        b = np.full((1, 4), 0.5, np.float32)
        body = json.dumps(add_sub_body(a, b))
        r.set("quern:jobs:add_sub:body:ext", body)
        r.set("precious", body)
        r.set("quern:jobs:add_sub:body:other", body)
        r.xadd("quern:jobs:add_sub:body:stream", {"x": "1"})  # e.g. the stream of a model named "add_sub:body:stream"
        done_before = json.dumps({"job_id": "again", "status": "done", "model_name": "add_sub", "model_version": 1,
                                  "submitted_ms": 1, "started_ms": 2, "finished_ms": 3, "result": {"outputs": []}},
                                 separators=(",", ":"))  # as Quern writes records
        r.set("results:again", done_before)
        r.xadd("quern:jobs:add_sub", {"id": "ext", "body_key": "quern:jobs:add_sub:body:ext"})
        r.xadd("quern:jobs:add_sub", {"id": "foreign", "body_key": "precious"})
        r.xadd("quern:jobs:add_sub", {"id": "thief", "body_key": "quern:jobs:add_sub:body:other"})
        r.xadd("quern:jobs:add_sub", {"id": "stream", "body_key": "quern:jobs:add_sub:body:stream"})
        r.xadd("quern:jobs:add_sub", {"id": "missing", "body_key": "quern:jobs:add_sub:body:missing"})
        last = r.xadd("quern:jobs:add_sub", {"id": "again", "body_key": "quern:jobs:add_sub:body:again"})
        for job in ("ext", "foreign", "thief", "stream", "missing"):
            wait_until(lambda: stored(r, job), timeout=30, what=f"{job}'s result")
        wait_until(lambda: all_taken(r, "quern:jobs:add_sub", last), what="every entry to be acknowledged")
        np.testing.assert_allclose(outputs_of(stored(r, "ext"), r)["OUTPUT0"], a + b)
        assert not r.exists("quern:jobs:add_sub:body:ext")
        for job, key in (("foreign", "precious"), ("thief", "quern:jobs:add_sub:body:other")):
            doc = stored(r, job)
            assert doc["status"] == "failed" and doc["error"]["code"] == "INVALID_ARGUMENT", doc
            assert f"body_key '{key}' is not this job's (quern:jobs:add_sub:body:{job})" in doc["error"]["message"]
            assert r.get(key) == body.encode(), f"{key} was deleted or changed"
        stream = stored(r, "stream")
        assert stream["status"] == "failed" and "holds something other than a body" in stream["error"]["message"]
        assert r.type("quern:jobs:add_sub:body:stream") == b"stream" and r.xlen("quern:jobs:add_sub:body:stream") == 1
        missing = stored(r, "missing")
        assert missing["status"] == "failed" and missing["error"]["code"] == "FAILED_PRECONDITION", missing
        assert "is not in redis" in missing["error"]["message"]
        assert r.get("results:again") == done_before.encode(), "a finished job's result was overwritten"
        dead = {f[b"id"].decode() for _, f in r.xrange("quern:dead:add_sub")}
        assert dead == {"foreign", "thief", "stream", "missing"}
        assert q.proc.poll() is None
    finally:
        q.stop()


def test_a_waiting_job_outlives_the_result_ttl_and_models_nobody_takes_run_here(repo, redis_server):
    """A job waiting in the stream keeps its queued record past --job-result-ttl-secs (only a
    finished record expires), and cancelled after that it still never runs. A model this instance
    takes no jobs for (--consume-models) runs its HTTP jobs here, not durable, rather than leaving
    them in a stream nobody reads."""
    r = redis_server.client()
    one = np.ones((1, 4), np.float32)
    accepter = Quern(repo, "--redis-url", redis_server.url(), "--no-consume", "--job-result-ttl-secs", "1")
    try:
        waiting = submit(accepter, "add_sub", add_sub_body(one, one))
        assert r.exists(f"quern:jobs:add_sub:body:{waiting}")
        time.sleep(1.5)
        status, _, data = accepter.request("GET", f"/v2/jobs/{waiting}")
        assert status == 200 and json.loads(data)["status"] == "queued", data
        assert accepter.request("DELETE", f"/v2/jobs/{waiting}")[0] == 200
        # Finished (cancelled), the record now lives the 1-s result TTL.
        cancelled = r.get(f"results:{waiting}")
        assert cancelled is None or json.loads(cancelled)["status"] == "cancelled", cancelled
    finally:
        accepter.stop()
    q = Quern(repo, "--redis-url", redis_server.url(), "--consume-models", "add_sub")
    try:
        wait_until(lambda: r.xinfo_groups("quern:jobs:add_sub"), what="the consumer group")
        wait_until(lambda: all_taken(r, "quern:jobs:add_sub"), what="the cancelled entry to be taken")
        # Never run: its record says cancelled, or has expired (its 1-s TTL may pass before this
        # consumer starts on a busy machine); no result was written over it.
        doc = r.get(f"results:{waiting}")
        assert doc is None or json.loads(doc)["status"] == "cancelled", doc
        assert not r.exists(f"quern:jobs:add_sub:body:{waiting}"), "the cancelled job's body stayed"
        status, _, data = q.request("GET", "/v2/models/add_sub/stats")
        assert json.loads(data)["model_stats"][0]["execution_count"] == 0
        # slow_batch: not taken here, so its job runs here.
        status, _, data = q.request("POST", "/v2/models/slow_batch/jobs", slow_body(np.ones((1, 3), np.float32)))
        answer = json.loads(data)
        assert status == 202 and answer["durable"] is False, data
        doc = wait_until(lambda: stored(r, answer["job_id"]), what="the local job's result")
        assert doc["status"] == "done"
        assert not r.exists("quern:jobs:slow_batch")
    finally:
        q.stop()


def test_two_instances_share_one_stream(repo, redis_server):
    r = redis_server.client()
    common = ["--redis-url", redis_server.url(), "--consume", "--consume-models", "slow_batch",
              "--consume-max-inflight", "4"]
    a = Quern(repo, *common, "--consumer-name", "a")
    b = Quern(repo, *common, "--consumer-name", "b")
    try:
        # Both connected before the jobs arrive, and the jobs arrive in waves, as a producer's
        # would: a consumer that starts late would otherwise find that a fast one took them all.
        wait_until(lambda: a.metric("quern_stream_connected") == 1 and b.metric("quern_stream_connected") == 1,
                   what="both consumers connected")
        xs = [np.full((1, 3), k, np.float32) for k in range(40)]
        ids = []
        for wave in range(10):
            ids += xadd_jobs(r, "slow_batch", [slow_body(x) for x in xs[4 * wave:4 * wave + 4]], f"share{wave}")
            time.sleep(0.1)
        wait_until(lambda: all(stored(r, j) for j in ids), timeout=60, what="every result")
        for job, x in zip(ids, xs):
            np.testing.assert_array_equal(outputs_of(stored(r, job))["y"], 2 * x)
        done_a = a.metric('quern_stream_entries_total{outcome="done"}')
        done_b = b.metric('quern_stream_entries_total{outcome="done"}')
        assert done_a + done_b == 40 and done_a >= 4 and done_b >= 4, (done_a, done_b)
        consumers = {c["name"].decode(): c for c in r.xinfo_consumers("quern:jobs:slow_batch", "quern")}
        assert set(consumers) == {"a", "b"} and all(c["pending"] == 0 for c in consumers.values())
    finally:
        a.stop()
        b.stop()


def test_sigkill_mid_batch_every_job_gets_exactly_one_result(repo, redis_server):
    r = redis_server.client()
    common = ["--redis-url", redis_server.url(), "--consume", "--consume-models", "slow_batch",
              "--consume-claim-idle-ms", "1500"]
    a = Quern(repo, *common, "--consumer-name", "doomed")
    b = None
    try:
        # Three jobs: a batch of 4 is not full, so `doomed` holds them for its 1 s batching delay.
        xs = [np.full((1, 3), k + 1, np.float32) for k in range(3)]
        ids = xadd_jobs(r, "slow_batch", [slow_body(x) for x in xs], "kill")
        wait_until(lambda: a.metric("quern_stream_inflight") == 3, timeout=5, what="doomed to take the jobs")
        a.stop(signal.SIGKILL)  # mid-batch: taken, not computed, not acknowledged
        assert not any(stored(r, j) for j in ids)
        pending = r.xpending_range("quern:jobs:slow_batch", "quern", "-", "+", 10)
        assert [p["consumer"].decode() for p in pending] == ["doomed"] * 3
        b = Quern(repo, *common, "--consumer-name", "survivor")
        wait_until(lambda: all(stored(r, j) for j in ids), timeout=30, what="the survivor to finish them")
        for job, x in zip(ids, xs):
            np.testing.assert_array_equal(outputs_of(stored(r, job))["y"], 2 * x)
        wait_until(lambda: r.xpending("quern:jobs:slow_batch", "quern")["pending"] == 0, what="the acks")
        assert b.metric('quern_stream_entries_total{outcome="reclaimed"}') == 3
        assert b.metric('quern_stream_entries_total{outcome="done"}') == 3
        # Exactly one result each: one key per job (plus nothing else), no dead letters.
        assert sorted(k.decode() for k in r.scan_iter("results:*")) == sorted(f"results:{j}" for j in ids)
        assert r.xlen("quern:dead:slow_batch") == 0
    finally:
        a.stop(signal.SIGKILL)
        if b:
            b.stop()


def test_poison_jobs_go_to_the_dead_letter_stream(repo, redis_server):
    r = redis_server.client()
    q = Quern(repo, "--redis-url", redis_server.url(), "--consume", "--consume-models", "fail_on_3,add_sub",
              "--consume-claim-idle-ms", "300", "--consume-max-deliveries", "3")
    try:
        # fail_on_3 fails inside ONNX Runtime for an input of 3 values: retried, then dead-lettered.
        r.xadd("quern:jobs:fail_on_3", {"id": "poison", "body": json.dumps(slow_body(np.ones((1, 3), np.float32)))})
        # A malformed request can never succeed: dead-lettered at once.
        r.xadd("quern:jobs:add_sub", {"id": "garbled", "body": "{not json"})
        good = np.ones((1, 4), np.float32)
        r.xadd("quern:jobs:add_sub", {"id": "fine", "body": json.dumps(add_sub_body(good, good))})
        dead = wait_until(lambda: r.xrange("quern:dead:fail_on_3"), timeout=30, what="the poison job's dead letter")
        assert len(dead) == 1
        fields = {k.decode(): v.decode() for k, v in dead[0][1].items()}
        assert fields["id"] == "poison" and fields["deliveries"] == "3" and "fail_on_3" in fields["error"]
        assert json.loads(fields["body"]) == slow_body(np.ones((1, 3), np.float32))
        doc = stored(r, "poison")
        assert doc["status"] == "failed" and "fail_on_3" in doc["error"]["message"]
        garbled = {k.decode(): v.decode() for k, v in r.xrange("quern:dead:add_sub")[0][1].items()}
        assert garbled["id"] == "garbled" and garbled["deliveries"] == "1" and garbled["code"] == "INVALID_ARGUMENT"
        assert stored(r, "garbled")["error"]["code"] == "INVALID_ARGUMENT"
        assert stored(r, "fine")["status"] == "done"
        wait_until(lambda: r.xpending("quern:jobs:fail_on_3", "quern")["pending"] == 0, what="the poison ack")
        assert q.metric('quern_stream_entries_total{outcome="retried"}') == 2
        assert q.metric('quern_stream_entries_total{outcome="dead"}') == 2
        # The job API reports the failure with its error.
        status, _, data = q.request("GET", "/v2/jobs/poison")
        assert status == 200 and json.loads(data)["status"] == "failed"
    finally:
        q.stop()


def test_sigterm_finishes_taken_jobs_and_flushes_their_results(repo, redis_server):
    r = redis_server.client()
    q = Quern(repo, "--redis-url", redis_server.url(), "--consume", "--consume-models", "slow_batch",
              "--drain-timeout-secs", "20")
    # Two jobs over HTTP and one from the stream wait in slow_batch's 1 s batching delay (a batch of
    # 4 would leave at once).
    xs = [np.full((1, 3), k + 1, np.float32) for k in range(3)]
    http_ids = [submit(q, "slow_batch", slow_body(x)) for x in xs[:2]]
    stream_ids = xadd_jobs(r, "slow_batch", [slow_body(x) for x in xs[2:]], "drain")
    # (The HTTP jobs go through the stream too.)
    wait_until(lambda: q.metric("quern_stream_inflight") == 3, timeout=10, what="the stream jobs to be taken")
    q.proc.send_signal(signal.SIGTERM)
    assert q.proc.wait(timeout=25) == 0
    for job, x in zip(http_ids + stream_ids, xs):
        doc = stored(r, job)
        assert doc and doc["status"] == "done", (job, doc)
        np.testing.assert_array_equal(outputs_of(doc, r)["y"], 2 * x)
    assert r.xpending("quern:jobs:slow_batch", "quern")["pending"] == 0


def test_a_hostile_entry_cannot_kill_consumers(repo, redis_server):
    r = redis_server.client()
    q = Quern(repo, "--redis-url", redis_server.url(), "--consume", "--consume-models", "add_sub",
              "--consume-claim-idle-ms", "300", "--consume-max-deliveries", "3")
    try:
        # 130,000 nested '[' exhausted the parser's stack: every consumer that read it died.
        r.xadd("quern:jobs:add_sub", {"id": "deep", "body": "[" * 130_000})
        r.xadd("quern:jobs:add_sub", {"id": "deep2", "body": '{"inputs": ' + "[" * 130_000})
        for job in ("deep", "deep2"):
            doc = wait_until(lambda: stored(r, job), timeout=30, what=f"{job}'s result")
            assert doc["status"] == "failed" and doc["error"]["code"] == "INVALID_ARGUMENT", doc
        dead = {f[b"id"].decode(): f for _, f in r.xrange("quern:dead:add_sub")}
        assert set(dead) == {"deep", "deep2"} and dead["deep"][b"deliveries"] == b"1"
        assert q.proc.poll() is None
    finally:
        q.stop()


def test_an_entry_delivered_beyond_the_limit_is_dead_lettered_before_it_runs(repo, redis_server):
    # Consumers that died with an entry (deliveries 1..3 never finished) must not hand it to the next
    # one: whatever it holds, the 4th delivery goes to the dead letters without being parsed or run.
    r = redis_server.client()
    one = np.ones((1, 4), np.float32)
    r.xgroup_create("quern:jobs:add_sub", "quern", id="0", mkstream=True)
    entry = r.xadd("quern:jobs:add_sub", {"id": "cursed", "body": json.dumps(add_sub_body(one, one))})
    r.xreadgroup("quern", "ghost1", {"quern:jobs:add_sub": ">"}, count=1)
    r.xclaim("quern:jobs:add_sub", "quern", "ghost2", 0, [entry])
    r.xclaim("quern:jobs:add_sub", "quern", "ghost3", 0, [entry])
    assert r.xpending_range("quern:jobs:add_sub", "quern", "-", "+", 1)[0]["times_delivered"] == 3
    q = Quern(repo, "--redis-url", redis_server.url(), "--consume", "--consume-models", "add_sub",
              "--consume-claim-idle-ms", "300", "--consume-max-deliveries", "3")
    try:
        doc = wait_until(lambda: stored(r, "cursed"), timeout=30, what="the cursed job's result")
        assert doc["status"] == "failed" and "delivered 4 times" in doc["error"]["message"], doc
        fields = {k.decode(): v.decode() for k, v in r.xrange("quern:dead:add_sub")[0][1].items()}
        assert fields["id"] == "cursed" and fields["deliveries"] == "4"
        wait_until(lambda: r.xpending("quern:jobs:add_sub", "quern")["pending"] == 0, what="the ack")
        status, _, data = q.request("GET", "/v2/models/add_sub/stats")
        assert json.loads(data)["model_stats"][0]["inference_count"] == 0  # never run
    finally:
        q.stop()


def test_deadline_passed_in_the_stream_fails_without_running(repo, redis_server):
    r = redis_server.client()
    q = Quern(repo, "--redis-url", redis_server.url(), "--consume", "--consume-models", "add_sub")
    try:
        one = np.ones((1, 4), np.float32)
        r.xadd("quern:jobs:add_sub", {"id": "late", "body": json.dumps(add_sub_body(one, one)),
                                      "deadline_ms": str(int(time.time() * 1000) - 1000)})
        doc = wait_until(lambda: stored(r, "late"), what="the late job's result")
        assert doc["status"] == "failed" and doc["error"]["code"] == "DEADLINE_EXCEEDED"
        assert r.xlen("quern:dead:add_sub") == 0
        status, _, data = q.request("GET", "/v2/models/add_sub/stats")
        assert json.loads(data)["model_stats"][0]["inference_count"] == 0
    finally:
        q.stop()


def test_a_deadline_at_the_end_of_time_is_served(repo, redis_server):
    # deadline_ms as large as it parses (2^63 - 1): its distance from now once overflowed when
    # turned into nanoseconds (UBSan stops the sanitizer build's server there).
    r = redis_server.client()
    q = Quern(repo, "--redis-url", redis_server.url(), "--consume", "--consume-models", "add_sub")
    try:
        a = np.arange(4, dtype=np.float32).reshape(1, 4)
        b = np.full((1, 4), 2, np.float32)
        for i, deadline in enumerate([2**63 - 1, 2**62, int(time.time() * 1000) + 365 * 24 * 3600 * 1000]):
            r.xadd("quern:jobs:add_sub", {"id": f"far{i}", "body": json.dumps(add_sub_body(a, b)),
                                          "deadline_ms": str(deadline)})
        for i in range(3):
            doc = wait_until(lambda: stored(r, f"far{i}"), what=f"job far{i}'s result")
            assert doc["status"] == "done", doc
            np.testing.assert_array_equal(outputs_of(doc)["OUTPUT0"], a + b)
    finally:
        q.stop()


def test_python_producer_example(repo, redis_server):
    import sys
    example = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "redis", "jobs.py")
    q = Quern(repo, "--redis-url", redis_server.url(3), "--consume", "--consume-models", "add_sub")
    try:
        out = subprocess.run([sys.executable, example, "--redis-url", redis_server.url(3), "--jobs", "50"],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr
        assert out.stdout.startswith("50 done, 0 failed, 0 not finished"), out.stdout
    finally:
        q.stop()


def test_a_job_waiting_longer_than_the_claim_idle_time_is_not_taken_over(repo, redis_server):
    # Jobs held for slow_batch's 1 s batching delay, with a claim idle time of 300 ms: the holder
    # keeps them fresh (XCLAIM JUSTID), so neither the other instance nor itself reclaims them.
    r = redis_server.client()
    common = ["--redis-url", redis_server.url(), "--consume", "--consume-models", "slow_batch",
              "--consume-claim-idle-ms", "300"]
    a = Quern(repo, *common, "--consumer-name", "a")
    b = Quern(repo, *common, "--consumer-name", "b")
    try:
        xs = [np.full((1, 3), k, np.float32) for k in range(3)]
        ids = xadd_jobs(r, "slow_batch", [slow_body(x) for x in xs], "fresh")
        wait_until(lambda: all(stored(r, j) for j in ids), timeout=20, what="the results")
        for job, x in zip(ids, xs):
            np.testing.assert_array_equal(outputs_of(stored(r, job))["y"], 2 * x)
        for q in (a, b):
            assert q.metric('quern_stream_entries_total{outcome="reclaimed"}') == 0
        assert a.metric('quern_stream_entries_total{outcome="done"}') + \
            b.metric('quern_stream_entries_total{outcome="done"}') == 3
    finally:
        a.stop()
        b.stop()


def test_giant_entries_are_dead_lettered_unread_and_starve_no_job(repo, redis_server):
    # Three 40 MB entries (over a 1 MiB body limit) before a normal job: the consumer drops their
    # bytes as they arrive, dead-letters them saying why, and the job behind them runs at once.
    r = redis_server.client()
    q = Quern(repo, "--redis-url", redis_server.url(), "--consume", "--consume-models", "add_sub",
              "--http-max-body-bytes", str(1 << 20))
    try:
        before = 0
        with open(f"/proc/{q.proc.pid}/status") as f:
            before = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) // 1024
        giant = "x" * (40 << 20)
        for i in range(3):
            r.xadd("quern:jobs:add_sub", {"id": f"giant{i}", "body": giant})
        good = np.ones((1, 4), np.float32)
        start = time.monotonic()
        r.xadd("quern:jobs:add_sub", {"id": "after", "body": json.dumps(add_sub_body(good, good))})
        doc = wait_until(lambda: stored(r, "after"), timeout=30, what="the job behind the giants")
        took = time.monotonic() - start
        assert doc["status"] == "done", doc
        dead = wait_until(lambda: len(r.xrange("quern:dead:add_sub")) == 3 and r.xrange("quern:dead:add_sub"),
                          timeout=30, what="three dead letters")
        for _, fields in dead:
            error = fields[b"error"].decode()
            assert "holds 41943040 bytes, over the limit" in error, error
        with open(f"/proc/{q.proc.pid}/status") as f:
            after = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) // 1024
        print(f"three 40 MB entries: the job behind them done after {took:.2f} s; consumer RSS {before} -> {after} MB")
        assert after - before < 60 or sanitized(QUERN), (before, after)
    finally:
        q.stop()


class FakeRedis:
    """A TCP server that reads RESP commands and answers each with `answer` (bytes): a Redis that
    speaks garbage. Counts the commands it saw."""

    def __init__(self, answer):
        """`answer`: bytes sent for every command, or a function (args, socket) that answers."""
        import socket as socketlib
        self.answer = answer
        self.commands = []
        self.sock = socketlib.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn):
        buf = b""
        try:
            while True:
                data = conn.recv(65536)
                if not data:
                    return
                buf += data
                while True:
                    cmd, rest = self._parse(buf)
                    if cmd is None:
                        break
                    buf = rest
                    self.commands.append(cmd[0].upper() if cmd else b"")
                    if callable(self.answer):
                        self.answer(cmd, conn)
                    else:
                        conn.sendall(self.answer)
        except OSError:
            return

    @staticmethod
    def _parse(buf):
        """One RESP array of bulk strings from the front of `buf`: (args, rest), or (None, buf)."""
        if not buf.startswith(b"*") or b"\r\n" not in buf:
            return None, buf
        head, rest = buf.split(b"\r\n", 1)
        args = []
        for _ in range(int(head[1:])):
            if b"\r\n" not in rest:
                return None, buf
            size_line, rest = rest.split(b"\r\n", 1)
            size = int(size_line[1:])
            if len(rest) < size + 2:
                return None, buf
            args.append(rest[:size])
            rest = rest[size + 2:]
        return args, rest

    def url(self):
        return f"redis://127.0.0.1:{self.port}"

    def stop(self):
        self.sock.close()


def test_a_redis_that_answers_garbage_never_makes_a_job_durable(repo):
    """Issue: a Redis answering `:7` to every command (MULTI, SET, EXEC alike) still gave 202
    "durable": true. A job is durable only when EXEC's reply says each queued command ran: here the
    submission is refused (503) with a message that names Redis, or at least not called durable."""
    fake = FakeRedis(b":7\r\n")
    q = Quern(repo, "--redis-url", fake.url())
    try:
        status, _, data = q.request("POST", "/v2/models/add_sub/jobs",
                                    add_sub_body(np.ones((1, 4), np.float32), np.ones((1, 4), np.float32)))
        assert b"EXEC" in b" ".join(fake.commands) or status != 202, (status, data, fake.commands[:10])
        if status == 202:
            assert json.loads(data)["durable"] is False, data
        else:
            assert status == 503 and b"redis" in data.lower(), (status, data)
    finally:
        q.stop()
        fake.stop()


def test_a_huge_reply_from_redis_is_not_read_into_memory(repo):
    """Issue: a 700 MB reply to the result store's GET took the server to 1,470 MB (779 MB kept).
    Every reply the store reads is now bounded by what a result may hold (--job-store-max-bytes,
    256 MiB): a longer value is dropped as it arrives and the read fails with a clear error."""
    from quern_testing import sanitized
    if sanitized(QUERN):
        pytest.skip("AddressSanitizer's quarantine holds freed memory: resident memory says little")
    size = 700 << 20

    def answer(args, conn):
        name = args[0].upper() if args else b""
        if name == b"GET":
            conn.sendall(b"$%d\r\n" % size)
            chunk = b"x" * (1 << 20)
            for _ in range(size >> 20):
                conn.sendall(chunk)
            conn.sendall(b"\r\n")
        elif name == b"PING":
            conn.sendall(b"+PONG\r\n")
        else:
            conn.sendall(b"+OK\r\n")

    fake = FakeRedis(answer)
    q = Quern(repo, "--redis-url", fake.url())
    try:
        from quern_testing import rss_mb

        def rss():
            return rss_mb(q.proc.pid)
        before = rss()
        peak = [before]
        done = threading.Event()

        def sample():
            while not done.is_set():
                peak[0] = max(peak[0], rss())
                time.sleep(0.02)
        t = threading.Thread(target=sample)
        t.start()
        job = "%012x-%s" % (int(time.time() * 1000), "0" * 32)  # a job id's shape: submit time, random part
        status, _, data = q.request("GET", f"/v2/jobs/{job}")
        done.set()
        t.join()
        print(f"a {size >> 20} MB GET reply: RSS {before:.0f} MB before, peak {peak[0]:.0f} MB; answered {status} "
              f"{data[:160]}")
        assert status >= 500 and b"not read" in data, (status, data)
        assert peak[0] < before + 100, (before, peak[0])
        assert q.proc.poll() is None
    finally:
        q.stop()
        fake.stop()


def test_a_stream_entry_cannot_take_over_another_owners_job(repo, redis_server, tmp_path):
    """Issue: a stream producer wrote an entry reusing a victim's HTTP job id with its own owner: the
    victim got 404 for its own job and the entry's owner read its result. Every entry now claims its
    job's record in one step on the Redis side (a script): a record of another owner makes the entry
    acknowledged and not run, and nothing is written under that id."""
    from quern_testing import wait_until
    victim_key, other_key = "k-victim-0123456789abcdef", "k-other-0123456789abcdef"
    (tmp_path / "keys").write_text(f"{victim_key}\n{other_key}\n")
    keys = ("--api-keys", str(tmp_path / "keys"))
    r = redis_server.client()
    accepter = Quern(repo, "--redis-url", redis_server.url(), "--no-consume", *keys)
    consumer = None
    try:
        one = np.ones((1, 4), np.float32)
        status, _, data = accepter.request("POST", "/v2/models/add_sub/jobs", add_sub_body(one, one),
                                           {"Authorization": f"Bearer {victim_key}"})
        assert status == 202, data
        job = json.loads(data)["job_id"]
        # Into another model's stream, with a body of its own: its consumer claims the victim's id.
        r.xadd("quern:jobs:slow_batch", {"id": job, "body": json.dumps(slow_body(np.ones((1, 3), np.float32))),
                                          "owner": "someone else", "tracked": "1"})
        consumer = Quern(repo, "--redis-url", redis_server.url(), "--consume-models", "slow_batch", *keys)
        def taken():
            try:
                return all_taken(r, "quern:jobs:slow_batch")
            except StopIteration:  # the consumer's group is not there yet
                return False
        wait_until(taken, timeout=30, what="the entry taken and acknowledged")
        status, _, data = accepter.request("GET", f"/v2/jobs/{job}", headers={"Authorization": f"Bearer {victim_key}"})
        assert status == 200, data
        doc = json.loads(data)
        assert doc["status"] == "queued" and doc.get("model", "add_sub") == "add_sub", doc
        assert consumer.metric('quern_stream_entries_total{outcome="foreign"}') == 1
    finally:
        accepter.stop()
        if consumer:
            consumer.stop()


def test_a_hung_redis_never_stalls_other_requests(repo):
    """Issue: while one job request waited on a Redis that did not answer, a plain infer on the same
    HTTP I/O thread took 4.5-5.0 s. Job lookups now wait on a thread of their own: the infer is
    answered while the lookup still waits, and the lookup fails with 503 once Redis's time is up."""
    from quern_testing import wait_until
    hung = threading.Event()
    before = set()  # connections made before the lookup (the result writer's)
    looking = threading.Event()

    def answer(args, conn):
        if looking.is_set() and conn not in before:
            hung.set()  # the lookup's connection: its first command (it waits for an answer that never comes)
        elif not looking.is_set():
            before.add(conn)
    fake = FakeRedis(answer)
    q = Quern(repo, "--redis-url", fake.url(), "--http-threads", "1")
    try:
        job = "%012x-%s" % (int(time.time() * 1000), "0" * 32)
        looked_up = []
        wait_until(lambda: before, timeout=30, what="the result writer's first command")
        looking.set()
        t = threading.Thread(target=lambda: looked_up.append(q.request("GET", f"/v2/jobs/{job}")))
        t.start()
        assert hung.wait(30), "the lookup never reached redis"
        one = np.ones((1, 4), np.float32)
        status, _, data = q.request("POST", "/v2/models/add_sub/infer", add_sub_body(one, one))
        still_waiting = t.is_alive()
        t.join(timeout=60)
        assert status == 200, data
        assert still_waiting, "the infer was answered only after the job lookup ended"
        status, _, data = looked_up[0]
        assert status == 503 and b"redis" in data, (status, data)
    finally:
        q.stop()
        fake.stop()
