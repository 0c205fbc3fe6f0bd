"""KServe v2 HTTP against a real `quern serve`, driven by the real tritonclient package.

Expected values are computed with numpy from the inputs."""
import os
import time

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from quern_testing import DTYPE_ARRAYS, DTYPE_NAMES, http_request, start_quern, wait_until

QUERN = os.environ["QUERN_BIN"]
MODELS = os.environ["QUERN_TEST_MODELS"]
METRICS = None  # host:port of /metrics, set by the server fixture


@pytest.fixture(scope="module")
def server():
    proc, ports = start_quern(QUERN, MODELS, "--model-control", "explicit")
    global METRICS
    METRICS = f"127.0.0.1:{ports['metrics']}"
    yield f"127.0.0.1:{ports['HTTP']}"
    proc.terminate()
    proc.wait(timeout=30)


def test_health_and_metadata(server):
    c = httpclient.InferenceServerClient(server)
    assert c.is_server_live()
    assert c.is_server_ready()
    assert c.is_model_ready("add_sub")
    assert not c.is_model_ready("no_such_model")
    md = c.get_model_metadata("add_sub")
    assert md["name"] == "add_sub"
    assert [i["name"] for i in md["inputs"]] == ["INPUT0", "INPUT1"]
    assert md["inputs"][0]["shape"] == [-1, 4]


def test_json_infer_matches_numpy(server):
    c = httpclient.InferenceServerClient(server)
    rng = np.random.default_rng(3)
    a = rng.standard_normal((3, 4)).astype(np.float32)
    b = rng.standard_normal((3, 4)).astype(np.float32)
    inputs = [httpclient.InferInput("INPUT0", [3, 4], "FP32"), httpclient.InferInput("INPUT1", [3, 4], "FP32")]
    inputs[0].set_data_from_numpy(a, binary_data=False)
    inputs[1].set_data_from_numpy(b, binary_data=False)
    outputs = [httpclient.InferRequestedOutput("OUTPUT0", binary_data=False),
               httpclient.InferRequestedOutput("OUTPUT1", binary_data=False)]
    r = c.infer("add_sub", inputs, outputs=outputs, request_id="42")
    np.testing.assert_allclose(r.as_numpy("OUTPUT0"), a + b, rtol=1e-6)
    np.testing.assert_allclose(r.as_numpy("OUTPUT1"), a - b, rtol=1e-6)
    assert r.get_response()["id"] == "42"


def test_unknown_model_and_wrong_shape(server):
    c = httpclient.InferenceServerClient(server)
    x = httpclient.InferInput("INPUT0", [1, 3], "FP32")
    x.set_data_from_numpy(np.zeros((1, 3), np.float32), binary_data=False)
    with pytest.raises(InferenceServerException, match="unknown model 'nope'"):
        c.infer("nope", [x], outputs=[httpclient.InferRequestedOutput("y", binary_data=False)])
    y = httpclient.InferInput("INPUT1", [1, 3], "FP32")
    y.set_data_from_numpy(np.zeros((1, 3), np.float32), binary_data=False)
    with pytest.raises(InferenceServerException, match=r"expected shape \[-1,4\], got \[1,3\]"):
        c.infer("add_sub", [x, y], outputs=[httpclient.InferRequestedOutput("OUTPUT0", binary_data=False)])


def dtypes_inputs(binary):
    arrays = DTYPE_ARRAYS
    dt = DTYPE_NAMES
    inputs = []
    for name, a in arrays.items():
        i = httpclient.InferInput(name, list(a.shape), dt[name])
        i.set_data_from_numpy(a, binary_data=binary or name == "in_fp16")
        inputs.append(i)
    return arrays, inputs


def test_binary_tensors_every_datatype(server):
    c = httpclient.InferenceServerClient(server)
    arrays, inputs = dtypes_inputs(binary=True)
    r = c.infer("dtypes", inputs)  # tritonclient asks for binary outputs by default
    for name, a in arrays.items():
        got = r.as_numpy(name.replace("in_", "out_"))
        assert got.shape == a.shape, name
        assert (got == a).all(), name


