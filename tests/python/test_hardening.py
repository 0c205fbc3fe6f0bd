"""Attacks and careless configurations against a real `quern serve`: none may crash it, make it
unready, grow its memory, or reach outside its model repository. Each test sends what an
attacker or a careless operator would, then checks the answer and that the server still serves."""
import gzip
import http.client
import json
import os
import shutil
import socket
import subprocess
import time
import zlib

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.grpc import service_pb2
from tritonclient.utils import InferenceServerException

from quern_testing import http_request, pending, sanitized, start_quern, wait_until

QUERN = os.environ["QUERN_BIN"]
MODELS = os.environ["QUERN_TEST_MODELS"]

DEEP = 130_000  # nesting that exhausted the parser's stack (260 KB of '[')


def make_repo(root, *models):
    root.mkdir(parents=True, exist_ok=True)
    for m in models:
        shutil.copytree(os.path.join(MODELS, m), root / m)
    return root


class Server:
    def __init__(self, repo, *extra, log=None):
        self.proc, self.ports = start_quern(QUERN, str(repo), *extra, log=log)
        self.http = self.ports["HTTP"]
        self.grpc = f"127.0.0.1:{self.ports['gRPC']}"

    def request(self, method, path, body=None, headers=None, timeout=30):
        return http_request(self.http, method, path, body, headers, timeout)

    def alive(self):
        assert self.proc.poll() is None, f"quern exited with {self.proc.returncode}"
        status, _, body = self.request("GET", "/v2/health/live")
        assert status == 200 and json.loads(body) == {"live": True}

    def rss_kb(self):
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        return 0

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = make_repo(tmp_path_factory.mktemp("repo") / "models", "add_sub", "detect_yolov8", "dtypes")
    s = Server(repo, "--model-control", "explicit")
    yield s
    s.stop()


def add_sub_body(shape=(1, 4), data=None):
    n = int(np.prod(shape)) if data is None else None
    vals = data if data is not None else list(range(n))
    return json.dumps({"inputs": [
        {"name": "INPUT0", "shape": list(shape), "datatype": "FP32", "data": vals},
        {"name": "INPUT1", "shape": list(shape), "datatype": "FP32", "data": vals}]}).encode()


# --- One request must not kill the server -------------------------------------------------

@pytest.mark.parametrize("path", ["/v2/models/add_sub/infer", "/v2/models/add_sub/jobs", "/predict/add_sub",
                                  "/v2/repository/index", "/v2/repository/models/add_sub/load"])
def test_deeply_nested_json_is_refused_and_the_server_lives(server, path):
    body = b"[" * DEEP
    status, _, data = server.request("POST", path, body=body)
    assert status == 400 or (path == "/v2/repository/index" and status == 200), (status, data[:200])
    if status == 400:
        text = data.decode()
        assert "nested deeper than 64 levels" in text or "not valid JSON" in text or "malformed" in text, text
    # The same nesting inside an otherwise valid request.
    inner = b'{"inputs": [{"name": "INPUT0", "shape": [1], "datatype": "FP32", "data": ' + b"[" * DEEP + b"]}"
    status, _, data = server.request("POST", path, body=inner)
    assert status in (200, 400), status
    server.alive()


