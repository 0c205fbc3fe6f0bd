"""The HTTP transport of a real `quern serve`, through raw sockets: keep-alive,
pipelining, chunked bodies, HTTP/1.0, size limits (413/431), the connection
limit (503), idle and read timeouts, malformed requests.

The server runs with small limits so that each one can be reached."""
import json
import os
import re
import socket
import time

import numpy as np
import pytest

from quern_testing import start_quern

QUERN = os.environ["QUERN_BIN"]
MODELS = os.environ["QUERN_TEST_MODELS"]

MAX_BODY = 4096
MAX_HEADER = 1024
MAX_CONNECTIONS = 4
# The read timeout closes a stalled request within about 2 s (its deadline is looked at by a sweep
# every 0.5 s); the idle timeout is far enough beyond it that a loaded machine's late sweeps cannot
# make the test mistake one for the other.
IDLE_S = 4
READ_S = 1


def start_server(*extra):
    proc, ports = start_quern(QUERN, MODELS, *extra)
    return proc, ports["HTTP"]


@pytest.fixture(scope="module")
def port():
    proc, p = start_server("--http-max-body-bytes", str(MAX_BODY), "--http-max-header-bytes", str(MAX_HEADER),
                           "--http-max-connections", str(MAX_CONNECTIONS), "--http-idle-timeout-secs", str(IDLE_S),
                           "--http-read-timeout-secs", str(READ_S))
    yield p
    proc.terminate()
    proc.wait(timeout=30)


class Conn:
    """One TCP connection that reads HTTP/1.1 responses (Content-Length framed)."""

    def __init__(self, port, rcvbuf=None):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf:  # before connect, so the window stays small
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.sock.settimeout(10)
        self.sock.connect(("127.0.0.1", port))
        self.buf = b""

    def send(self, data):
        self.sock.sendall(data)

    def _fill(self):
        chunk = self.sock.recv(65536)
        if not chunk:
            raise EOFError("connection closed by the server")
        self.buf += chunk

    def response(self):
        while b"\r\n\r\n" not in self.buf:
            self._fill()
        head, self.buf = self.buf.split(b"\r\n\r\n", 1)
        lines = head.decode().split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
        assert "chunked" not in headers.get("transfer-encoding", ""), "responses are never chunked"
        length = int(headers["content-length"])
        while len(self.buf) < length:
            self._fill()
        body, self.buf = self.buf[:length], self.buf[length:]
        return status, headers, body

    def closed_by_server(self, within_s):
        """True when the server closes the connection within `within_s` seconds."""
        self.sock.settimeout(within_s)
        try:
            while True:
                if not self.sock.recv(65536):
                    return True
        except (socket.timeout, TimeoutError):
            return False
        except ConnectionResetError:
            return True

    def close(self):
        self.sock.close()


