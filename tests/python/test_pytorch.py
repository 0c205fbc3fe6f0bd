"""PyTorch (TorchScript) models served through LibTorch (backend "pytorch" / platform
"pytorch_libtorch"): models written by Debian's own torch 1.13 (make_torch_models.py, run with the
system's python3), answers checked against numpy and against PyTorch itself, over HTTP and gRPC
with tritonclient; a ResNet-50 served beside its ONNX export gives the same answers."""
import json
import os
import shutil
import subprocess
import threading

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from quern_testing import http_request, start_quern

QUERN = os.environ["QUERN_BIN"]
HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("pytorch")
    repo = root / "repo"
    repo.mkdir()
    subprocess.run(["/usr/bin/python3", os.path.join(HERE, "make_torch_models.py"), str(repo), "--resnet"],
                   check=True, timeout=600)
    # Not TorchScript: refused when loading, with LibTorch's reason; the rest still serve.
    (repo / "broken" / "1").mkdir(parents=True)
    (repo / "broken" / "1" / "model.pt").write_bytes(b"PK\x03\x04 this is not a TorchScript archive")
    shutil.copy(repo / "raises" / "config.pbtxt", repo / "broken" / "config.pbtxt")
    # Warm-up runs forward() before the model is ready: a warm-up sample the model refuses fails the
    # load with the model's own message; one it takes leaves it ready.
    for name, first in (("warm_refused", -1.0), ("warm_taken", 1.0)):
        shutil.copytree(repo / "raises", repo / name)
        (repo / name / "warmup").mkdir()
        (repo / name / "warmup" / "x.bin").write_bytes(np.array([[first, 0], [1, 2]], np.float32).tobytes())
        with open(repo / name / "config.pbtxt", "a") as f:
            f.write('model_warmup [ { name: "w" batch_size: 2 inputs { key: "INPUT__0" value { '
                    'data_type: TYPE_FP32 dims: [ 2 ] input_data_file: "x.bin" } } } ]\n')
    # Triton's <name>__<index> with any name: the ordered model again, its tensors listed backwards.
    shutil.copytree(repo / "ordered", repo / "ordered_suffix")
    (repo / "ordered_suffix" / "config.pbtxt").write_text(
        'backend: "pytorch"\nmax_batch_size: 4\n'
        'input [ { name: "y__1" data_type: TYPE_FP32 dims: [ 2 ] }, { name: "x__0" data_type: TYPE_FP32 dims: [ 2 ] } ]\n'
        'output [ { name: "prod__1" data_type: TYPE_FP32 dims: [ 2 ] },'
        ' { name: "diff__0" data_type: TYPE_FP32 dims: [ 2 ] } ]\n')
    # Configurations refused when loading: an argument of forward() without an input, an optional input.
    shutil.copytree(repo / "pair", repo / "pair_missing_b")
    (repo / "pair_missing_b" / "config.pbtxt").write_text(
        'platform: "pytorch_libtorch"\nmax_batch_size: 4\ninput [ { name: "a" data_type: TYPE_FP32 dims: [ 2 ] } ]\n'
        'output [ { name: "sum" data_type: TYPE_FP32 dims: [ 2 ] } ]\n')
    shutil.copytree(repo / "raises", repo / "optional_input")
    (repo / "optional_input" / "config.pbtxt").write_text(
        (repo / "raises" / "config.pbtxt").read_text().replace("dims: [ 2 ] }", "dims: [ 2 ] optional: true }", 1))
    # Ensembles whose steps share tensors: one step writes into its input (which the ensemble also
    # answers with); one model, run twice, changes the buffer its first answer was a view of.
    for name, first, second in (("shared_input", "raises", "inplace"), ("shared_buffer", "counter", "counter")):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "config.pbtxt").write_text(f'''platform: "ensemble"
max_batch_size: 4
input [ {{ name: "in" data_type: TYPE_FP32 dims: [ 2 ] }} ]
output [ {{ name: "first" data_type: TYPE_FP32 dims: [ 2 ] }}, {{ name: "second" data_type: TYPE_FP32 dims: [ 2 ] }} ]
ensemble_scheduling {{ step [
  {{ model_name: "{first}" model_version: -1 input_map {{ key: "INPUT__0" value: "in" }}
    output_map {{ key: "OUTPUT__0" value: "first" }} }},
  {{ model_name: "{second}" model_version: -1 input_map {{ key: "INPUT__0" value: "first" }}
    output_map {{ key: "OUTPUT__0" value: "second" }} }} ] }}
''')
    log = []
    proc, ports = start_quern(QUERN, str(repo), log=log)
    yield root, ports, log
    proc.terminate()
    proc.wait(timeout=60)


def infer(port, model, inputs, outputs=None):
    """One request with JSON tensors: {name: array} -> {name: array}, or (status, error text)."""
    body = {"inputs": [{"name": n, "datatype": {np.float32: "FP32", np.int64: "INT64"}[a.dtype.type],
                        "shape": list(a.shape), "data": a.ravel().tolist()} for n, a in inputs.items()]}
    status, _, data = http_request(port, "POST", f"/v2/models/{model}/infer", json.dumps(body).encode())
    answer = json.loads(data)
    if status != 200:
        return status, answer.get("error", "")
    types = {"FP32": np.float32, "INT64": np.int64}
    return {o["name"]: np.array(o["data"], types[o["datatype"]]).reshape(o["shape"]) for o in answer["outputs"]}


