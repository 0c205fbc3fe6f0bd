"""A model's instances share one copy of its weights: `quern serve` with 4 instances (and with the
automatic layout: one per core plus the wide one) stays within 1.3x the resident memory of one
instance, every instance computes what numpy computes from the same weights, and nothing is left
in the temporary directory. The model is written here: a convolution whose weights ONNX Runtime
reorders into a blocked layout, and a matrix product whose weights its GEMM repacks.

Run with QUERN_BIN set to the quern binary."""
import json
import os
import shutil
import threading
import time
import urllib.request

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from quern_testing import http_request, rss_mb, sanitized, start_quern

QUERN = os.environ.get("QUERN_BIN", "quern")
C, HW, OUT = 1024, 4, 2048  # conv weights 1024x1024x3x3 (37.7 MB), matmul weights 1024x2048 (8.4 MB)


def write_model(path, rng, weights_as_inputs=False):
    w = (rng.standard_normal((C, C, 3, 3)) * 0.02).astype(np.float32)
    b = (rng.standard_normal(C) * 0.1).astype(np.float32)
    m = (rng.standard_normal((C, OUT)) * 0.05).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("GlobalAveragePool", ["r"], ["p"]),
             helper.make_node("Flatten", ["p"], ["f"]),
             helper.make_node("MatMul", ["f", "m"], ["y"])]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", C, HW, HW])]
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b"), numpy_helper.from_array(m, "m")]
    if weights_as_inputs:  # as old exporters wrote them: initializers also listed as (overridable) inputs
        inputs += [helper.make_tensor_value_info(t.name, TensorProto.FLOAT, list(t.dims)) for t in inits]
    g = helper.make_graph(nodes, "shared", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", OUT])],
                          inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    os.makedirs(os.path.dirname(path), exist_ok=True)
    onnx.save(model, path)
    return w, b, m


def reference(x, w, b, m):
    """The model in numpy: 3x3 convolution with padding 1, ReLU, global average, matrix product."""
    n = x.shape[0]
    xp = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1))).astype(np.float64)
    cols = np.empty((n, C, 9, HW, HW))
    for ky in range(3):
        for kx in range(3):
            cols[:, :, ky * 3 + kx] = xp[:, :, ky:ky + HW, kx:kx + HW]
    w2 = w.reshape(C, C * 9).astype(np.float64)
    conv = np.stack([w2 @ cols[i].reshape(C * 9, HW * HW) for i in range(n)]).reshape(n, C, HW, HW)
    conv += b.astype(np.float64)[None, :, None, None]
    pooled = np.maximum(conv, 0).mean(axis=(2, 3))
    return pooled @ m.astype(np.float64)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("shared")
    path = str(d / "src" / "model.onnx")
    w, b, m = write_model(path, np.random.default_rng(23))
    return path, (w, b, m)


def make_repo(root, model_path, config):
    repo = os.path.join(root, "repo")
    os.makedirs(os.path.join(repo, "big", "1"))
    shutil.copy(model_path, os.path.join(repo, "big", "1", "model.onnx"))
    # Sharing weights is ONNX Runtime's: the runtime pinned (an unconfigured model would run on the one
    # measured fastest). `config` None: nothing else said, the automatic layout.
    with open(os.path.join(repo, "big", "config.pbtxt"), "w") as f:
        f.write('backend: "onnxruntime"\n' + (config or ""))
    return repo


def infer(port, x):
    body = json.dumps({"inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32",
                                   "data": x.ravel().tolist()}]})
    status, _, data = http_request(port, "POST", "/v2/models/big/infer", body, timeout=60)
    assert status == 200, data
    out = json.loads(data)["outputs"][0]
    return np.array(out["data"], np.float64).reshape(out["shape"])


def serve_and_check(tmp_path, model, config, env_extra=None):
    """Serves the model, checks 8 concurrent and 2 sequential answers against numpy; returns the
    server's resident memory (MB) after them and the temporary directory's contents."""
    path, (w, b, m) = model
    tmp = tmp_path / "tmp"
    tmp.mkdir(parents=True)
    repo = make_repo(str(tmp_path), path, config)
    proc, ports = start_quern(QUERN, repo, env={**os.environ, "TMPDIR": str(tmp)})
    try:
        rng = np.random.default_rng(5)
        xs = [rng.standard_normal((1, C, HW, HW)).astype(np.float32) for _ in range(10)]
        results = [None] * len(xs)

        def run(i):
            results[i] = infer(ports["HTTP"], xs[i])

        threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        run(8)
        run(9)
        for x, got in zip(xs, results):
            np.testing.assert_allclose(got, reference(x, w, b, m), rtol=1e-3, atol=1e-3)
        left = sorted(os.listdir(tmp))
        return rss_mb(proc.pid), left
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_instances_share_weights_and_compute_like_numpy(tmp_path, model):
    one, left_one = serve_and_check(tmp_path / "one", model, "instance_group [ { count: 1 } ]\n")
    four, left_four = serve_and_check(tmp_path / "four", model, "instance_group [ { count: 4 } ]\n")
    auto, left_auto = serve_and_check(tmp_path / "auto", model, None)
    assert left_one == [] and left_four == [] and left_auto == [], (left_one, left_four, left_auto)
    if sanitized(QUERN):
        pytest.skip("resident memory under AddressSanitizer says little (its quarantine holds freed memory)")
    # 46 MB of weights: four unshared copies would add ~140 MB to one instance's resident memory.
    assert four <= 1.3 * one, f"4 instances: {four:.0f} MB, 1 instance: {one:.0f} MB"
    assert auto <= 1.3 * one, f"automatic layout: {auto:.0f} MB, 1 instance: {one:.0f} MB"


def test_weights_listed_as_inputs_and_unoptimized_graphs_still_serve(tmp_path):
    path = str(tmp_path / "src" / "model.onnx")
    weights = write_model(path, np.random.default_rng(29), weights_as_inputs=True)
    serve_and_check(tmp_path / "inputs", (path, weights), "instance_group [ { count: 2 } ]\n")
    serve_and_check(tmp_path / "unoptimized", (path, weights),
                    'instance_group [ { count: 2 } ]\noptimization { graph { level: -1 } }\n')


def test_a_temporary_directory_that_cannot_be_used_still_serves(tmp_path, model):
    """Sharing needs a private folder in TMPDIR; without one each instance loads its own copy and
    the answers stay right."""
    path, (w, b, m) = model
    repo = make_repo(str(tmp_path), path, "instance_group [ { count: 2 } ]\n")
    proc, ports = start_quern(QUERN, repo, env={**os.environ, "TMPDIR": str(tmp_path / "no" / "such" / "dir")})
    try:
        x = np.random.default_rng(9).standard_normal((1, C, HW, HW)).astype(np.float32)
        np.testing.assert_allclose(infer(ports["HTTP"], x), reference(x, w, b, m), rtol=1e-3, atol=1e-3)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