def test_non_finite_values_travel_as_python_writes_them(server):
    # 3e38 + 3e38 overflows FP32 to infinity; NaN comes in as Python's json module writes it.
    body = json.dumps({"inputs": [
        {"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [3e38, float("nan"), -3e38, 1]},
        {"name": "INPUT1", "shape": [1, 4], "datatype": "FP32", "data": [3e38, 1, -3e38, 1]}]}).encode()
    status, _, data = server.request("POST", "/v2/models/add_sub/infer", body=body)
    assert status == 200, data
    out = {o["name"]: o["data"] for o in json.loads(data)["outputs"]}  # Python's json reads Infinity / NaN
    assert out["OUTPUT0"][0] == float("inf") and np.isnan(out["OUTPUT0"][1]) and out["OUTPUT0"][2] == float("-inf")
    assert out["OUTPUT0"][3] == 2
    status, _, data = server.request("POST", "/v2/models/add_sub/jobs", body=body)
    assert status == 202, data


def test_nesting_within_the_limit_still_works(server):
    # A [1, 4] tensor sent as nested data: [[1, 2, 3, 4]].
    body = add_sub_body(data=[[1, 2, 3, 4]])
    status, _, data = server.request("POST", "/v2/models/add_sub/infer", body=body)
    assert status == 200, data
    assert json.loads(data)["outputs"][0]["data"] == [2, 4, 6, 8]


@pytest.mark.parametrize("shape", [[4611686018427387904, 4], [16, 1 << 60], [1 << 62, 1 << 62, 0, -1]])
def test_element_count_overflow_is_refused(server, shape):
    body = json.dumps({"inputs": [
        {"name": "INPUT0", "shape": shape, "datatype": "FP32", "data": []},
        {"name": "INPUT1", "shape": shape, "datatype": "FP32", "data": []}]}).encode()
    status, _, data = server.request("POST", "/v2/models/add_sub/infer", body=body)
    assert status == 400, data
    # Binary data claiming a huge shape.
    header = json.dumps({"inputs": [
        {"name": "INPUT0", "shape": shape, "datatype": "FP32", "parameters": {"binary_data_size": 0}},
        {"name": "INPUT1", "shape": shape, "datatype": "FP32", "parameters": {"binary_data_size": 0}}]}).encode()
    status, _, data = server.request("POST", "/v2/models/add_sub/infer", body=header,
                                     headers={"Inference-Header-Content-Length": str(len(header))})
    assert status == 400, data
    server.alive()


def test_bytes_tensor_with_a_huge_shape_and_four_bytes_is_refused(server):
    header = json.dumps({"inputs": [{"name": "in_string", "shape": [1 << 40, 2], "datatype": "BYTES",
                                     "parameters": {"binary_data_size": 4}}]}).encode()
    status, _, data = server.request("POST", "/v2/models/dtypes/infer", body=header + b"\0\0\0\0",
                                     headers={"Inference-Header-Content-Length": str(len(header))})
    assert status == 400, data
    server.alive()


def test_huge_shape_over_grpc_is_refused(server):
    c = grpcclient.InferenceServerClient(server.grpc)
    req = service_pb2.ModelInferRequest(model_name="add_sub")
    for name in ("INPUT0", "INPUT1"):
        req.inputs.add(name=name, datatype="FP32", shape=[4611686018427387904, 4])
    req.raw_input_contents.extend([b"", b""])
    with pytest.raises(grpc.RpcError) as e:
        c._client_stub.ModelInfer(req)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "64 bits" in e.value.details()
    server.alive()


# --- Names are names -------------------------------------------------------------------------

def test_model_names_cannot_be_paths(tmp_path):
    repo = make_repo(tmp_path / "repo", "add_sub")
    # A model folder outside the repository that an attacker wants served.
    outside = tmp_path / "outside"
    shutil.copytree(os.path.join(MODELS, "add_sub"), outside)
    s = Server(repo, "--model-control", "explicit")
    try:
        c = grpcclient.InferenceServerClient(s.grpc)
        for name in (str(outside), "../outside", "..", ".", "add_sub/../add_sub", "a\0b", "a\nb", ""):
            with pytest.raises(InferenceServerException) as e:
                c.load_model(name)
            assert "StatusCode.INVALID_ARGUMENT" in str(e.value.status()) or "INVALID_ARGUMENT" in str(e.value), \
                (name, e.value)
        # HTTP, with the path as it is (curl --path-as-is) and percent-encoded.
        for path in ("/v2/repository/models/../load", "/v2/repository/models/%2e%2e/load",
                     "/v2/repository/models/..%2foutside/load", "/v2/repository/models/%2Ftmp/load"):
            sock = socket.create_connection(("127.0.0.1", s.http))
            sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".encode())
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
            sock.close()
            status = int(data.split(b" ", 2)[1])
            assert status == 400, (path, data)
            assert str(tmp_path).encode() not in data, data  # no file system paths in the answer
        # Nothing outside was loaded; the index holds only the repository's model.
        status, _, body = s.request("POST", "/v2/repository/index", body=b"{}")
        assert [m["name"] for m in json.loads(body)] == ["add_sub"]
        s.alive()
        assert s.request("GET", "/v2/health/ready")[0] == 200
    finally:
        s.stop()


def test_loading_an_unknown_model_leaves_no_state(tmp_path):
    repo = make_repo(tmp_path / "repo", "add_sub")
    s = Server(repo, "--model-control", "explicit")
    try:
        status, _, body = s.request("POST", "/v2/repository/models/nope/load")
        assert status == 404, body
        assert s.request("GET", "/v2/health/ready")[0] == 200
        c = grpcclient.InferenceServerClient(s.grpc)
        with pytest.raises(InferenceServerException):
            c.load_model("nope2")
        assert c.is_server_ready()
        # Many such loads (20,000 grew the index by 2.5 MB and the process by 30 MB): no entries, no memory.
        before = s.rss_kb()
        conn = http.client.HTTPConnection("127.0.0.1", s.http, timeout=30)
        for i in range(20_000):
            conn.request("POST", f"/v2/repository/models/nope{i}/load", body=b"")
            r = conn.getresponse()
            r.read()
            assert r.status == 404
        conn.close()
        status, _, body = s.request("POST", "/v2/repository/index", body=b"{}")
        assert [m["name"] for m in json.loads(body)] == ["add_sub"]
        assert s.request("GET", "/v2/health/ready")[0] == 200
        if not sanitized(QUERN):
            assert s.rss_kb() - before < 8 * 1024, (before, s.rss_kb())
    finally:
        s.stop()


def test_model_files_must_stay_inside_the_repository(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("top secret\n")
    outside = tmp_path / "outside_model"
    shutil.copytree(os.path.join(MODELS, "add_sub"), outside)
    repo = make_repo(tmp_path / "repo", "add_sub", "detect_yolov8")
    # A model folder that is a link to a folder elsewhere.
    os.symlink(outside, repo / "linked")
    # A detector whose label file is a file outside the repository.
    cfg = (repo / "detect_yolov8" / "config.pbtxt").read_text()
    assert "label_filename" in cfg
    import re
    cfg = re.sub(r'label_filename: "[^"]*"', f'label_filename: "{secret}"', cfg)
    shutil.copytree(repo / "detect_yolov8", repo / "leaky")
    (repo / "leaky" / "config.pbtxt").write_text(cfg.replace('name: "detect_yolov8"', 'name: "leaky"'))
    (repo / "leaky2").mkdir()
    shutil.copytree(repo / "detect_yolov8" / "1", repo / "leaky2" / "1")
    (repo / "leaky2" / "config.pbtxt").write_text(
        re.sub(r'label_filename: "[^"]*"', 'label_filename: "../../secret.txt"', cfg).replace(
            'name: "detect_yolov8"', 'name: "leaky2"'))
    # A model file named outside its version folder.
    (repo / "escape" / "1").mkdir(parents=True)
    (repo / "escape" / "config.pbtxt").write_text('default_model_filename: "../../../outside_model/1/model.onnx"\n')
    s = Server(repo)
    try:
        status, _, body = s.request("POST", "/v2/repository/index", body=b"{}")
        states = {m["name"]: m for m in json.loads(body)}
        assert states["add_sub"]["state"] == "READY"
        assert states["detect_yolov8"]["state"] == "READY"
        for name in ("linked", "leaky", "leaky2", "escape"):
            assert states[name]["state"] == "UNAVAILABLE", states[name]
            reason = states[name]["reason"]
            assert "outside" in reason or "file name" in reason or "'..'" in reason, states[name]
            assert "top secret" not in states[name]["reason"]
        s.alive()
    finally:
        s.stop()
    # The operator may allow model folders linked from elsewhere; their files stay confined to them.
    s = Server(repo, "--allow-links-outside-repository")
    try:
        status, _, body = s.request("POST", "/v2/repository/index", body=b"{}")
        states = {m["name"]: m["state"] for m in json.loads(body)}
        assert states["linked"] == "READY"
        assert states["leaky"] == "UNAVAILABLE" and states["escape"] == "UNAVAILABLE"
    finally:
        s.stop()


# --- One configuration or file must not take the server down -------------------------------------

def write_model(repo, name, config):
    base = "detect_yolov8" if "vision" in name else "add_sub"
    shutil.copytree(os.path.join(MODELS, base), repo / name)
    (repo / name / "config.pbtxt").write_text(config)


BAD_CONFIGS = {
    "many_instances": ("instance_group [ { count: 100000 } ]", "instance_group"),
    "many_threads": ('parameters { key: "intra_op_thread_count" value { string_value: "100000" } }',
                     "intra_op_thread_count"),
    "huge_batch": ("max_batch_size: 2000000000", "max_batch_size"),
    "huge_dims": ('max_batch_size: 8\ninput [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4611686018427387904 ] } ]',
                  "dimension"),
    "huge_delay": ("max_batch_size: 8\ndynamic_batching { max_queue_delay_microseconds: 18446744073709551615 }",
                   "max_queue_delay_microseconds"),
    "huge_timeout": ("max_batch_size: 8\ndynamic_batching { default_queue_policy { default_timeout_microseconds: "
                     "18446744073709551615 } }", "default_timeout_microseconds"),
    "many_levels": ("max_batch_size: 8\ndynamic_batching { priority_levels: 4000000000 }", "priority_levels"),
    "bad_quern_param": ('parameters { key: "quern.batch_size_tunning" value { string_value: "on" } }',
                        "quern.batch_size_tunning"),
    "bad_vision_param": ('parameters { key: "quern.image.sise" value { string_value: "64x64" } }', "quern.image.sise"),
    "bad_vision_value": ('parameters { key: "quern.detection.format" value { string_value: "yolov99" } }',
                         "quern.detection.format"),
    "huge_warmup": ('max_batch_size: 8\nmodel_warmup [ { name: "w" batch_size: 1 inputs { key: "INPUT0" value { '
                    'data_type: TYPE_FP32 dims: [ 2000000000 ] zero_data: true } } } ]', "warm"),
}


def test_bad_configurations_fail_their_own_load_only(tmp_path):
    repo = make_repo(tmp_path / "repo", "add_sub")
    for name, (config, _) in BAD_CONFIGS.items():
        write_model(repo, name, config)
    # A symbolic link loop and a link to nowhere in the repository.
    os.symlink(repo / "loop_a", repo / "loop_b")
    os.symlink(repo / "loop_b", repo / "loop_a")
    os.symlink(repo / "nowhere", repo / "dangling")
    started = time.time()
    s = Server(repo, "--repository-poll-secs", "1")
    try:
        assert time.time() - started < 30
        status, _, body = s.request("POST", "/v2/repository/index", body=b"{}")
        states = {m["name"]: m for m in json.loads(body)}
        assert states["add_sub"]["state"] == "READY"
        for name, (_, field) in BAD_CONFIGS.items():
            assert states[name]["state"] == "UNAVAILABLE", states[name]
            assert field in states[name]["reason"], states[name]
        for name in ("loop_a", "loop_b", "dangling"):
            assert name not in states or states[name]["state"] == "UNAVAILABLE"
        # A loop appearing while the server polls the repository.
        os.symlink(repo / "later_b", repo / "later_a")
        os.symlink(repo / "later_a", repo / "later_b")
        (repo / "add_sub" / "loop").symlink_to(repo / "add_sub" / "loop")
        time.sleep(2.5)
        s.alive()
        out = httpclient.InferenceServerClient(f"127.0.0.1:{s.http}")
        x = httpclient.InferInput("INPUT0", [1, 4], "FP32")
        x.set_data_from_numpy(np.ones((1, 4), np.float32))
        y = httpclient.InferInput("INPUT1", [1, 4], "FP32")
        y.set_data_from_numpy(np.ones((1, 4), np.float32))
        np.testing.assert_array_equal(out.infer("add_sub", [x, y]).as_numpy("OUTPUT0"), np.full((1, 4), 2, np.float32))
        assert s.rss_kb() < 1024 * 1024
    finally:
        s.stop()


# --- Protocol truthfulness --------------------------------------------------------------------------

def test_health_answers_carry_the_protocols_bodies(server):
    status, _, body = server.request("GET", "/v2/health/live")
    assert status == 200 and json.loads(body) == {"live": True}
    status, _, body = server.request("GET", "/v2/health/ready")
    assert status == 200 and json.loads(body) == {"ready": True}
    status, _, body = server.request("GET", "/v2/models/add_sub/ready")
    assert status == 200 and json.loads(body) == {"name": "add_sub", "ready": True}
    status, headers, body = server.request("HEAD", "/v2/health/ready")
    assert status == 200 and body == b"" and int(headers["Content-Length"]) == len(b'{"ready":true}')


def test_server_metadata_lists_the_extensions_that_work(server):
    meta = httpclient.InferenceServerClient(f"127.0.0.1:{server.http}").get_server_metadata()
    assert set(meta["extensions"]) == {"binary_tensor_data", "statistics", "model_repository", "model_configuration",
                                       "schedule_policy", "parameters", "classification"}


def test_model_names_with_spaces_and_accents_work_over_http(tmp_path):
    repo = make_repo(tmp_path / "repo")
    for name in ("my model", "modèle"):
        shutil.copytree(os.path.join(MODELS, "add_sub"), repo / name)
    s = Server(repo)
    try:
        for name in ("my model", "modèle"):
            c = httpclient.InferenceServerClient(f"127.0.0.1:{s.http}")
            x = httpclient.InferInput("INPUT0", [1, 4], "FP32")
            x.set_data_from_numpy(np.arange(4, dtype=np.float32).reshape(1, 4))
            y = httpclient.InferInput("INPUT1", [1, 4], "FP32")
            y.set_data_from_numpy(np.ones((1, 4), np.float32))
            r = c.infer(name, [x, y])
            np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), np.arange(4, dtype=np.float32).reshape(1, 4) + 1)
            assert c.is_model_ready(name)
            g = grpcclient.InferenceServerClient(s.grpc)
            assert g.is_model_ready(name)
    finally:
        s.stop()


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_compressed_request_bodies_are_accepted(server, algorithm):
    c = httpclient.InferenceServerClient(f"127.0.0.1:{server.http}")
    a = np.arange(8, dtype=np.float32).reshape(2, 4)
    x = httpclient.InferInput("INPUT0", [2, 4], "FP32")
    x.set_data_from_numpy(a, binary_data=True)
    y = httpclient.InferInput("INPUT1", [2, 4], "FP32")
    y.set_data_from_numpy(a * 10, binary_data=False)
    r = c.infer("add_sub", [x, y], request_compression_algorithm=algorithm)
    np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), a * 11)