def test_bytes_as_json(server):
    c = httpclient.InferenceServerClient(server)
    arrays, inputs = dtypes_inputs(binary=False)
    outputs = [httpclient.InferRequestedOutput("out_string", binary_data=False),
               httpclient.InferRequestedOutput("out_int64", binary_data=False)]
    r = c.infer("dtypes", inputs, outputs=outputs)
    assert [o["name"] for o in r.get_response()["outputs"]] == ["out_string", "out_int64"]
    assert (r.as_numpy("out_int64") == arrays["in_int64"]).all()
    assert [s if isinstance(s, bytes) else s.encode() for s in r.as_numpy("out_string").ravel()] == \
        [b"quern", b"mill\x00stone"]


def test_async_infer_and_concurrent_clients_get_their_own_results(server):
    c = httpclient.InferenceServerClient(server, concurrency=16)
    pending = []
    for k in range(64):
        a = np.full((1 + k % 3, 4), k, np.float32)
        b = np.arange(a.size, dtype=np.float32).reshape(a.shape)
        inputs = [httpclient.InferInput("INPUT0", list(a.shape), "FP32"),
                  httpclient.InferInput("INPUT1", list(a.shape), "FP32")]
        inputs[0].set_data_from_numpy(a)
        inputs[1].set_data_from_numpy(b)
        pending.append((a, b, c.async_infer("add_sub", inputs, request_id=str(k))))
    for k, (a, b, fut) in enumerate(pending):
        r = fut.get_result()
        assert r.get_response()["id"] == str(k)
        np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), a + b)
        np.testing.assert_array_equal(r.as_numpy("OUTPUT1"), a - b)


def test_priority_and_timeout_parameters(server):
    c = httpclient.InferenceServerClient(server)
    a = np.ones((1, 4), np.float32)
    inputs = [httpclient.InferInput("INPUT0", [1, 4], "FP32"), httpclient.InferInput("INPUT1", [1, 4], "FP32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(a)
    r = c.infer("add_sub", inputs, priority=1, timeout=1_000_000)
    np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), a + a)
    with pytest.raises(InferenceServerException, match=r"priority 7 is outside"):
        c.infer("add_sub", inputs, priority=7)


def post(server, path, body, headers=None):
    import urllib.error
    import urllib.request
    req = urllib.request.Request(f"http://{server}{path}", data=body, headers=headers or {}, method="POST")
    try:
        with urllib.request.urlopen(req) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_repository_load_unload_index_and_config(server):
    c = httpclient.InferenceServerClient(server)
    index = {(m["name"], m["version"]): m["state"] for m in c.get_model_repository_index()}
    assert index[("versions", "2")] == "READY"
    cfg = c.get_model_config("versions")
    assert cfg["name"] == "versions"
    assert cfg["max_batch_size"] == 8
    c.unload_model("versions")
    assert not c.is_model_ready("versions")
    c.load_model("versions")
    assert c.is_model_ready("versions", "1") and c.is_model_ready("versions", "2")
    with pytest.raises(InferenceServerException):
        c.load_model("no_such_model")


def test_statistics_count_what_ran(server):
    c = httpclient.InferenceServerClient(server)
    before = c.get_inference_statistics("linear")["model_stats"][0]
    x = np.ones((3, 8), np.float32)
    i = httpclient.InferInput("x", [3, 8], "FP32")
    i.set_data_from_numpy(x)
    for _ in range(2):
        c.infer("linear", [i])
    after = c.get_inference_statistics("linear")["model_stats"][0]
    assert after["inference_count"] - before["inference_count"] == 6
    assert after["inference_stats"]["success"]["count"] - before["inference_stats"]["success"]["count"] == 2
    assert any(b["batch_size"] == 3 for b in after["batch_stats"])
    all_stats = c.get_inference_statistics()["model_stats"]
    assert {"add_sub", "linear"} <= {m["name"] for m in all_stats}


