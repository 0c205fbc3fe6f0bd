"""Keys, model control, rate limits and TLS on a real `quern serve`, driven by real clients
(tritonclient over HTTP and gRPC, raw HTTP for the vision routes), with certificates the test
makes with openssl."""
import http.client
import json
import os
import shutil
import subprocess
import time

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from quern_testing import http_request, start_quern

QUERN = os.environ["QUERN_BIN"]
MODELS = os.environ["QUERN_TEST_MODELS"]

USER_KEY = "user-key-0123456789"
ADMIN_KEY = "admin-key-9876543210"
ENV_KEY = "env-key-abcdef"


request = http_request


def bearer(key):
    return {"Authorization": f"Bearer {key}"}


def grpc_bearer(key):
    return {"authorization": f"Bearer {key}"}  # gRPC metadata keys are lower case


def add_sub_body():
    return json.dumps({"inputs": [
        {"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]},
        {"name": "INPUT1", "shape": [1, 4], "datatype": "FP32", "data": [1, 1, 1, 1]}]}).encode()


def png_bytes():
    import struct
    import zlib
    raw = b"".join(b"\x00" + b"\xff\x00\x00" * 64 for _ in range(64))

    def chunk(t, d):
        return struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d) & 0xffffffff)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 64, 64, 8, 2, 0, 0, 0)) +
            chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


def multipart(fields):
    body = b""
    for name, (filename, data) in fields.items():
        disp = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        body += b"--xx\r\nContent-Disposition: " + disp.encode() + b"\r\n\r\n" + data + b"\r\n"
    return body + b"--xx--\r\n", {"Content-Type": "multipart/form-data; boundary=xx"}


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    d = tmp_path_factory.mktemp("keys")
    (d / "keys.txt").write_text(f"# users\n{USER_KEY}\n\n")
    (d / "admin.txt").write_text(f"{ADMIN_KEY}\n")
    repo = d / "repo"
    repo.mkdir()
    for m in ("add_sub", "detect_yolov8"):
        shutil.copytree(os.path.join(MODELS, m), repo / m)
    old = os.environ.get("QUERN_API_KEYS")
    os.environ["QUERN_API_KEYS"] = ENV_KEY
    try:
        proc, ports = start_quern(QUERN, str(repo), "--api-keys", str(d / "keys.txt"), "--admin-keys",
                                  str(d / "admin.txt"), "--model-control", "explicit", "--metrics-need-key")
    finally:
        if old is None:
            del os.environ["QUERN_API_KEYS"]
        else:
            os.environ["QUERN_API_KEYS"] = old
    yield ports
    proc.terminate()
    proc.wait(timeout=30)


KSERVE_ROUTES = [("GET", "/v2", None), ("GET", "/v2/health/live", None), ("GET", "/v2/health/ready", None),
                 ("GET", "/v2/models/add_sub", None), ("GET", "/v2/models/add_sub/ready", None),
                 ("GET", "/v2/models/add_sub/config", None), ("GET", "/v2/models/stats", None),
                 ("POST", "/v2/models/add_sub/infer", add_sub_body()), ("POST", "/v2/repository/index", b"{}"),
                 ("POST", "/v2/models/add_sub/jobs", add_sub_body()), ("GET", "/v2/jobs/nope", None)]


@pytest.mark.parametrize("method,path,body", KSERVE_ROUTES)
def test_every_kserve_and_job_route_needs_a_key(keyed, method, path, body):
    port = keyed["HTTP"]
    for headers in ({}, bearer("wrong"), {"Authorization": "Basic dXNlcjpwYXNz"}):
        status, h, data = request(port, method, path, body, headers)
        assert status == 401, (path, headers, status, data)
        assert h.get("WWW-Authenticate") == "Bearer"
        assert "key" in json.loads(data)["error"]
    for key in (USER_KEY, ADMIN_KEY, ENV_KEY):
        status, _, data = request(port, method, path, body, bearer(key))
        assert status != 401, (path, key, data)
    status, _, _ = request(port, method, path, body, {"X-API-Key": USER_KEY})
    assert status != 401