def test_an_affine_model_answers_as_numpy_computes(served):
    root, ports, _ = served
    w, b = np.load(root / "affine_W.npy"), np.load(root / "affine_b.npy")
    x = np.random.default_rng(1).standard_normal((3, 4)).astype(np.float32)
    out = infer(ports["HTTP"], "affine", {"INPUT__0": x})
    expected = x @ w + b
    np.testing.assert_allclose(out["OUTPUT__0"], expected, rtol=1e-5, atol=1e-5)
    assert out["OUTPUT__1"].dtype == np.int64
    np.testing.assert_array_equal(out["OUTPUT__1"][:, 0], expected.argmax(axis=1))


def test_tritonclient_over_grpc_and_http(served):
    root, ports, _ = served
    w, b = np.load(root / "affine_W.npy"), np.load(root / "affine_b.npy")
    x = np.arange(8, dtype=np.float32).reshape(2, 4) / 8
    g = grpcclient.InferenceServerClient(f"127.0.0.1:{ports['gRPC']}")
    meta = g.get_model_metadata("affine")
    assert meta.platform == "pytorch_libtorch"
    i = grpcclient.InferInput("INPUT__0", [2, 4], "FP32")
    i.set_data_from_numpy(x)
    r = g.infer("affine", [i])
    np.testing.assert_allclose(r.as_numpy("OUTPUT__0"), x @ w + b, rtol=1e-5, atol=1e-5)
    h = httpclient.InferenceServerClient(f"127.0.0.1:{ports['HTTP']}")
    i = httpclient.InferInput("INPUT__0", [2, 4], "FP32")
    i.set_data_from_numpy(x, binary_data=True)
    r = h.infer("affine", [i], outputs=[httpclient.InferRequestedOutput("OUTPUT__1", binary_data=True)])
    np.testing.assert_array_equal(r.as_numpy("OUTPUT__1")[:, 0], (x @ w + b).argmax(axis=1))


def test_inputs_and_outputs_follow_their_numbers_not_the_configuration_order(served):
    _, ports, _ = served
    x = np.array([[5, 7]], np.float32)  # forward()'s first argument: INPUT__0
    y = np.array([[2, 3]], np.float32)
    out = infer(ports["HTTP"], "ordered", {"INPUT__0": x, "INPUT__1": y})
    np.testing.assert_array_equal(out["OUTPUT__0"], x - y)
    np.testing.assert_array_equal(out["OUTPUT__1"], x * y)


def test_named_tensors_go_in_configuration_order_with_their_types(served):
    _, ports, _ = served
    a = np.array([[0.5, -1.5], [2, 3]], np.float32)
    b = np.array([[1, 2], [-3, 1 << 40]], np.int64)
    out = infer(ports["HTTP"], "pair", {"a": a, "b": b})
    np.testing.assert_array_equal(out["sum"], a + b.astype(np.float32))
    assert out["triple"].dtype == np.int64
    np.testing.assert_array_equal(out["triple"], b * 3)


def test_concurrent_callers_are_batched_and_each_gets_its_own_answer(served):
    root, ports, _ = served
    w, b = np.load(root / "affine_W.npy"), np.load(root / "affine_b.npy")
    before = json.loads(http_request(ports["HTTP"], "GET", "/v2/models/affine/stats")[2])
    errors, threads = [], []

    def call(k):
        try:
            x = np.full((1, 4), k, np.float32)
            out = infer(ports["HTTP"], "affine", {"INPUT__0": x})
            np.testing.assert_allclose(out["OUTPUT__0"], x @ w + b, rtol=1e-5, atol=1e-4)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    for k in range(16):
        threads.append(threading.Thread(target=call, args=(k,)))
        threads[-1].start()
    for t in threads:
        t.join()
    assert not errors, errors
    after = json.loads(http_request(ports["HTTP"], "GET", "/v2/models/affine/stats")[2])

    def counts(s):
        st = s["model_stats"][0]
        return st["inference_count"], st["execution_count"]

    (i0, e0), (i1, e1) = counts(before), counts(after)
    assert i1 - i0 == 16
    assert e1 - e0 < 16, "batched: fewer executions than requests"


def test_an_exception_in_forward_fails_that_request_and_the_model_keeps_serving(served):
    _, ports, _ = served
    status, error = infer(ports["HTTP"], "raises", {"INPUT__0": np.array([[-1, 0]], np.float32)})
    assert status >= 400
    assert "raises" in error and "negative input refused" in error, error
    assert "frame #" not in error, "no C++ backtrace in the answer"
    ok = infer(ports["HTTP"], "raises", {"INPUT__0": np.array([[1, 2]], np.float32)})
    np.testing.assert_array_equal(ok["OUTPUT__0"], [[1, 2]])