def test_compression_bombs_and_garbage_are_refused(server):
    bomb = gzip.compress(b"[" * (80 << 20))  # 80 MiB of '[' inflates beyond the 64 MiB body limit
    status, _, body = server.request("POST", "/v2/models/add_sub/infer", body=bomb,
                                     headers={"Content-Encoding": "gzip"})
    assert status == 413, body
    status, _, body = server.request("POST", "/v2/models/add_sub/infer", body=b"not gzip at all",
                                     headers={"Content-Encoding": "gzip"})
    assert status == 400, body
    status, _, body = server.request("POST", "/v2/models/add_sub/infer", body=zlib.compress(add_sub_body())[:-5],
                                     headers={"Content-Encoding": "deflate"})
    assert status == 400, body
    status, _, body = server.request("POST", "/v2/models/add_sub/infer", body=add_sub_body(),
                                     headers={"Content-Encoding": "br"})
    assert status == 415, body
    server.alive()


def test_load_with_a_config_override_is_refused_not_ignored(server):
    status, _, body = server.request("POST", "/v2/repository/models/add_sub/load",
                                     body=json.dumps({"parameters": {"config": '{"max_batch_size": 2}'}}).encode())
    assert status == 400 and "config" in json.loads(body)["error"], body
    c = grpcclient.InferenceServerClient(server.grpc)
    with pytest.raises(InferenceServerException) as e:
        c.load_model("add_sub", config='{"max_batch_size": 2}')
    assert "INVALID_ARGUMENT" in str(e.value.status()) and "config" in e.value.message()
    assert server.request("GET", "/v2/health/ready")[0] == 200


