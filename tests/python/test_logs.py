"""The server's log: levels, text or JSON lines with fields (model, source), and the access log."""
import json
import os
import re
import shutil
import subprocess
import threading
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from quern_testing import free_port, http_request, start_quern, stop_quern, wait_until

QUERN = os.environ["QUERN_BIN"]
MODELS = os.environ["QUERN_TEST_MODELS"]

TALKER = '''
import numpy as np

def initialize(args):
    print("hello from initialize", flush=True)

def infer(inputs):
    if (inputs["x"] < 0).any():
        raise ValueError("no negative numbers")
    return {"y": inputs["x"]}
'''


def repository(tmp_path):
    shutil.copytree(os.path.join(MODELS, "add_sub"), tmp_path / "add_sub")
    (tmp_path / "broken" / "1").mkdir(parents=True)
    (tmp_path / "broken" / "1" / "model.onnx").write_bytes(b"not an onnx file")
    (tmp_path / "talker" / "1").mkdir(parents=True)
    (tmp_path / "talker" / "config.pbtxt").write_text('''backend: "python"
max_batch_size: 4
input [ { name: "x" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 1 ] } ]
instance_group [ { count: 1 } ]
''')
    (tmp_path / "talker" / "1" / "model.py").write_text(TALKER)
    return tmp_path