def test_a_file_that_is_not_torchscript_is_refused_and_the_others_serve(served):
    _, ports, log = served
    status, _, _ = http_request(ports["HTTP"], "GET", "/v2/models/broken/ready")
    assert status != 200
    index = json.loads(http_request(ports["HTTP"], "POST", "/v2/repository/index", b"{}")[2])
    broken = [m for m in index if m["name"] == "broken"]
    assert broken and broken[0].get("state") != "READY", index
    assert "LibTorch cannot load" in broken[0].get("reason", "") + "".join(log), broken
    assert http_request(ports["HTTP"], "GET", "/v2/models/affine/ready")[0] == 200


def test_resnet50_through_libtorch_matches_pytorch_and_its_onnx_export(served):
    root, ports, _ = served
    x = np.load(root / "resnet50_input.npy")
    expected = np.load(root / "resnet50_expected.npy")  # PyTorch itself, in Python
    h = httpclient.InferenceServerClient(f"127.0.0.1:{ports['HTTP']}", network_timeout=120)
    i = httpclient.InferInput("INPUT__0", list(x.shape), "FP32")
    i.set_data_from_numpy(x, binary_data=True)
    torch_out = h.infer("resnet50", [i]).as_numpy("OUTPUT__0")
    i = httpclient.InferInput("input", list(x.shape), "FP32")
    i.set_data_from_numpy(x, binary_data=True)
    onnx_out = h.infer("resnet50_onnx", [i]).as_numpy("logits")
    scale = np.abs(expected).max()
    np.testing.assert_allclose(torch_out, expected, rtol=0, atol=1e-4 * scale)
    np.testing.assert_allclose(onnx_out, torch_out, rtol=0, atol=1e-3 * scale)
    np.testing.assert_array_equal(torch_out.argmax(axis=1), expected.argmax(axis=1))


def test_without_the_plugin_a_pytorch_model_is_refused_with_the_reason(served, tmp_path):
    root, _, _ = served
    shutil.copytree(root / "repo" / "pair", tmp_path / "pair")
    env = dict(os.environ, QUERN_PYTORCH_PLUGIN=str(tmp_path / "no-such-plugin.so"))
    log = []
    proc, ports = start_quern(QUERN, str(tmp_path), env=env, log=log)
    try:
        assert http_request(ports["HTTP"], "GET", "/v2/models/pair/ready")[0] != 200
        index = json.loads(http_request(ports["HTTP"], "POST", "/v2/repository/index", b"{}")[2])
        reason = [m for m in index if m["name"] == "pair"][0].get("reason", "")
        assert "LibTorch plugin" in reason and "no-such-plugin.so" in reason, (reason, log)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_warm_up_runs_forward_before_the_model_is_ready(served):
    _, ports, log = served
    assert http_request(ports["HTTP"], "GET", "/v2/models/warm_taken/ready")[0] == 200
    assert http_request(ports["HTTP"], "GET", "/v2/models/warm_refused/ready")[0] != 200
    index = json.loads(http_request(ports["HTTP"], "POST", "/v2/repository/index", b"{}")[2])
    reason = [m for m in index if m["name"] == "warm_refused"][0].get("reason", "")
    assert "negative input refused" in reason, (reason, log)


def reason(ports, model):
    index = json.loads(http_request(ports["HTTP"], "POST", "/v2/repository/index", b"{}")[2])
    return [m for m in index if m["name"] == model][0].get("reason", "")


def test_inputs_go_by_argument_name_or_by_the_number_after_any_name(served):
    _, ports, _ = served
    image, mask = np.array([[5, 7]], np.float32), np.array([[2, 3]], np.float32)
    out = infer(ports["HTTP"], "named_args", {"mask": mask, "image": image})  # listed mask first
    np.testing.assert_array_equal(out["diff"], image - mask)
    x, y = image, mask
    out = infer(ports["HTTP"], "ordered_suffix", {"x__0": x, "y__1": y})
    np.testing.assert_array_equal(out["diff__0"], x - y)
    np.testing.assert_array_equal(out["prod__1"], x * y)


def test_configurations_forward_cannot_take_are_refused_when_loading(served):
    _, ports, _ = served
    for model, why in (("pair_missing_b", "argument 'b' gets no input"), ("optional_input", "optional")):
        assert http_request(ports["HTTP"], "GET", f"/v2/models/{model}/ready")[0] != 200
        assert why in reason(ports, model), reason(ports, model)


def test_a_model_writing_into_its_input_changes_nobody_elses_tensor(served):
    _, ports, _ = served
    x = np.array([[1, 2]], np.float32)
    out = infer(ports["HTTP"], "shared_input", {"in": x})
    np.testing.assert_array_equal(out["first"], x, err_msg="the tensor the second step read")
    np.testing.assert_array_equal(out["second"], (x + 1) * 2)


def test_an_answer_is_not_a_view_of_memory_the_model_changes_later(served):
    _, ports, _ = served
    out = infer(ports["HTTP"], "shared_buffer", {"in": np.zeros((1, 2), np.float32)})
    np.testing.assert_array_equal(out["second"] - out["first"], [[1, 1]])