def test_a_job_is_read_and_cancelled_only_with_the_key_that_submitted_it(keyed):
    port = keyed["HTTP"]
    status, _, data = request(port, "POST", "/v2/models/add_sub/jobs", add_sub_body(), bearer(USER_KEY))
    assert status == 202, data
    job = json.loads(data)["job_id"]
    for _ in range(500):
        status, _, data = request(port, "GET", f"/v2/jobs/{job}", None, bearer(USER_KEY))
        assert status == 200, data
        if json.loads(data)["status"] == "done":
            break
        time.sleep(0.01)
    assert json.loads(data)["result"]["outputs"][0]["data"] == [2, 3, 4, 5]
    # Another valid key: the job is an id never issued, not a result.
    for method in ("GET", "DELETE"):
        status, _, data = request(port, method, f"/v2/jobs/{job}", None, bearer(ENV_KEY))
        assert status == 404 and b"no job" in data and b"OUTPUT" not in data, (method, status, data)
    status, _, _ = request(port, "GET", f"/v2/jobs/{job}", None, {"X-API-Key": USER_KEY})
    assert status == 200


def test_tritonclient_http_with_a_key(keyed):
    c = httpclient.InferenceServerClient(f"127.0.0.1:{keyed['HTTP']}")
    assert not c.is_server_ready()
    assert c.is_server_ready(headers=bearer(USER_KEY))
    x = httpclient.InferInput("INPUT0", [1, 4], "FP32")
    x.set_data_from_numpy(np.ones((1, 4), np.float32))
    y = httpclient.InferInput("INPUT1", [1, 4], "FP32")
    y.set_data_from_numpy(np.ones((1, 4), np.float32))
    r = c.infer("add_sub", [x, y], headers=bearer(USER_KEY))
    np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), np.full((1, 4), 2, np.float32))


def test_model_control_needs_an_admin_key(keyed):
    port = keyed["HTTP"]
    status, _, _ = request(port, "POST", "/v2/repository/models/add_sub/load", b"", bearer(USER_KEY))
    assert status == 403
    status, _, data = request(port, "POST", "/v2/repository/models/add_sub/load", b"", bearer(ADMIN_KEY))
    assert status == 200, data
    c = grpcclient.InferenceServerClient(f"127.0.0.1:{keyed['gRPC']}")
    with pytest.raises(InferenceServerException) as e:
        c.load_model("add_sub", headers=grpc_bearer(USER_KEY))
    assert "PERMISSION_DENIED" in str(e.value.status())
    c.load_model("add_sub", headers=grpc_bearer(ADMIN_KEY))


def test_grpc_calls_need_a_key(keyed):
    c = grpcclient.InferenceServerClient(f"127.0.0.1:{keyed['gRPC']}")
    for call in (lambda h: c.is_server_live(headers=h), lambda h: c.get_model_metadata("add_sub", headers=h),
                 lambda h: c.get_model_repository_index(headers=h)):
        with pytest.raises(InferenceServerException) as e:
            call({})
        assert "UNAUTHENTICATED" in str(e.value.status())
        with pytest.raises(InferenceServerException):
            call(grpc_bearer("wrong"))
        call(grpc_bearer(USER_KEY))
    x = grpcclient.InferInput("INPUT0", [1, 4], "FP32")
    x.set_data_from_numpy(np.ones((1, 4), np.float32))
    y = grpcclient.InferInput("INPUT1", [1, 4], "FP32")
    y.set_data_from_numpy(np.ones((1, 4), np.float32))
    with pytest.raises(InferenceServerException):
        c.infer("add_sub", [x, y])
    r = c.infer("add_sub", [x, y], headers=grpc_bearer(USER_KEY))
    np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), np.full((1, 4), 2, np.float32))
    # Streaming: refused without a key, served with one.
    import queue
    results = queue.Queue()
    c.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        c.async_stream_infer("add_sub", [x, y])
    except InferenceServerException:
        pass  # the stream may already have ended with the error
    result, error = results.get(timeout=10)
    assert error is not None and "UNAUTHENTICATED" in str(error)
    c.stop_stream()
    c.start_stream(callback=lambda result, error: results.put((result, error)), headers=grpc_bearer(USER_KEY))
    c.async_stream_infer("add_sub", [x, y])
    result, error = results.get(timeout=10)
    assert error is None
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), np.full((1, 4), 2, np.float32))
    c.stop_stream()