def test_unknown_methods_get_405_or_501(server):
    status, headers, _ = server.request("PUT", "/v2/models/add_sub/infer", body=b"{}")
    assert status == 405 and headers["Allow"] == "POST"
    status, headers, _ = server.request("DELETE", "/v2/health/live")
    assert status == 405 and "GET" in headers["Allow"]
    status, _, _ = server.request("PUT", "/v2/models/add_sub/jobs", body=b"{}")
    assert status == 405
    status, _, _ = server.request("BREW", "/v2/models/add_sub/infer", body=b"{}")
    assert status in (400, 405, 501)
    server.alive()


def test_unparseable_grpc_message_gets_invalid_argument(server):
    with grpc.insecure_channel(server.grpc) as ch:
        for method in ("ModelInfer", "ModelMetadata", "RepositoryModelLoad"):
            call = ch.unary_unary(f"/inference.GRPCInferenceService/{method}",
                                  request_serializer=lambda b: b, response_deserializer=lambda b: b)
            with pytest.raises(grpc.RpcError) as e:
                call(b"\xff\xff\xff\xff\x0f garbage", timeout=10)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, e.value.code())
            assert e.value.details(), method
        # On a stream, the message that does not parse gets an error answer and the stream goes on.
        req = service_pb2.ModelInferRequest(model_name="add_sub", id="valid")
        for name in ("INPUT0", "INPUT1"):
            t = req.inputs.add(name=name, datatype="FP32", shape=[1, 4])
            req.raw_input_contents.append(np.arange(4, dtype=np.float32).tobytes())
        del t
        stream = ch.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer",
                                  request_serializer=lambda b: b,
                                  response_deserializer=service_pb2.ModelStreamInferResponse.FromString)
        # Every message is answered before the stream ends, however soon after its last message the
        # client half-closes (the next read may complete while this message is still being handled).
        lost = 0
        for _ in range(200):
            answers = list(stream(iter([b"\xff\xff\xff\xff\x0f garbage", req.SerializeToString()]), timeout=10))
            lost += len(answers) != 2
        assert lost == 0, f"{lost} of 200 streams ended before answering both messages"
        bad = [a for a in answers if a.error_message]
        good = [a for a in answers if not a.error_message]
        assert len(bad) == 1 and "not a valid inference.ModelInferRequest" in bad[0].error_message, answers
        assert len(good) == 1 and good[0].infer_response.id == "valid"
        out = {o.name: i for i, o in enumerate(good[0].infer_response.outputs)}
        got = np.frombuffer(good[0].infer_response.raw_output_contents[out["OUTPUT0"]], np.float32)
        assert got.tolist() == (2 * np.arange(4, dtype=np.float32)).tolist()
    server.alive()