def test_malformed_json_and_truncated_binary(server):
    status, body = post(server, "/v2/models/add_sub/infer", b'{"inputs": [')
    assert status == 400 and b"malformed JSON" in body
    header = b'{"inputs":[{"name":"INPUT0","shape":[1,4],"datatype":"FP32","parameters":{"binary_data_size":16}}]}'
    status, body = post(server, "/v2/models/add_sub/infer", header + b"\0" * 10,
                        {"Inference-Header-Content-Length": str(len(header))})
    assert status == 400 and b"binary_data_size 16 but only 10 bytes" in body


def test_prometheus_metrics(server):
    import urllib.request
    c = httpclient.InferenceServerClient(server)
    x = np.ones((2, 8), np.float32)
    i = httpclient.InferInput("x", [2, 8], "FP32")
    i.set_data_from_numpy(x)
    c.infer("linear", [i])
    text = urllib.request.urlopen(f"http://{METRICS}/metrics").read().decode()
    stats = c.get_inference_statistics("linear")["model_stats"][0]
    assert f'quern_inference_count_total{{model="linear",version="1"}} {stats["inference_count"]}' in text
    assert 'quern_request_duration_us_bucket{model="linear",version="1",le="+Inf"}' in text
    assert "process_cpu_seconds_total" in text
    # An idle model forms batches up to max_batch_size (4 in slow_batch's config.pbtxt); 0 = does not batch.
    assert 'quern_batch_size_limit{model="slow_batch",version="1"} 4\n' in text
    assert 'quern_batch_size_limit{model="nobatch",version="1"} 0\n' in text