def test_vision_routes_answer_the_codeproject_way(keyed):
    port = keyed["HTTP"]
    body, headers = multipart({"image": ("a.png", png_bytes())})
    status, _, data = request(port, "POST", "/v1/vision/custom/detect_yolov8", body, headers)
    assert status == 200
    doc = json.loads(data)
    assert doc["success"] is False and "key" in doc["error"]
    # The key as a form field (CodeProject.AI clients), a header, or a query parameter.
    body, headers = multipart({"image": ("a.png", png_bytes()), "api_key": (None, USER_KEY.encode())})
    doc = json.loads(request(port, "POST", "/v1/vision/custom/detect_yolov8", body, headers)[2])
    assert doc["success"] is True and doc["predictions"], doc
    body, headers = multipart({"image": ("a.png", png_bytes())})
    doc = json.loads(request(port, "POST", "/v1/vision/detection", body, {**headers, **bearer(USER_KEY)})[2])
    assert doc["success"] is True, doc
    doc = json.loads(request(port, "POST", f"/v1/vision/detection?api_key={USER_KEY}", body, headers)[2])
    assert doc["success"] is True, doc
    body, headers = multipart({"image": ("a.png", png_bytes()), "api_key": (None, b"wrong")})
    doc = json.loads(request(port, "POST", "/v1/vision/detection", body, headers)[2])
    assert doc["success"] is False
    doc = json.loads(request(port, "POST", "/v1/vision/custom/list", b"", {})[2])
    assert doc["success"] is False
    # /predict is not a CodeProject.AI route: a plain 401.
    status, _, _ = request(port, "POST", "/predict/detect_yolov8", b"{}", {})
    assert status == 401


def test_requests_without_a_key_are_refused_before_their_body_is_read(keyed):
    """The key is checked from the request's head: a client without one gets its 401 before it has sent
    its body, and no body of it is decoded (a compressed one included)."""
    import gzip
    import socket
    with socket.create_connection(("127.0.0.1", keyed["HTTP"]), timeout=5) as sock:
        sock.sendall(b"POST /v2/models/add_sub/infer HTTP/1.1\r\nHost: q\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 60000000\r\n\r\n")
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            assert chunk, data
            data += chunk
    assert data.startswith(b"HTTP/1.1 401"), data
    for body in (b"not gzip at all", gzip.compress(add_sub_body())):
        status, _, data = request(keyed["HTTP"], "POST", "/v2/models/add_sub/infer", body,
                                  {"Content-Encoding": "gzip"})
        assert status == 401, data
    status, _, data = request(keyed["HTTP"], "POST", "/v2/models/add_sub/infer", gzip.compress(add_sub_body()),
                              {"Content-Encoding": "gzip", **bearer(USER_KEY)})
    assert status == 200, data


def head_only_answer(port, head):
    """Sends a request head announcing a large body, none of it; returns the answer's head and body start."""
    import socket
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(head)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            assert chunk, data
            data += chunk
        return data