def start_json(repo, *extra):
    """`quern serve --log-format json`: every stdout line is a JSON event; returns (process, ports, lines, errors)
    with the lines of stdout and stderr collected as they come."""
    proc = subprocess.Popen([QUERN, "serve", "--model-repository", str(repo), "--http-port", "0", "--grpc-port", "0",
                             "--metrics-port", "0", "--host", "127.0.0.1", "--log-format", "json", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err, ports = [], [], {}
    deadline = time.time() + 60
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        out.append(line)
        m = re.search(r"(HTTP|gRPC|metrics) listening on [^:]+:(\d+)", line)
        if m:
            ports[m.group(1)] = int(m.group(2))
        if '"serving ' in line:
            break
    proc.readers = [threading.Thread(target=lambda: [out.append(x) for x in proc.stdout], daemon=True),
                    threading.Thread(target=lambda: [err.append(x) for x in proc.stderr], daemon=True)]
    for t in proc.readers:
        t.start()
    assert "HTTP" in ports, out
    return proc, ports, out, err


def stop_json(proc):
    """SIGTERM; returns once the server has exited and its last line is read."""
    proc.terminate()
    proc.wait(timeout=30)
    for t in proc.readers:
        t.join(timeout=30)


def add_sub(port, client_module=httpclient, **kwargs):
    client = client_module.InferenceServerClient(f"127.0.0.1:{port}")
    a = client_module.InferInput("INPUT0", [1, 4], "FP32")
    a.set_data_from_numpy(np.ones((1, 4), np.float32))
    b = client_module.InferInput("INPUT1", [1, 4], "FP32")
    b.set_data_from_numpy(np.ones((1, 4), np.float32))
    return client.infer("add_sub", [a, b], **kwargs)


def test_json_lines_with_levels_fields_and_an_access_log(tmp_path):
    repo = repository(tmp_path / "repo")
    access = tmp_path / "access.log"
    proc, ports, out, err = start_json(repo, "--access-log", str(access))
    try:
        add_sub(ports["HTTP"], headers={"X-Request-ID": "trace-7"})
        add_sub(ports["gRPC"], grpcclient, headers={"x-request-id": "grpc-9"})
        # A request the model fails: logged with the model, its version and the request's id.
        body = json.dumps({"inputs": [{"name": "x", "shape": [1, 1], "datatype": "FP32", "data": [-1]}]})
        status, headers, _ = http_request(ports["HTTP"], "POST", "/v2/models/talker/infer", body,
                                          {"X-Request-ID": "fail-1"})
        assert status == 500 and headers["X-Request-ID"] == "fail-1"
        # No id given: the server makes one (it keeps an access log) and sends it back.
        status, headers, _ = http_request(ports["HTTP"], "GET", "/v2/health/live")
        assert status == 200 and re.fullmatch(r"[0-9a-f]{20}", headers["X-Request-ID"]), headers
        made = headers["X-Request-ID"]
        # An id that could forge a log line or a header is not used.
        status, headers, _ = http_request(ports["HTTP"], "GET", "/v2/health/live", headers={"X-Request-ID": 'a" b'})
        assert re.fullmatch(r"[0-9a-f]{20}", headers["X-Request-ID"]) and headers["X-Request-ID"] != made
    finally:
        stop_json(proc)  # every line written before it exits
    events = [json.loads(line) for line in out + err if line.strip()]  # every line is one JSON object
    assert all({"time", "level", "msg"} <= e.keys() for e in events), events[:3]
    assert all(re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", e["time"]) for e in events)
    by_model = {e["model"]: e for e in events if e["msg"].startswith("model ")}
    assert by_model["add_sub"]["level"] == "info" and by_model["add_sub"]["state"] == "READY"
    assert by_model["broken"]["level"] == "error" and by_model["broken"]["error"], by_model["broken"]
    said = [e for e in events if e["msg"] == "hello from initialize"]
    assert said and said[0]["source"] == "model 'talker' instance 0", said
    assert [e["msg"] for e in events if e["msg"] in ("draining (up to 30 s)", "stopping")] == [
        "draining (up to 30 s)", "stopping"]
    failed = [e for e in events if e["msg"].startswith("request failed")]
    assert len(failed) == 1, failed
    f = failed[0]
    assert (f["level"], f["model"], f["version"], f["request_id"], f["code"]) == (
        "warning", "talker", "1", "fail-1", "INTERNAL"), f
    assert "no negative numbers" in f["msg"]
    lines = [json.loads(line) for line in access.read_text().splitlines()]
    infer = [a for a in lines if a["path"] == "/v2/models/add_sub/infer"]
    assert len(infer) == 1, lines
    a = infer[0]
    assert (a["method"], a["status"], a["model"], a["client"]) == ("POST", "200", "add_sub", "127.0.0.1")
    assert int(a["bytes_in"]) > 0 and int(a["bytes_out"]) > 0 and float(a["ms"]) >= 0
    assert a["request_id"] == "trace-7"
    assert [x["request_id"] for x in lines if x["path"] == "/v2/health/live"][0] == made
    g = [x for x in lines if x["method"] == "GRPC" and x["path"].endswith("/ModelInfer")]
    assert len(g) == 1, lines
    assert (g[0]["status"], g[0]["model"], g[0]["request_id"], g[0]["client"]) == (
        "OK", "add_sub", "grpc-9", "127.0.0.1"), g
    assert float(g[0]["ms"]) >= 0


def test_text_lines_and_the_level(tmp_path):
    repo = repository(tmp_path / "repo")
    log = []
    proc, ports = start_quern(QUERN, str(repo), "--access-log", "-", log=log)
    try:
        add_sub(ports["HTTP"])
    finally:
        stop_quern(proc)  # every line written before it exits
    access = [line for line in log if line.startswith("quern: access ")]
    assert len(access) == 1, access
    assert re.search(r"time=\S+Z client=127\.0\.0\.1 method=POST path=/v2/models/add_sub/infer status=200 "
                     r"bytes_in=\d+ bytes_out=\d+ ms=[\d.]+ model=add_sub request_id=[0-9a-f]{20}$", access[0].strip()), access

    # At --log-level error, the model's print (info) does not reach the log; the broken model (an error) does.
    port = free_port()
    p = subprocess.Popen([QUERN, "serve", "--model-repository", str(repo), "--http-port", str(port), "--grpc-port", "-1",
                          "--metrics-port", "0", "--host", "127.0.0.1", "--log-level", "error", "--log-format", "json"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = []
    reader = threading.Thread(target=lambda: [output.append(x) for x in p.stdout], daemon=True)
    reader.start()

    def talker_ready():  # its initialize() has printed by then
        try:
            return http_request(port, "GET", "/v2/models/talker/ready", timeout=5)[0] == 200
        except OSError:
            return False
    wait_until(talker_ready, timeout=60, what="model talker to be ready")
    p.terminate()
    p.wait(timeout=30)
    reader.join(timeout=30)
    events = [json.loads(line) for line in output if line.strip()]
    assert events and all(e["level"] == "error" for e in events), events
    assert any(e.get("model") == "broken" for e in events)


@pytest.mark.parametrize("flag", [["--log-format", "xml"], ["--log-level", "loud"]])
def test_bad_log_settings_are_refused(tmp_path, flag):
    r = subprocess.run([QUERN, "serve", "--model-repository", str(tmp_path), *flag], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode != 0 and flag[0] in (r.stdout + r.stderr), (r.returncode, r.stdout, r.stderr)


def test_lines_an_attacker_writes_stay_json_and_few(tmp_path):
    """Raw non-UTF-8 bytes in a request target make valid JSON access lines, and failed TLS handshakes on
    the gRPC port (gRPC core logs one line each) are rate limited and in Quern's JSON format."""
    import socket
    d = tmp_path / "certs"
    d.mkdir()

    def ssl(*args):
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=d)
    ssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "key.pem", "-out", "cert.pem", "-days", "2",
        "-subj", "/CN=localhost")
    repo = tmp_path / "repo"
    shutil.copytree(os.path.join(MODELS, "add_sub"), repo / "add_sub")
    proc = subprocess.Popen([QUERN, "serve", "--model-repository", str(repo), "--http-port", "0", "--grpc-port", "0",
                             "--metrics-port", "0", "--host", "127.0.0.1", "--log-format", "json", "--access-log",
                             "-", "--grpc-tls-cert-file", str(d / "cert.pem"), "--grpc-tls-key-file",
                             str(d / "key.pem")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lines, ports = [], {}
    try:
        deadline = time.time() + 60
        while time.time() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            m = re.search(rb"(HTTP|gRPC) listening on [^:]+:(\d+)", line)
            if m:
                ports[m.group(1).decode()] = int(m.group(2))
            if b'"serving ' in line:
                break
        reader = threading.Thread(target=lambda: [lines.append(x) for x in proc.stdout], daemon=True)
        reader.start()
        for target in (b"/v2/models/\xff\xfe\xc3(/ready", b"/v2/\xe2\x82\xac/\xed\xa0\x80x"):
            with socket.create_connection(("127.0.0.1", ports["HTTP"])) as s:
                s.sendall(b"GET " + target + b" HTTP/1.1\r\nHost: q\r\nConnection: close\r\n\r\n")
                while s.recv(65536):
                    pass
        for _ in range(300):
            with socket.create_connection(("127.0.0.1", ports["gRPC"])) as s:
                s.sendall(b"\x16\x03\x01\x00\x05garbage that is not a TLS hello" * 4)
                try:
                    s.settimeout(2)
                    while s.recv(65536):
                        pass
                except OSError:
                    pass
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    reader.join(timeout=30)  # every line written before it exited
    events = []
    for line in lines:
        events.append(json.loads(line.decode("utf-8")))  # strict: every line is UTF-8 and JSON
    access = [e for e in events if e.get("msg") == "access"]
    assert any("\\u00ff" in json.dumps(e["path"]) or "\u00ff" in e["path"] for e in access), access
    assert any("\u20ac" in e["path"] for e in access), access  # well-formed UTF-8 passes as it is
    from_grpc = [e for e in events if e.get("source") == "grpc"]
    assert 0 < len(from_grpc) <= 25, (len(from_grpc), from_grpc[:3])