# --- Connections ---------------------------------------------------------------------------------

def test_idle_connections_do_not_lock_clients_out(tmp_path):
    import resource
    import threading
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 16384), hard))
    repo = make_repo(tmp_path / "repo", "add_sub")
    # At most 4096 connections held: the 10,000 idle ones beyond make room by evicting the oldest.
    s = Server(repo, "--http-max-connections", "4096")
    idle = []
    stop = threading.Event()
    results = {"ok": 0, "failed": []}
    lock = threading.Lock()

    def client():
        a = np.arange(4, dtype=np.float32).reshape(1, 4)
        body = add_sub_body(data=a.tolist())
        n = 0
        c = None
        while not stop.is_set():
            try:
                # A well-behaved client that opens new connections now and then (every 4th request).
                if c is None or n % 4 == 0:
                    if c is not None:
                        c.close()
                    c = http.client.HTTPConnection("127.0.0.1", s.http, timeout=30)
                n += 1
                c.request("POST", "/v2/models/add_sub/infer", body=body)
                r = c.getresponse()
                data = r.read()
                ok = r.status == 200 and json.loads(data)["outputs"][0]["data"] == [0, 2, 4, 6]
                with lock:
                    if ok:
                        results["ok"] += 1
                    else:
                        results["failed"].append((r.status, data[:200]))
            except (OSError, http.client.HTTPException) as e:
                with lock:
                    results["failed"].append(repr(e))
                c = None

    threads = [threading.Thread(target=client) for _ in range(16)]
    try:
        for t in threads:
            t.start()
        time.sleep(0.5)
        for _ in range(10_000):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\1\0\0\0\0\0\0\0")
            sock.connect(("127.0.0.1", s.http))
            idle.append(sock)
        # Once the server holds as many connections as it may (idle ones nearly all), the clients go on
        # being answered (progress, not a rate: a busy machine answers fewer a second; a locked-out
        # client none).
        held = time.monotonic() + 60
        while len(os.listdir(f"/proc/{s.proc.pid}/fd")) < 4_000 and time.monotonic() < held:
            time.sleep(0.1)
        assert len(os.listdir(f"/proc/{s.proc.pid}/fd")) >= 4_000, "the server never held the idle connections"
        before = results["ok"]
        deadline = time.monotonic() + 60
        while results["ok"] - before < 16 * 10 and time.monotonic() < deadline and not results["failed"]:
            time.sleep(0.1)
        stop.set()
        for t in threads:
            t.join(timeout=30)
        assert not results["failed"], results["failed"][:5]
        assert results["ok"] - before >= 16 * 10, results
        # A new client is served too.
        s.alive()
    finally:
        stop.set()
        for sock in idle:
            sock.close()
        s.stop()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