@pytest.mark.parametrize("port_name,head", [
    # A vision form whose body would be inflated: its key cannot be in the form.
    ("HTTP", b"POST /v1/vision/detection HTTP/1.1\r\nHost: q\r\nContent-Encoding: gzip\r\n"
             b"Content-Type: multipart/form-data; boundary=xx\r\nContent-Length: 60000000\r\n\r\n"),
    ("HTTP", b"POST /predict/add_sub HTTP/1.1\r\nHost: q\r\nContent-Length: 60000000\r\n\r\n"),
    ("HTTP", b"POST /v1/vision/detection?api_key=wrong HTTP/1.1\r\nHost: q\r\n"
             b"Content-Type: multipart/form-data; boundary=xx\r\nContent-Length: 60000000\r\n\r\n"),
    ("metrics", b"POST /metrics HTTP/1.1\r\nHost: q\r\nContent-Encoding: gzip\r\nContent-Length: 60000000\r\n\r\n"),
    # No route: no form of a route's is read for a key, so the body is not read at all.
    ("HTTP", b"POST /v1/no/such/route HTTP/1.1\r\nHost: q\r\n"
             b"Content-Type: multipart/form-data; boundary=xx\r\nContent-Length: 60000000\r\n\r\n"),
    ("HTTP", b"POST /v1/vision/detection/more HTTP/1.1\r\nHost: q\r\n"
             b"Content-Type: multipart/form-data; boundary=xx\r\nContent-Length: 60000000\r\n\r\n"),
    ("HTTP", b"GET /dashboard/no-such-file HTTP/1.1\r\nHost: q\r\nContent-Length: 60000000\r\n\r\n"),
])
def test_every_route_checks_the_key_in_the_head_before_the_body(keyed, port_name, head):
    data = head_only_answer(keyed[port_name], head)
    assert data.startswith(b"HTTP/1.1 401") or (data.startswith(b"HTTP/1.1 200") and b'"success":false' in data), data
    assert b"key" in data, data


def test_a_vision_api_key_alone_closes_every_route_that_reveals_or_computes(tmp_path):
    """--vision-api-key without --api-keys: /predict, the model list, the dashboard's state and the KServe
    routes need the key on both ports; a ping and the dashboard's page do not."""
    repo = tmp_path / "repo"
    shutil.copytree(os.path.join(MODELS, "add_sub"), repo / "add_sub")
    proc, ports = start_quern(QUERN, str(repo), "--vision-port", "0", "--vision-api-key", "s3cret")
    try:
        for port in (ports["HTTP"], ports["vision"]):
            status, _, data = request(port, "POST", "/predict/add_sub", b'{"image": "AAAA"}')
            assert status == 401, (port, status, data)
            status, _, data = request(port, "GET", "/dashboard/state")
            assert status == 401, (port, status, data)
            for method in ("GET", "POST"):
                doc = json.loads(request(port, method, "/v1/vision/custom/list")[2])
                assert doc["success"] is False and "api_key" in doc["error"] and "models" not in doc, doc
            doc = json.loads(request(port, "GET", "/v1/vision/custom/list?api_key=s3cret")[2])
            assert doc["success"] is True, doc
            assert json.loads(request(port, "GET", "/v1/status/ping")[2])["success"] is True
            assert request(port, "GET", "/")[0] == 200
        assert request(ports["HTTP"], "POST", "/v2/models/add_sub/infer", add_sub_body())[0] == 401
        assert request(ports["HTTP"], "GET", "/v2/models/add_sub")[0] == 401
        status, _, data = request(ports["HTTP"], "POST", "/v2/models/add_sub/infer", add_sub_body(), bearer("s3cret"))
        assert status == 200, data
        assert request(ports["vision"], "GET", "/dashboard/state", None, bearer("s3cret"))[0] == 200
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_vision_answers_nothing_about_models_without_a_key(tmp_path):
    """Without a key, /v1/vision/detection says the key is missing, not whether a detection model is loaded."""
    (tmp_path / "keys.txt").write_text(USER_KEY + "\n")
    repo = tmp_path / "repo"
    shutil.copytree(os.path.join(MODELS, "add_sub"), repo / "add_sub")
    proc, ports = start_quern(QUERN, str(repo), "--api-keys", str(tmp_path / "keys.txt"))
    try:
        body, headers = multipart({"image": ("a.png", png_bytes())})
        doc = json.loads(request(ports["HTTP"], "POST", "/v1/vision/detection", body, headers)[2])
        assert doc["success"] is False and "key" in doc["error"] and "detection model" not in doc["error"], doc
        body, headers = multipart({"image": ("a.png", png_bytes()), "api_key": (None, USER_KEY.encode())})
        doc = json.loads(request(ports["HTTP"], "POST", "/v1/vision/detection", body, headers)[2])
        assert doc["success"] is False and "no detection model" in doc["error"], doc
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_metrics_need_a_key_when_asked(keyed):
    port = keyed["metrics"]
    assert request(port, "GET", "/metrics")[0] == 401
    status, _, data = request(port, "GET", "/metrics", None, bearer(USER_KEY))
    assert status == 200 and b"quern_" in data


