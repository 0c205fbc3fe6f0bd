"""A model's instances share one copy of its weights: `quern serve` with 4 instances (and with the
automatic layout: one per core plus the wide one) stays within 1.3x the resident memory of one
instance, every instance computes what numpy computes from the same weights, and nothing is left
in the temporary directory. The model is written here: a convolution whose weights ONNX Runtime
reorders into a blocked layout, and a matrix product whose weights its GEMM repacks. Instances on
one intra-op thread each share one session: 4 of them within 1.1x one instance's memory, on that
model, on a small CNN behind a large matrix-product head, and on a transformer encoder.

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


def eight_then_two(port, shape):
    """Ten random inputs of `shape` and the server's answers: eight sent at once, then two alone (so
    that every instance runs)."""
    rng = np.random.default_rng(5)
    xs = [rng.standard_normal(shape).astype(np.float32) for _ in range(10)]
    got = [None] * len(xs)

    def run(i):
        got[i] = infer(port, xs[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    run(8)
    run(9)
    return xs, got


def serve_and_check(tmp_path, model, config, env_extra=None):
    """Serves the model, checks 8 concurrent and 2 sequential answers against numpy; returns the
    server's resident memory (MB) after them and the temporary directory's contents."""
    path, (w, b, m) = model
    tmp = tmp_path / "tmp"
    tmp.mkdir(parents=True)
    repo = make_repo(str(tmp_path), path, config)
    proc, ports = start_quern(QUERN, repo, env={**os.environ, "TMPDIR": str(tmp)})
    try:
        xs, results = eight_then_two(ports["HTTP"], (1, C, HW, HW))
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


def write_head_model(path, rng):
    """A small convolution (3 -> 32 channels, stride 4) and a 41.9 MB matrix-product head."""
    w = (rng.standard_normal((32, 3, 3, 3)) * 0.1).astype(np.float32)
    m = (rng.standard_normal((32 * 8 * 10, 4096)) * 0.01).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1], strides=[4, 4]),
             helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("Flatten", ["r"], ["f"]),
             helper.make_node("MatMul", ["f", "m"], ["y"])]
    g = helper.make_graph(nodes, "head", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 32, 40])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4096])],
                          [numpy_helper.from_array(w, "w"), numpy_helper.from_array(m, "m")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)

    def reference(x):
        n = x.shape[0]
        xp = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1))).astype(np.float64)
        out = np.zeros((n, 32, 8, 10))
        for ky in range(3):
            for kx in range(3):
                patch = xp[:, :, ky:ky + 32:4, kx:kx + 40:4]  # the inputs under tap (ky, kx), stride 4
                out += np.einsum("nchw,oc->nohw", patch, w[:, :, ky, kx].astype(np.float64))
        return np.maximum(out, 0).reshape(n, -1) @ m.astype(np.float64)
    return (1, 3, 32, 40), reference


SEQ, D, FFN, LAYERS = 16, 512, 2048, 2  # weights: 2 layers x (4 x 512 x 512 + 2 x 512 x 2048) floats, 25.2 MB


def write_encoder_model(path, rng):
    """A transformer encoder, BERT's shape in small: per layer one-head self-attention (Q, K, V and
    output projections), a residual, a feed-forward block (ReLU) and a residual."""
    nodes, inits, params = [], [], []
    h = "x"
    scale = numpy_helper.from_array(np.array(1 / np.sqrt(D), np.float32), "scale")
    inits.append(scale)
    for i in range(LAYERS):
        p = {k: (rng.standard_normal(shape) * 0.03).astype(np.float32)
             for k, shape in (("q", (D, D)), ("k", (D, D)), ("v", (D, D)), ("o", (D, D)), ("f1", (D, FFN)),
                              ("f2", (FFN, D)))}
        params.append(p)
        n = {k: f"l{i}_{k}" for k in p}
        inits += [numpy_helper.from_array(v, n[k]) for k, v in p.items()]
        t = f"l{i}_"
        nodes += [helper.make_node("MatMul", [h, n["q"]], [t + "Q"]),
                  helper.make_node("MatMul", [h, n["k"]], [t + "K"]),
                  helper.make_node("MatMul", [h, n["v"]], [t + "V"]),
                  helper.make_node("Transpose", [t + "K"], [t + "Kt"], perm=[0, 2, 1]),
                  helper.make_node("MatMul", [t + "Q", t + "Kt"], [t + "S"]),
                  helper.make_node("Mul", [t + "S", "scale"], [t + "Ss"]),
                  helper.make_node("Softmax", [t + "Ss"], [t + "A"], axis=-1),
                  helper.make_node("MatMul", [t + "A", t + "V"], [t + "C"]),
                  helper.make_node("MatMul", [t + "C", n["o"]], [t + "O"]),
                  helper.make_node("Add", [h, t + "O"], [t + "R1"]),
                  helper.make_node("MatMul", [t + "R1", n["f1"]], [t + "F1"]),
                  helper.make_node("Relu", [t + "F1"], [t + "F1r"]),
                  helper.make_node("MatMul", [t + "F1r", n["f2"]], [t + "F2"]),
                  helper.make_node("Add", [t + "R1", t + "F2"], [t + "out"])]
        h = t + "out"
    nodes.append(helper.make_node("Identity", [h], ["y"]))
    g = helper.make_graph(nodes, "encoder", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", SEQ, D])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", SEQ, D])], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)

    def reference(x):
        h = x.astype(np.float64)
        for p in params:
            p = {k: v.astype(np.float64) for k, v in p.items()}
            q, k, v = h @ p["q"], h @ p["k"], h @ p["v"]
            s = q @ k.transpose(0, 2, 1) / np.sqrt(D)
            a = np.exp(s - s.max(axis=-1, keepdims=True))
            a /= a.sum(axis=-1, keepdims=True)
            r1 = h + (a @ v) @ p["o"]
            h = r1 + np.maximum(r1 @ p["f1"], 0) @ p["f2"]
        return h.reshape(h.shape[0], -1)
    return (1, SEQ, D), reference


def serve_rss(tmp_path, path, shape, reference, config):
    """Serves the model `path` ("big"), 8 concurrent requests then 2 more, each answer against
    `reference`; the server's resident memory (MB) after them."""
    repo = make_repo(str(tmp_path), path, config)
    proc, ports = start_quern(QUERN, repo)
    try:
        xs, got = eight_then_two(ports["HTTP"], shape)
        for x, y in zip(xs, got):
            np.testing.assert_allclose(y.reshape(y.shape[0], -1), reference(x), rtol=1e-3, atol=2e-3)
        return rss_mb(proc.pid)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.parametrize("kind", ["cnn", "matmul_head", "encoder"])