def add_sub_request(a, b, extra_headers=b"", version=b"HTTP/1.1"):
    body = json.dumps({"inputs": [
        {"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": a.tolist()},
        {"name": "INPUT1", "shape": [1, 4], "datatype": "FP32", "data": b.tolist()}]}).encode()
    return (b"POST /v2/models/add_sub/infer " + version + b"\r\nHost: t\r\nContent-Type: application/json\r\n" +
            extra_headers + b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


def outputs(body):
    return {o["name"]: np.array(o["data"], np.float32) for o in json.loads(body)["outputs"]}


def test_keep_alive_serves_many_requests_on_one_connection(port):
    c = Conn(port)
    rng = np.random.default_rng(1)
    for _ in range(5):
        a, b = rng.standard_normal(4).astype(np.float32), rng.standard_normal(4).astype(np.float32)
        c.send(add_sub_request(a, b))
        status, headers, body = c.response()
        assert status == 200
        assert "close" not in headers.get("connection", "")
        np.testing.assert_allclose(outputs(body)["OUTPUT0"], a + b, rtol=1e-6)
    c.close()


def test_pipelined_requests_are_answered_in_order(port):
    c = Conn(port)
    pairs = [(np.full(4, i, np.float32), np.arange(4, dtype=np.float32)) for i in range(4)]
    c.send(b"".join(add_sub_request(a, b) for a, b in pairs))
    for a, b in pairs:
        status, _, body = c.response()
        assert status == 200
        np.testing.assert_allclose(outputs(body)["OUTPUT1"], a - b)
    c.close()


def test_chunked_request_body(port):
    a, b = np.array([1, 2, 3, 4], np.float32), np.array([10, 20, 30, 40], np.float32)
    full = add_sub_request(a, b)
    body = full.split(b"\r\n\r\n", 1)[1]
    chunks = [body[:10], body[10:]]
    wire = b"".join(b"%x\r\n%s\r\n" % (len(ch), ch) for ch in chunks) + b"0\r\n\r\n"
    c = Conn(port)
    c.send(b"POST /v2/models/add_sub/infer HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n" + wire)
    status, _, resp = c.response()
    assert status == 200, resp
    np.testing.assert_allclose(outputs(resp)["OUTPUT0"], a + b)
    c.close()


def test_http10_request_gets_its_answer_and_the_connection_closes(port):
    c = Conn(port)
    c.send(add_sub_request(np.ones(4, np.float32), np.ones(4, np.float32), version=b"HTTP/1.0"))
    status, headers, body = c.response()
    assert status == 200
    np.testing.assert_allclose(outputs(body)["OUTPUT0"], np.full(4, 2, np.float32))
    assert c.closed_by_server(5)


def test_body_over_the_limit_gets_413_before_the_body_is_sent(port):
    c = Conn(port)
    # Only the head goes out: the answer must come from Content-Length alone.
    c.send(b"POST /v2/models/add_sub/infer HTTP/1.1\r\nHost: t\r\nContent-Length: " + str(MAX_BODY + 1).encode() +
           b"\r\n\r\n")
    status, headers, body = c.response()
    assert status == 413
    assert str(MAX_BODY) in json.loads(body)["error"]
    assert headers.get("connection") == "close"
    assert c.closed_by_server(5)


def test_headers_over_the_limit_get_431(port):
    c = Conn(port)
    c.send(b"GET /v2/health/live HTTP/1.1\r\nHost: t\r\nX-Padding: " + b"a" * (MAX_HEADER + 10) + b"\r\n\r\n")
    status, _, body = c.response()
    assert status == 431
    assert str(MAX_HEADER) in json.loads(body)["error"]
    assert c.closed_by_server(5)


def test_malformed_request_gets_400_with_the_reason(port):
    c = Conn(port)
    c.send(b"POST /v2/models/add_sub/infer HTTP/1.1\r\nHost: t\r\nContent-Length: nope\r\n\r\n")
    status, _, body = c.response()
    assert status == 400
    assert "malformed HTTP request" in json.loads(body)["error"]


def test_idle_connection_is_closed_after_the_idle_timeout(port):
    c = Conn(port)
    c.send(b"GET /v2/health/live HTTP/1.1\r\nHost: t\r\n\r\n")
    assert c.response()[0] == 200
    t0 = time.time()
    assert c.closed_by_server(IDLE_S + 3)
    assert time.time() - t0 >= IDLE_S - 0.6  # the sweep runs every 0.5 s


def test_slow_request_is_closed_after_the_read_timeout(port):
    c = Conn(port)
    c.send(b"POST /v2/models/add_sub/infer HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\n{\"inp")
    t0 = time.time()
    assert c.closed_by_server(READ_S + 3)
    # The idle timeout is longer: the read timeout is what closed it.
    assert time.time() - t0 < IDLE_S + 0.5


def hold_connections(port, n):
    """n connections that each had a request answered and now sit idle, oldest first. Other tests'
    connections may still be closing: waits until the server has room for them."""
    held = []
    deadline = time.time() + 10
    while len(held) < n and time.time() < deadline:
        c = Conn(port)
        c.send(b"GET /v2/health/live HTTP/1.1\r\nHost: t\r\n\r\n")
        status, _, _ = c.response()
        if status == 200:
            held.append(c)
            time.sleep(0.01)  # distinct idle times
        else:
            c.close()
            time.sleep(0.2)
    assert len(held) == n
    return held


def test_at_the_connection_limit_the_oldest_idle_connection_makes_room(port):
    held = hold_connections(port, MAX_CONNECTIONS)
    extra = Conn(port)
    extra.send(b"GET /v2/health/live HTTP/1.1\r\nHost: t\r\n\r\n")
    status, _, _ = extra.response()
    assert status == 200
    assert held[0].closed_by_server(2), "the oldest idle connection was not closed"
    # The others were left alone and still serve.
    for c in held[1:]:
        c.send(b"GET /v2/health/live HTTP/1.1\r\nHost: t\r\n\r\n")
        assert c.response()[0] == 200
    for c in held + [extra]:
        c.close()


def test_connection_limit_answers_503_when_no_connection_is_idle_and_recovers(port):
    # Last of the tests on this server: it leaves connections closing behind it.
    held = hold_connections(port, MAX_CONNECTIONS)
    # Each held connection has sent a request's head and part of its body: busy, not idle (a
    # connection whose head is still arriving is as evictable as an idle one). The server's
    # "100 Continue" says it has read the head.
    for c in held:
        c.send(b"POST /v2/models/add_sub/infer HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n"
               b"Expect: 100-continue\r\n\r\n")
        while b"\r\n\r\n" not in c.buf:
            c._fill()
        interim, c.buf = c.buf.split(b"\r\n\r\n", 1)
        assert interim.startswith(b"HTTP/1.1 100"), interim
        c.send(b"{")
    extra = Conn(port)
    extra.send(b"GET /v2/health/live HTTP/1.1\r\nHost: t\r\n\r\n")
    status, headers, body = extra.response()
    assert status == 503
    assert "too many open connections" in json.loads(body)["error"]
    assert extra.closed_by_server(5)
    held.pop().close()
    assert wait_for_room(port), "a closed connection did not free its place"
    for c in held:
        c.close()


def wait_for_room(port, within_s=10):
    """True once a new connection is served (not refused with 503) within `within_s` seconds."""
    deadline = time.time() + within_s
    while time.time() < deadline:
        c = Conn(port)
        try:
            c.send(b"GET /v2/health/live HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
            if c.response()[0] == 200:
                return True
        finally:
            c.close()
        time.sleep(0.1)
    return False


def test_many_concurrent_connections_each_get_their_own_result():
    # A server without the tight connection limit.
    proc, p = start_server()
    try:
        conns = [Conn(p) for _ in range(32)]
        rng = np.random.default_rng(7)
        expected = []
        for c in conns:
            a, b = rng.standard_normal(4).astype(np.float32), rng.standard_normal(4).astype(np.float32)
            c.send(add_sub_request(a, b))
            expected.append(a + b)
        for c, e in zip(conns, expected):
            status, _, body = c.response()
            assert status == 200
            np.testing.assert_allclose(outputs(body)["OUTPUT0"], e, rtol=1e-6)
        for c in conns:
            c.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_response_larger_than_the_socket_takes_is_finished_in_order():
    """A slow reader with a small window: the server's first send cannot take the whole response, the rest
    is written as the client reads, and the next request on the connection is still answered."""
    import tritonclient.http as httpclient
    from quern_testing import DTYPE_ARRAYS, DTYPE_NAMES
    proc, p = start_server()
    try:
        rows = 16
        arrays = {name: np.repeat(a, rows, axis=0) for name, a in DTYPE_ARRAYS.items()}
        arrays["in_string"] = np.array([[bytes([65 + (r + k) % 26]) * 300_000 for k in range(2)] for r in range(rows)],
                                       np.object_)  # ~9.6 MB of strings
        inputs = []
        for name, a in arrays.items():
            i = httpclient.InferInput(name, list(a.shape), DTYPE_NAMES[name])
            i.set_data_from_numpy(a, binary_data=True)
            inputs.append(i)
        requested = [httpclient.InferRequestedOutput(n.replace("in_", "out_"), binary_data=True) for n in arrays]
        body, json_size = httpclient.InferenceServerClient.generate_request_body(inputs, outputs=requested)
        head = (b"POST /v2/models/dtypes/infer HTTP/1.1\r\nHost: t\r\nContent-Type: application/octet-stream\r\n"
                b"Inference-Header-Content-Length: " + str(json_size).encode() + b"\r\n"
                b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n")
        c = Conn(p, rcvbuf=16384)
        c.send(head + body)
        time.sleep(0.5)  # let the server's send buffer fill up before reading
        status, headers, resp = c.response()
        assert status == 200
        r = httpclient.InferenceServerClient.parse_response_body(
            resp, header_length=int(headers["inference-header-content-length"]))
        for name, a in arrays.items():
            got = r.as_numpy(name.replace("in_", "out_"))
            assert got.shape == a.shape, name
            assert (got == a).all(), name
        c.send(add_sub_request(np.ones(4, np.float32), np.ones(4, np.float32)))
        status, _, small = c.response()
        assert status == 200
        np.testing.assert_allclose(outputs(small)["OUTPUT0"], np.full(4, 2, np.float32))
        c.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def binary_add_sub_request(a, b, extra_headers=b"", expect=False, pad=5000):
    """add_sub with binary inputs, the body made kilobytes long by a long request id (`pad` bytes);
    outputs come back as JSON."""
    header = json.dumps({"id": "p" * pad, "inputs": [
        {"name": "INPUT0", "shape": list(a.shape), "datatype": "FP32", "parameters": {"binary_data_size": a.nbytes}},
        {"name": "INPUT1", "shape": list(b.shape), "datatype": "FP32", "parameters": {"binary_data_size": b.nbytes}}],
        "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": False}},
                    {"name": "OUTPUT1", "parameters": {"binary_data": False}}]}).encode()
    body = header + a.tobytes() + b.tobytes()
    head = (b"POST /v2/models/add_sub/infer HTTP/1.1\r\nHost: t\r\n" + extra_headers +
            b"Inference-Header-Content-Length: " + str(len(header)).encode() + b"\r\n" +
            (b"Expect: 100-continue\r\n" if expect else b"") +
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n")
    return head, body


def test_requests_alike_and_not_on_one_connection_each_get_their_result():
    """A connection's request is read with one recvmsg when it looks like the one before (same head and
    body lengths); every way of differing from it (a longer or shorter head, another body length, a
    request without a body, two requests at once, a body that comes late, 100-continue) must still
    frame and answer each request exactly."""
    proc, port = start_server()
    try:
        c = Conn(port)
        rng = np.random.default_rng(7)

        def check(rows, extra=b"", split=None, pad=5000):
            a = rng.standard_normal((rows, 4)).astype(np.float32)
            b = rng.standard_normal((rows, 4)).astype(np.float32)
            head, body = binary_add_sub_request(a, b, extra, pad=pad)
            if split is None:
                c.send(head + body)
            else:  # the head and part of the body, then the rest a moment later
                c.send(head + body[:split])
                time.sleep(0.05)
                c.send(body[split:])
            status, _, got = c.response()
            assert status == 200, got
            out = json.loads(got)["outputs"]
            np.testing.assert_allclose(np.array(out[0]["data"], np.float32).reshape(rows, 4), a + b, rtol=1e-6)
            np.testing.assert_allclose(np.array(out[1]["data"], np.float32).reshape(rows, 4), a - b, rtol=1e-6)

        for _ in range(3):
            check(8)  # alike: read with one recvmsg after the first
        check(8, b"X-Longer-Head: " + b"x" * 40 + b"\r\n")  # a longer head
        check(8, b"X-Longer-Head: " + b"x" * 40 + b"\r\n")
        check(8)  # a shorter head than the one before
        check(8, pad=5001)  # another body length, the same head length
        check(9)  # another body length
        check(8)
        check(8, split=1000)  # a body that arrives in two parts
        check(8, split=10)
        # A request without a body, then one alike again.
        c.send(b"GET /v2/models/add_sub HTTP/1.1\r\nHost: t\r\n\r\n")
        assert c.response()[0] == 200
        check(8)
        check(8)
        # Two requests sent at once: the second's bytes must not be read as the first's.
        a = np.ones((8, 4), np.float32)
        first, second = binary_add_sub_request(a, a), binary_add_sub_request(a * 2, a)
        c.send(first[0] + first[1] + second[0] + second[1])
        for want in (a + a, a * 2 + a):
            status, _, got = c.response()
            assert status == 200
            np.testing.assert_allclose(np.array(json.loads(got)["outputs"][0]["data"], np.float32).reshape(8, 4), want)
        c.close()
        # 100-continue: the head comes alone, the body after the server's go-ahead.
        c = Conn(port)
        for _ in range(3):
            a = rng.standard_normal((8, 4)).astype(np.float32)
            head, body = binary_add_sub_request(a, a, expect=True)
            c.send(head)
            while b"\r\n\r\n" not in c.buf:
                c._fill()
            line, c.buf = c.buf.split(b"\r\n\r\n", 1)
            assert line.startswith(b"HTTP/1.1 100"), line
            c.send(body)
            status, _, got = c.response()
            assert status == 200, got
            np.testing.assert_allclose(np.array(json.loads(got)["outputs"][0]["data"], np.float32).reshape(8, 4), a + a)
        c.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_transfer_encodings_other_than_one_chunked_are_refused(port):
    """Only `Transfer-Encoding: chunked` frames a body besides Content-Length. A coding list, another
    coding (with or without a Content-Length) or the field twice could be framed differently by a proxy
    in front: 400 and the connection closes, so no byte of it is read as a next request."""
    smuggled = b"GET /v2/health/ready HTTP/1.1\r\nHost: t\r\n\r\n"
    for te in (b"Transfer-Encoding: gzip\r\nContent-Length: %d\r\n" % len(smuggled),
               b"Transfer-Encoding: chunked, gzip\r\n",
               b"Transfer-Encoding: gzip, chunked\r\n",
               b"Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n",
               b"Transfer-Encoding: identity\r\nContent-Length: %d\r\n" % len(smuggled)):
        c = Conn(port)
        c.send(b"POST /v2/models/add_sub/infer HTTP/1.1\r\nHost: t\r\n" + te + b"\r\n" + smuggled)
        status, headers, body = c.response()
        assert status == 400, (te, body)
        assert b"Transfer-Encoding" in body and headers.get("connection") == "close", (te, body)
        assert c.closed_by_server(5), te  # nothing more is answered on it
        c.close()
    # One "chunked", in any case and with spaces around it, still works.
    a, b = np.array([1, 2, 3, 4], np.float32), np.array([4, 3, 2, 1], np.float32)
    body = add_sub_request(a, b).split(b"\r\n\r\n", 1)[1]
    c = Conn(port)
    c.send(b"POST /v2/models/add_sub/infer HTTP/1.1\r\nHost: t\r\nTransfer-Encoding:  Chunked \r\n\r\n" +
           b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
    status, _, resp = c.response()
    assert status == 200, resp
    np.testing.assert_allclose(outputs(resp)["OUTPUT0"], a + b)
    c.close()


def _ready_first_then_every_port(binary, repo, ask_http):
    """Starts a server on fixed free ports and polls one readiness (HTTP /v2/health/ready, or gRPC
    health) as fast as it can from the first instant; at the first 'ready', returns the ports that
    do not accept a connection yet (none, when readiness waits for every port)."""
    import subprocess
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from quern_testing import free_port
    import tempfile
    http, grpc_port, metrics = free_port(), free_port(), free_port()
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen([binary, "serve", "--model-repository", repo, "--http-port", str(http), "--grpc-port",
                             str(grpc_port), "--metrics-port", str(metrics), "--host", "127.0.0.1"],
                            stdout=subprocess.DEVNULL, stderr=log)
    try:
        deadline = time.time() + 60
        while time.time() < deadline:
            if proc.poll() is not None:  # say why, instead of polling a server that is gone
                log.seek(0)
                why = log.read().decode(errors="replace")
                if "in use" in why:
                    raise PortTaken(why)  # another test took a port between free_port and the bind
                raise AssertionError(f"the server exited ({proc.returncode}) before it was ready: {why}")
            try:
                if ask_http:
                    with socket.create_connection(("127.0.0.1", http), timeout=2) as s:
                        s.sendall(b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                        ready = s.recv(64).startswith(b"HTTP/1.1 200")
                else:
                    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as ch:
                        ready = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2).status \
                            == health_pb2.HealthCheckResponse.SERVING
            except (OSError, grpc.RpcError):
                ready = False
            if ready:
                closed = []
                for p in (http, grpc_port, metrics):
                    try:
                        socket.create_connection(("127.0.0.1", p), timeout=2).close()
                    except OSError:
                        closed.append(p)
                return closed
        raise AssertionError("the server never said ready")
    finally:
        proc.kill()
        proc.wait()
        log.close()


class PortTaken(Exception):
    """A port chosen free was taken by another test before the server bound it."""


@pytest.mark.parametrize("ask_http", [True, False], ids=["http", "grpc-health"])
def test_ready_only_once_every_port_listens(tmp_path, ask_http):
    """A load balancer or probe that finds one port ready must find the others listening: HTTP used
    to answer ready before the gRPC and metrics ports were bound (19 of 20 starts, caught by polling
    from the first instant)."""
    import shutil
    repo = tmp_path / "models"
    repo.mkdir()
    shutil.copytree(os.path.join(os.environ["QUERN_TEST_MODELS"], "add_sub"), repo / "add_sub")
    started = 0
    for _ in range(10):
        try:
            assert _ready_first_then_every_port(os.environ["QUERN_BIN"], str(repo), ask_http) == []
        except PortTaken:
            continue
        started += 1
        if started == 5:
            break
    assert started == 5, "ports taken by other tests on most starts"


def test_an_inference_header_length_that_is_empty_or_sent_twice_is_refused(port):
    """Inference-Header-Content-Length splits a body into its JSON header and binary data. Sent with no
    value, or twice with two values (a proxy in front may have kept either), the split is not known:
    400 naming the field and the model, on /infer and on /jobs alike, and no job is made. Twice with one
    value splits the body one way and is served."""
    a, b = np.array([[1, 2, 3, 4]], np.float32), np.array([[4, 3, 2, 1]], np.float32)
    head, body = binary_add_sub_request(a, b, pad=10)
    n = re.search(rb"Inference-Header-Content-Length: (\d+)\r\n", head).group(1)
    other = str(int(n) - 4).encode()
    for route in (b"/v2/models/add_sub/infer", b"/v2/models/add_sub/jobs"):
        for field in (b"Inference-Header-Content-Length:\r\n", b"Inference-Header-Content-Length:   \r\n",
                      b"Inference-Header-Content-Length: " + other + b"\r\n"):
            c = Conn(port)
            c.send(head.replace(b"/v2/models/add_sub/infer", route).replace(b"Host: t\r\n", b"Host: t\r\n" + field) +
                   body)
            status, _, resp = c.response()
            error = json.loads(resp).get("error", "")
            assert status == 400 and "Inference-Header-Content-Length" in error and "add_sub" in error, \
                (route, field, status, resp)
            assert b"job_id" not in resp
            c.close()
        c = Conn(port)
        c.send(head.replace(b"/v2/models/add_sub/infer", route).replace(
            b"Host: t\r\n", b"Host: t\r\nInference-Header-Content-Length: " + n + b"\r\n") + body)
        status, _, resp = c.response()
        assert status == (200 if route.endswith(b"infer") else 202), (route, resp)
        if route.endswith(b"infer"):
            np.testing.assert_allclose(outputs(resp)["OUTPUT0"], (a + b).ravel())
        c.close()