def test_model_control_is_off_unless_explicit(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copytree(os.path.join(MODELS, "add_sub"), repo / "add_sub")
    proc, ports = start_quern(QUERN, str(repo))
    try:
        status, _, data = request(ports["HTTP"], "POST", "/v2/repository/models/add_sub/unload", b"")
        assert status == 400 and "--model-control explicit" in json.loads(data)["error"]
        c = grpcclient.InferenceServerClient(f"127.0.0.1:{ports['gRPC']}")
        with pytest.raises(InferenceServerException) as e:
            c.unload_model("add_sub")
        assert "FAILED_PRECONDITION" in str(e.value.status())
        assert c.is_model_ready("add_sub")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_keys_have_their_own_rate_limits(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copytree(os.path.join(MODELS, "add_sub"), repo / "add_sub")
    (tmp_path / "keys").write_text("a-key\nb-key\n")
    proc, ports = start_quern(QUERN, str(repo), "--api-keys", str(tmp_path / "keys"), "--api-key-rate-limit", "5")
    try:
        conn = http.client.HTTPConnection("127.0.0.1", ports["HTTP"], timeout=30)
        codes = []
        # Until refused: a full bucket lets five through, then a client faster than 5 per second
        # (however loaded the machine, 200 requests take less than 40 s) is refused.
        while 429 not in codes and len(codes) < 200:
            conn.request("GET", "/v2/health/live", headers=bearer("a-key"))
            r = conn.getresponse()
            r.read()
            codes.append(r.status)
        assert codes[:5] == [200] * 5 and 429 in codes, codes
        # Another key has its own bucket.
        assert request(ports["HTTP"], "GET", "/v2/health/live", None, bearer("b-key"))[0] == 200
        c = grpcclient.InferenceServerClient(f"127.0.0.1:{ports['gRPC']}")
        with pytest.raises(InferenceServerException) as e:
            for _ in range(200):
                c.is_server_live(headers=grpc_bearer("b-key"))
        assert "RESOURCE_EXHAUSTED" in str(e.value.status())
        time.sleep(1.2)  # the bucket refills at 5 per second
        assert request(ports["HTTP"], "GET", "/v2/health/live", None, bearer("a-key"))[0] == 200
        # Every message of a stream is a request: one stream cannot pass the limit.
        import queue
        results = queue.Queue()
        time.sleep(1.2)
        c.start_stream(callback=lambda result, error: results.put(error), headers=grpc_bearer("b-key"))
        x = grpcclient.InferInput("INPUT0", [1, 4], "FP32")
        x.set_data_from_numpy(np.ones((1, 4), np.float32))
        y = grpcclient.InferInput("INPUT1", [1, 4], "FP32")
        y.set_data_from_numpy(np.ones((1, 4), np.float32))
        began = time.monotonic()
        for _ in range(20):
            c.async_stream_infer("add_sub", [x, y])
        errors = [results.get(timeout=10) for _ in range(20)]
        took = time.monotonic() - began
        c.stop_stream()
        limited = [e for e in errors if e is not None and "rate limit" in str(e)]
        # At most the burst (5) and what refilled while the stream ran (5 a second) pass: 10 or more
        # are refused when it took under a second, fewer on a machine slow enough to take longer.
        served = 20 - len(limited)
        assert 4 <= served <= 5 + 5 * took + 1, (took, [str(e) for e in errors])
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def make_certificates(d):
    def ssl(*args):
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=d)
    ssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
        "-subj", "/CN=quern test CA")
    (d / "san.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name in ("server", "client"):
        ssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
            "-subj", f"/CN={name}")
        ssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", f"{name}.pem", "-days", "2", "-extfile", "san.cnf")
    # A client certificate from another CA, which the server must refuse.
    ssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "rogue.key", "-out", "rogue.pem", "-days", "2",
        "-subj", "/CN=rogue")