# --- Shutdown ------------------------------------------------------------------------------------

def test_grpc_calls_in_flight_per_connection_are_bounded(tmp_path):
    """--grpc-max-concurrent-streams: a connection's calls beyond the bound wait on the client (HTTP/2
    flow control) instead of piling into the server. slow_batch waits 1 s for a batch of 4: with at most
    2 calls open, the third of three concurrent calls only starts when the first two are answered."""
    import threading
    repo = make_repo(tmp_path / "repo", "slow_batch")
    s = Server(repo, "--grpc-max-concurrent-streams", "2")
    try:
        g = grpcclient.InferenceServerClient(s.grpc)
        times = []

        def call(k):
            x = grpcclient.InferInput("x", [1, 3], "FP32")
            x.set_data_from_numpy(np.full((1, 3), k, np.float32))
            t0 = time.time()
            r = g.infer("slow_batch", [x], client_timeout=30)
            times.append(time.time() - t0)
            assert r.as_numpy(r.get_response().outputs[0].name).shape == (1, 3)

        threads = [threading.Thread(target=call, args=(k,)) for k in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert len(times) == 3
        times.sort()
        # The first two formed one batch; the third, admitted only once they were answered, its own
        # (three calls let in at once are one batch of three: the delay is 1 s, the bound 4).
        stats = json.loads(s.request("GET", "/v2/models/slow_batch/stats")[2])["model_stats"][0]
        assert (stats["inference_count"], stats["execution_count"]) == (3, 2), stats
        assert times[2] > 1.8, times  # the third waited for a free stream, then its own 1 s delay
    finally:
        s.stop()


def test_sigterm_right_after_start_drains_instead_of_killing(tmp_path):
    """A SIGTERM that arrives as soon as the server says it serves (a supervisor stopping it at once)
    drains it and exits 0: the handler is in place before that line is printed."""
    repo = make_repo(tmp_path / "repo", "add_sub")
    codes = []
    for _ in range(20):
        p = subprocess.Popen([QUERN, "serve", "--model-repository", str(repo), "--http-port", "0",
                              "--grpc-port", "-1", "--metrics-port", "0", "--host", "127.0.0.1"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in p.stdout:
            if line.startswith("quern: serving"):
                break
        p.terminate()
        codes.append(p.wait(timeout=30))
    assert codes == [0] * 20, codes


def test_a_drain_sends_what_waits_for_company_at_once(tmp_path):
    """Requests queued for company (a batching delay of two minutes, longer than the drain's
    minute) leave as soon as the server drains: nothing will arrive to join them. They are answered
    with their results and the server stops without reaching the drain's deadline (it waited the
    whole minute for them, then ran them as the engine stopped)."""
    import signal
    import threading
    repo = make_repo(tmp_path / "repo", "slow_batch")
    config = repo / "slow_batch" / "config.pbtxt"
    config.write_text(config.read_text().replace("max_queue_delay_microseconds: 1000000",
                                                 "max_queue_delay_microseconds: 120000000"))
    log = []
    s = Server(repo, "--drain-timeout-secs", "60", log=log)
    results = {}

    def infer(k):
        x = np.full((1, 3), k, np.float32).tolist()
        body = json.dumps({"inputs": [{"name": "x", "shape": [1, 3], "datatype": "FP32", "data": x}]}).encode()
        results[k] = s.request("POST", "/v2/models/slow_batch/infer", body=body, timeout=120)

    threads = [threading.Thread(target=infer, args=(k,)) for k in (1, 2)]
    for t in threads:
        t.start()
    wait_until(lambda: pending(s.ports["metrics"], "slow_batch") == 2, timeout=30,
               what="two requests queued for slow_batch")
    assert not results, "answered before their two-minute delay"
    s.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(timeout=120)
    for k in (1, 2):
        status, _, body = results[k]
        assert status == 200, body
        assert json.loads(body)["outputs"][0]["data"] == [2.0 * k] * 3
    assert s.proc.wait(timeout=60) == 0
    s.proc.quern_log_reader.join(timeout=30)
    assert not [line for line in log if "drain timeout" in line], log[-5:]


def test_sigterm_drains_then_exits_zero(tmp_path):
    """SIGTERM: readiness false first, requests already taken (one running, two queued) finish with
    their results, new ones get 503 / UNAVAILABLE, exit 0 within --drain-timeout-secs. The running
    batch holds the drain open until the test has checked it: its model waits for a file."""
    import signal
    import threading
    repo = make_repo(tmp_path / "repo", "add_sub")
    release, started_file = tmp_path / "release", tmp_path / "started"
    (repo / "held" / "1").mkdir(parents=True)
    (repo / "held" / "config.pbtxt").write_text(
        'backend: "python"\nmax_batch_size: 4\ndynamic_batching { }\n'
        'input [ { name: "x" data_type: TYPE_FP32 dims: [ 3 ] } ]\n'
        'output [ { name: "y" data_type: TYPE_FP32 dims: [ 3 ] } ]\n'
        'instance_group [ { count: 1 kind: KIND_CPU } ]\n')
    (repo / "held" / "1" / "model.py").write_text(
        "import os, time\n\n"
        "def infer(inputs):\n"
        f"    open({str(started_file)!r}, 'a').close()\n"
        f"    while not os.path.exists({str(release)!r}):\n"
        "        time.sleep(0.01)\n"
        "    return {'y': inputs['x'] * 2}\n")
    s = Server(repo, "--drain-timeout-secs", "20")
    try:
        results = {}

        def infer(k):
            x = np.full((1, 3), k, np.float32).tolist()
            body = json.dumps({"inputs": [{"name": "x", "shape": [1, 3], "datatype": "FP32", "data": x}]}).encode()
            results[k] = s.request("POST", "/v2/models/held/infer", body=body, timeout=60)

        threads = [threading.Thread(target=infer, args=(k,)) for k in (1, 2, 3)]
        threads[0].start()
        wait_until(started_file.exists, timeout=30, what="the first request's batch to run")
        for t in threads[1:]:
            t.start()
        wait_until(lambda: pending(s.ports["metrics"], "held") == 2, timeout=30, what="two requests queued behind it")
        started = time.time()
        s.proc.send_signal(signal.SIGTERM)
        status, _, body = wait_until(lambda: (lambda r: r if r[0] == 503 else None)(s.request("GET", "/v2/health/ready")),
                                     timeout=10, what="readiness to turn false after SIGTERM")
        assert json.loads(body)["ready"] is False
        status, _, body = s.request("POST", "/v2/models/add_sub/infer", body=add_sub_body())
        assert status == 503 and "shutting down" in json.loads(body)["error"]
        g = grpcclient.InferenceServerClient(s.grpc)
        assert not g.is_server_ready()
        x = grpcclient.InferInput("INPUT0", [1, 4], "FP32")
        x.set_data_from_numpy(np.ones((1, 4), np.float32))
        y = grpcclient.InferInput("INPUT1", [1, 4], "FP32")
        y.set_data_from_numpy(np.ones((1, 4), np.float32))
        with pytest.raises(InferenceServerException) as e:
            g.infer("add_sub", [x, y])
        assert "UNAVAILABLE" in str(e.value.status())
        assert s.proc.poll() is None and not results, "the drain ended while a batch ran"
        release.touch()
        for t in threads:
            t.join(timeout=30)
        for k in (1, 2, 3):
            status, _, body = results[k]
            assert status == 200, body
            assert json.loads(body)["outputs"][0]["data"] == [2.0 * k] * 3
        assert s.proc.wait(timeout=20) == 0
        assert time.time() - started < 20
    finally:  # a failed check must not leave the model spinning or the server running
        release.touch()
        if s.proc.poll() is None:
            s.proc.kill()
            s.proc.wait(timeout=30)