def test_client_disconnect_cancels_the_queued_request(server):
    import json
    import socket
    c = httpclient.InferenceServerClient(server)
    before = c.get_inference_statistics("slow_batch")["model_stats"][0]
    body = json.dumps({"inputs": [{"name": "x", "shape": [1, 3], "datatype": "FP32", "data": [1, 2, 3]}]}).encode()
    host, port = server.split(":")
    s = socket.create_connection((host, int(port)))
    s.sendall(b"POST /v2/models/slow_batch/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    _, port_m = METRICS.split(":")

    def pending():
        _, _, text = http_request(int(port_m), "GET", "/metrics")
        line = next((x for x in text.decode().splitlines() if x.startswith('quern_pending_requests{model="slow_batch"')),
                    " 0")
        return int(float(line.split()[-1]))

    def fails():
        return c.get_inference_statistics("slow_batch")["model_stats"][0]["inference_stats"]["fail"]["count"]
    wait_until(lambda: pending() == 1, timeout=30, what="the request queued (the model waits 1 s for company)")
    s.close()
    wait_until(lambda: fails() == before["inference_stats"]["fail"]["count"] + 1, timeout=30,
               what="the abandoned request counted as failed")
    time.sleep(1.5)  # past the batching delay: had it stayed queued, its batch would have run by now
    after = c.get_inference_statistics("slow_batch")["model_stats"][0]
    assert after["execution_count"] == before["execution_count"], "the abandoned request was computed"
    assert after["inference_stats"]["fail"]["count"] == before["inference_stats"]["fail"]["count"] + 1


def expected_classes(values, k):
    """Top-k of each row as (value, index), computed with numpy (ties: lower index first)."""
    return [[(row[i], int(i)) for i in np.argsort(-row, kind="stable")[:k]] for row in values]


def parsed_classes(got):
    """The server's "value:index" strings as (float32 value, index) (str from JSON, bytes from binary)."""
    got = [[x if isinstance(x, bytes) else x.encode() for x in row] for row in got]
    return [[(np.float32(x.split(b":")[0]), int(x.split(b":")[1])) for x in row] for row in got]


def test_classification_extension(server):
    c = httpclient.InferenceServerClient(server)
    a = np.array([[1.1, 3.3, 0.5, 2.4], [7, 7, -1, 0.25]], np.float32)
    b = np.zeros((2, 4), np.float32)
    inputs = [httpclient.InferInput("INPUT0", [2, 4], "FP32"), httpclient.InferInput("INPUT1", [2, 4], "FP32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    for binary in (True, False):
        outputs = [httpclient.InferRequestedOutput("OUTPUT0", binary_data=binary, class_count=2),
                   httpclient.InferRequestedOutput("OUTPUT1", binary_data=binary)]
        r = c.infer("add_sub", inputs, outputs=outputs)
        got = r.as_numpy("OUTPUT0")
        assert got.shape == (2, 2) and r.get_output("OUTPUT0")["datatype"] == "BYTES"
        assert parsed_classes(got) == expected_classes(a + b, 2)
        assert all(len(str(x).split(":")) == 2 for row in got for x in row)  # add_sub has no labels
        np.testing.assert_array_equal(r.as_numpy("OUTPUT1"), a - b)  # the other output as it was
    # More classes than the output has: all of them.
    r = c.infer("add_sub", inputs, outputs=[httpclient.InferRequestedOutput("OUTPUT0", class_count=9)])
    assert r.as_numpy("OUTPUT0").shape == (2, 4)
    # A count that is not a positive integer is refused, naming the output.
    with pytest.raises(InferenceServerException, match="OUTPUT0.*classification"):
        c.infer("add_sub", inputs, outputs=[httpclient.InferRequestedOutput("OUTPUT0", class_count=-2)])


def test_classification_names_the_labels_of_the_answering_model(tmp_path):
    import json
    import shutil
    import urllib.request

    import tritonclient.grpc as grpcclient
    repo = tmp_path / "repo"
    (repo / "labelled").mkdir(parents=True)
    shutil.copytree(os.path.join(MODELS, "add_sub", "1"), repo / "labelled" / "1")
    (repo / "labelled" / "config.pbtxt").write_text(
        'name: "labelled" platform: "onnxruntime_onnx" max_batch_size: 8\n'
        'input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] }, { name: "INPUT1" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
        'output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] label_filename: "labels.txt" },\n'
        '         { name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 4 ] } ]\n')
    labels = ["zero", "one", "two"]  # index 3 has none
    (repo / "labelled" / "labels.txt").write_text("\n".join(labels) + "\n")
    # A label file that is not there fails that model's load, with the reason.
    shutil.copytree(repo / "labelled", repo / "unlabelled")
    (repo / "unlabelled" / "labels.txt").unlink()
    (repo / "unlabelled" / "config.pbtxt").write_text(
        (repo / "labelled" / "config.pbtxt").read_text().replace('"labelled"', '"unlabelled"'))
    # An ensemble's outputs are named by its own label files (as Triton reads
    # them), not by its steps'.
    ensemble = ('name: "NAME" platform: "ensemble" max_batch_size: 8\n'
                'input [ { name: "A" data_type: TYPE_FP32 dims: [ 4 ] }, { name: "B" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
                'output [ { name: "SUM" data_type: TYPE_FP32 dims: [ 4 ] label_filename: "sum_labels.txt" },\n'
                '         { name: "DIFF" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
                'ensemble_scheduling { step [ { model_name: "labelled" input_map { key: "INPUT0" value: "A" }\n'
                '  input_map { key: "INPUT1" value: "B" } output_map { key: "OUTPUT0" value: "SUM" }\n'
                '  output_map { key: "OUTPUT1" value: "DIFF" } } ] }\n')
    sum_labels = ["cero", "uno", "dos", "tres"]
    for name in ("labelled_ensemble", "unlabelled_ensemble"):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "config.pbtxt").write_text(ensemble.replace("NAME", name))
    (repo / "labelled_ensemble" / "sum_labels.txt").write_text("\n".join(sum_labels) + "\n")
    proc, ports = start_quern(QUERN, str(repo))
    try:
        a = np.array([[0.5, 4, 2, 8]], np.float32)
        b = np.zeros((1, 4), np.float32)
        order = np.argsort(-a[0], kind="stable")
        want = [f"{(a + b)[0][i]}:{i}" + (f":{labels[i]}" if i < len(labels) else "") for i in order[:3]]

        def normal(row):  # "8.0:3" from numpy, "8:3" from the server: compare values, indices and labels
            return [(float(x.split(":")[0]), *x.split(":")[1:]) for x in row]

        c = httpclient.InferenceServerClient(f"127.0.0.1:{ports['HTTP']}")
        inputs = [httpclient.InferInput("INPUT0", [1, 4], "FP32"), httpclient.InferInput("INPUT1", [1, 4], "FP32")]
        inputs[0].set_data_from_numpy(a)
        inputs[1].set_data_from_numpy(b)
        r = c.infer("labelled", inputs, outputs=[httpclient.InferRequestedOutput("OUTPUT0", class_count=3)])
        got = [x.decode() if isinstance(x, bytes) else x for x in r.as_numpy("OUTPUT0")[0]]
        assert normal(got) == normal(want), (got, want)
        g = grpcclient.InferenceServerClient(f"127.0.0.1:{ports['gRPC']}")
        gin = [grpcclient.InferInput("INPUT0", [1, 4], "FP32"), grpcclient.InferInput("INPUT1", [1, 4], "FP32")]
        gin[0].set_data_from_numpy(a)
        gin[1].set_data_from_numpy(b)
        r = g.infer("labelled", gin, outputs=[grpcclient.InferRequestedOutput("OUTPUT0", class_count=3)])
        assert normal([x.decode() for x in r.as_numpy("OUTPUT0")[0]]) == normal(want)
        # An output without a label file: value and index only.
        r = c.infer("labelled", inputs, outputs=[httpclient.InferRequestedOutput("OUTPUT1", class_count=1)])
        assert len(str(r.as_numpy("OUTPUT1")[0][0]).split(":")) == 2
        # The ensemble: its own labels over HTTP and gRPC; an output of it
        # without a label file gives value and index, though its step's has one.
        want_sum = [f"{(a + b)[0][i]}:{i}:{sum_labels[i]}" for i in order[:3]]
        ens = [httpclient.InferInput("A", [1, 4], "FP32"), httpclient.InferInput("B", [1, 4], "FP32")]
        ens[0].set_data_from_numpy(a)
        ens[1].set_data_from_numpy(b)
        r = c.infer("labelled_ensemble", ens, outputs=[httpclient.InferRequestedOutput("SUM", class_count=3),
                                                       httpclient.InferRequestedOutput("DIFF", class_count=2)])
        got = [x.decode() if isinstance(x, bytes) else x for x in r.as_numpy("SUM")[0]]
        assert normal(got) == normal(want_sum), (got, want_sum)
        assert all(len(str(x).split(":")) == 2 for x in r.as_numpy("DIFF")[0])
        gens = [grpcclient.InferInput("A", [1, 4], "FP32"), grpcclient.InferInput("B", [1, 4], "FP32")]
        gens[0].set_data_from_numpy(a)
        gens[1].set_data_from_numpy(b)
        r = g.infer("labelled_ensemble", gens, outputs=[grpcclient.InferRequestedOutput("SUM", class_count=3)])
        assert normal([x.decode() for x in r.as_numpy("SUM")[0]]) == normal(want_sum)
        req = urllib.request.Request(f"http://127.0.0.1:{ports['HTTP']}/v2/repository/index", data=b"{}", method="POST")
        states = {m["name"]: m for m in json.loads(urllib.request.urlopen(req).read())}
        assert states["labelled"]["state"] == "READY"
        assert states["unlabelled"]["state"] == "UNAVAILABLE"
        assert "label file" in states["unlabelled"]["reason"] and "labels.txt" in states["unlabelled"]["reason"]
        assert states["labelled_ensemble"]["state"] == "READY"
        assert states["unlabelled_ensemble"]["state"] == "UNAVAILABLE"
        assert "sum_labels.txt" in states["unlabelled_ensemble"]["reason"], states["unlabelled_ensemble"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