def tls_server(d, *flags):
    """Certificates in `d` and `quern serve` of add_sub with `flags`, each ending in .pem or .key
    naming a file in `d` (e.g. "--tls-cert-file", "server.pem")."""
    make_certificates(d)
    repo = d / "repo"
    repo.mkdir()
    shutil.copytree(os.path.join(MODELS, "add_sub"), repo / "add_sub")
    args = [str(d / a) if a.endswith((".pem", ".key")) else a for a in flags]
    return start_quern(QUERN, str(repo), *args)


def test_grpc_over_tls_with_client_certificates(tmp_path):
    proc, ports = tls_server(tmp_path, "--grpc-tls-cert-file", "server.pem", "--grpc-tls-key-file", "server.key",
                             "--grpc-tls-client-ca-file", "ca.pem")
    url = f"localhost:{ports['gRPC']}"
    try:
        c = grpcclient.InferenceServerClient(url, ssl=True, root_certificates=str(tmp_path / "ca.pem"),
                                             private_key=str(tmp_path / "client.key"),
                                             certificate_chain=str(tmp_path / "client.pem"))
        x = grpcclient.InferInput("INPUT0", [1, 4], "FP32")
        x.set_data_from_numpy(np.ones((1, 4), np.float32))
        y = grpcclient.InferInput("INPUT1", [1, 4], "FP32")
        y.set_data_from_numpy(np.ones((1, 4), np.float32))
        np.testing.assert_array_equal(c.infer("add_sub", [x, y]).as_numpy("OUTPUT0"), np.full((1, 4), 2, np.float32))
        for kwargs in ({}, {"private_key": str(tmp_path / "rogue.key"),
                            "certificate_chain": str(tmp_path / "rogue.pem")}):
            bad = grpcclient.InferenceServerClient(url, ssl=True, root_certificates=str(tmp_path / "ca.pem"), **kwargs)
            with pytest.raises(InferenceServerException):
                bad.is_server_live(client_timeout=5)
        plain = grpcclient.InferenceServerClient(url)
        with pytest.raises(InferenceServerException):
            plain.is_server_live(client_timeout=5)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_http_and_grpc_over_tls_with_the_same_certificates(tmp_path):
    proc, ports = tls_server(tmp_path, "--tls-cert-file", "server.pem", "--tls-key-file", "server.key",
                             "--vision-port", "0")
    try:
        a = np.arange(4, dtype=np.float32).reshape(1, 4)
        for binary in (True, False):
            c = httpclient.InferenceServerClient(f"localhost:{ports['HTTP']}", ssl=True,
                                                 ssl_options={"ca_certs": str(tmp_path / "ca.pem")})
            assert c.is_server_ready()
            x = httpclient.InferInput("INPUT0", [1, 4], "FP32")
            x.set_data_from_numpy(a, binary_data=binary)
            y = httpclient.InferInput("INPUT1", [1, 4], "FP32")
            y.set_data_from_numpy(a, binary_data=binary)
            for _ in range(3):  # keep-alive over TLS
                np.testing.assert_array_equal(c.infer("add_sub", [x, y]).as_numpy("OUTPUT0"), 2 * a)
            c.close()
        g = grpcclient.InferenceServerClient(f"localhost:{ports['gRPC']}", ssl=True,
                                             root_certificates=str(tmp_path / "ca.pem"))
        assert g.is_server_ready()
        # Plain HTTP to a TLS port gets no answer it could mistake for one.
        with pytest.raises((http.client.HTTPException, ConnectionError, OSError)):
            status, _, _ = request(ports["HTTP"], "GET", "/v2/health/ready")
            assert status != 200
            raise ConnectionError("answered")
        # A client that never finishes its handshake is closed after the read timeout, and does not
        # block others meanwhile.
        import socket
        import ssl
        stalled = socket.create_connection(("127.0.0.1", ports["HTTP"]))
        stalled.sendall(b"\x16\x03\x01")  # the start of a ClientHello
        ctx = ssl.create_default_context(cafile=str(tmp_path / "ca.pem"))
        with socket.create_connection(("localhost", ports["vision"])) as raw:
            with ctx.wrap_socket(raw, server_hostname="localhost") as tls:
                tls.sendall(b"GET /v1/status/ping HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                data = b""
                while chunk := tls.recv(65536):
                    data += chunk
        assert data.startswith(b"HTTP/1.1 200") and b'"success":true' in data
        stalled.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_https_with_client_certificates(tmp_path):
    proc, ports = tls_server(tmp_path, "--tls-cert-file", "server.pem", "--tls-key-file", "server.key",
                             "--tls-client-ca-file", "ca.pem")
    url = f"localhost:{ports['HTTP']}"
    try:
        good = httpclient.InferenceServerClient(url, ssl=True, ssl_options={
            "ca_certs": str(tmp_path / "ca.pem"), "certfile": str(tmp_path / "client.pem"),
            "keyfile": str(tmp_path / "client.key")})
        assert good.is_server_live()
        for opts in ({"ca_certs": str(tmp_path / "ca.pem")},
                     {"ca_certs": str(tmp_path / "ca.pem"), "certfile": str(tmp_path / "rogue.pem"),
                      "keyfile": str(tmp_path / "rogue.key")}):
            bad = httpclient.InferenceServerClient(url, ssl=True, ssl_options=opts, network_timeout=5)
            with pytest.raises(Exception):
                assert bad.is_server_live()
                raise AssertionError("served without a valid client certificate")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_nothing_is_written_outside_the_repository(tmp_path):
    """Serving, loading models with several instances (whose shared weights pass through a private
    temporary directory) and answering requests leave nothing in the home directory, the cache
    directory, the temporary directory or the working directory. ONNX Runtime 1.29 and later start
    Microsoft's telemetry on Linux unless told not to: an event database under ~/.cache, a session
    file and logs in the temporary directory, and an uploader that sends events over the network."""
    repo = tmp_path / "repo"
    for m in ("add_sub", "detect_yolov8"):
        shutil.copytree(os.path.join(MODELS, m), repo / m)
    dirs = {name: tmp_path / name for name in ("home", "cache", "tmp", "cwd")}
    for d in dirs.values():
        d.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORT_")}
    env.update(HOME=str(dirs["home"]), XDG_CACHE_HOME=str(dirs["cache"]), TMPDIR=str(dirs["tmp"]))
    proc, ports = start_quern(QUERN, str(repo), env=env, cwd=str(dirs["cwd"]))
    try:
        status, _, data = request(ports["HTTP"], "POST", "/v2/models/add_sub/infer", add_sub_body())
        assert status == 200, data
        assert json.loads(data)["outputs"][0]["data"] == [2, 3, 4, 5]
        body, headers = multipart({"image": ("a.png", png_bytes())})
        assert request(ports["HTTP"], "POST", "/v1/vision/detection", body, headers)[0] == 200
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    for name, d in dirs.items():
        written = sorted(str(p.relative_to(d)) for p in d.rglob("*"))
        assert written == [], f"quern wrote into the {name} directory: {written}"