def test_instances_on_one_thread_each_hold_the_weights_once(tmp_path, model, kind):
    """4 instances on one intra-op thread each (set, so that the layout is the same on any machine)
    share one session: their resident memory is within 1.1x one instance's, whatever the weights
    are (a convolution's, reordered; a matrix product's, repacked), and each answer is numpy's."""
    if kind == "cnn":
        path, (w, b, m) = model
        shape, reference_fn = (1, C, HW, HW), lambda x: reference(x, w, b, m)
    else:
        path = str(tmp_path / "src" / "model.onnx")
        os.makedirs(os.path.dirname(path))
        write = write_head_model if kind == "matmul_head" else write_encoder_model
        shape, reference_fn = write(path, np.random.default_rng(31))
    one_thread = 'parameters { key: "intra_op_thread_count" value { string_value: "1" } }\n'
    one = serve_rss(tmp_path / "one", path, shape, reference_fn, "instance_group [ { count: 1 } ]\n" + one_thread)
    four = serve_rss(tmp_path / "four", path, shape, reference_fn, "instance_group [ { count: 4 } ]\n" + one_thread)
    if sanitized(QUERN):
        pytest.skip("resident memory under AddressSanitizer says little (its quarantine holds freed memory)")
    print(f"{kind}: 4 instances {four:.1f} MB, 1 instance {one:.1f} MB ({four / one:.2f}x)")
    assert four <= 1.1 * one, f"{kind}: 4 instances {four:.0f} MB, 1 instance {one:.0f} MB"


def test_weights_listed_as_inputs_and_unoptimized_graphs_still_serve(tmp_path):
    path = str(tmp_path / "src" / "model.onnx")
    weights = write_model(path, np.random.default_rng(29), weights_as_inputs=True)
    two_threads = 'parameters { key: "intra_op_thread_count" value { string_value: "2" } }\n'
    for threads in ("", two_threads):  # one session for both instances, and a session each
        serve_and_check(tmp_path / f"inputs{len(threads)}", (path, weights),
                        "instance_group [ { count: 2 } ]\n" + threads)
        serve_and_check(tmp_path / f"unoptimized{len(threads)}", (path, weights),
                        'instance_group [ { count: 2 } ]\noptimization { graph { level: -1 } }\n' + threads)


def test_a_temporary_directory_that_cannot_be_used_still_serves(tmp_path, model):
    """Sharing weights between sessions (instances on two threads each; the automatic layout's wide
    instance beside the others) needs a private folder in TMPDIR; without one each session loads its
    own copy and the answers stay right."""
    path, (w, b, m) = model
    two_threads = ('instance_group [ { count: 2 } ]\n'
                   'parameters { key: "intra_op_thread_count" value { string_value: "2" } }\n')
    for name, config in (("two", two_threads), ("auto", None)):
        repo = make_repo(str(tmp_path / name), path, config)
        proc, ports = start_quern(QUERN, repo, env={**os.environ, "TMPDIR": str(tmp_path / "no" / "such" / "dir")})
        try:
            x = np.random.default_rng(9).standard_normal((1, C, HW, HW)).astype(np.float32)
            for _ in range(3):  # the wide instance (a lone request) and the others
                np.testing.assert_allclose(infer(ports["HTTP"], x), reference(x, w, b, m), rtol=1e-3, atol=1e-3)
            xs, got = eight_then_two(ports["HTTP"], (1, C, HW, HW))
            for x, y in zip(xs, got):
                np.testing.assert_allclose(y, reference(x, w, b, m), rtol=1e-3, atol=1e-3)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
