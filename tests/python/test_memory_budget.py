"""A memory budget bounds the batches a model runs by what their runs need: models of one file, one
with parameter quern.memory_budget_mb, one with the server's --memory-budget-mb, one with none (0),
under the same burst. The file is written here: each item's input is multiplied by a 256 x 1024 weight (a
[N, 256, 1024] FP32 product, 1 MiB per item, that ONNX Runtime takes from Quern's allocator) and
summed back to [N, 1024]; the answers are checked against numpy.

Run with QUERN_BIN set to the quern binary."""
import json
import os
import shutil
import threading

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from quern_testing import http_request, metric_sum, start_quern, stop_quern

QUERN = os.environ.get("QUERN_BIN", "quern")
ROWS, WIDTH = 256, 1024  # the product: ROWS x WIDTH FP32 per item = 1 MiB
MiB = 1 << 20


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    rng = np.random.default_rng(7)
    w = rng.standard_normal((ROWS, WIDTH)).astype(np.float32)
    nodes = [helper.make_node("Unsqueeze", ["x", "axis"], ["x3"]),
             helper.make_node("Mul", ["x3", "w"], ["p"]),
             helper.make_node("ReduceSum", ["p", "axis"], ["y"], keepdims=0)]
    g = helper.make_graph(nodes, "wide", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", WIDTH])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", WIDTH])],
                          [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.array([1], np.int64), "axis")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 8
    path = tmp_path_factory.mktemp("budget") / "model.onnx"
    onnx.save(m, str(path))
    return str(path), w


def write(repo, name, model_path, budget=None):
    os.makedirs(os.path.join(repo, name, "1"))
    shutil.copy(model_path, os.path.join(repo, name, "1", "model.onnx"))
    # One instance; a batch leaves when 16 requests are queued (or after 2 s); the tuner off, so that
    # the limit is the budget's (or max_batch_size) alone.
    config = ('backend: "onnxruntime"\nmax_batch_size: 16\ninstance_group { count: 1 kind: KIND_CPU }\n'
              'dynamic_batching { max_queue_delay_microseconds: 2000000 }\n'
              'parameters { key: "quern.batch_size_tuning" value { string_value: "off" } }\n')
    if budget is not None:
        config += f'parameters {{ key: "quern.memory_budget_mb" value {{ string_value: "{budget}" }} }}\n'
    with open(os.path.join(repo, name, "config.pbtxt"), "w") as f:
        f.write(config)


def burst(port, name, w, n=48):
    """n requests at once, one row each; every answer checked against numpy. The batch sizes run."""
    rng = np.random.default_rng(len(name))
    rows = rng.standard_normal((n, WIDTH)).astype(np.float32)
    expected = (rows[:, None, :].astype(np.float64) * w.astype(np.float64)).sum(axis=1)
    errors = []

    def one(i):
        body = json.dumps({"inputs": [{"name": "x", "shape": [1, WIDTH], "datatype": "FP32",
                                       "data": rows[i].tolist()}]})
        status, _, data = http_request(port, "POST", f"/v2/models/{name}/infer", body, timeout=120)
        if status != 200:
            errors.append((i, status, data[:300]))
            return
        y = np.array(json.loads(data)["outputs"][0]["data"], np.float64)
        if not np.allclose(y, expected[i], rtol=1e-4, atol=1e-2):
            errors.append((i, "wrong answer", float(np.abs(y - expected[i]).max())))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    stats = json.loads(http_request(port, "GET", f"/v2/models/{name}/stats")[2])["model_stats"][0]
    return sorted({int(b["batch_size"]) for b in stats["batch_stats"]})


def test_a_budget_keeps_batches_where_their_run_memory_fits(tmp_path, model_file):
    path, w = model_file
    repo = str(tmp_path / "repo")
    write(repo, "bounded", path, budget=6)
    write(repo, "free", path, budget=0)  # none, over the server's
    write(repo, "server_bounded", path)  # the server's --memory-budget-mb
    proc, ports = start_quern(QUERN, repo, "--memory-budget-mb", "4")
    try:
        # Without a budget the burst runs in batches of 16 (max_batch_size): larger than any below. Their
        # run memory is measured all the same: a batch of 16 holds a 16 MiB product at least.
        assert max(burst(ports["HTTP"], "free", w)) == 16
        free_bytes = metric_sum(ports["metrics"], "quern_batch_memory_bytes", model="free")
        assert 16 * MiB <= free_bytes < 32 * MiB, free_bytes
        for name, budget in (("bounded", 6), ("server_bounded", 4)):
            sizes = burst(ports["HTTP"], name, w)
            limit = metric_sum(ports["metrics"], "quern_batch_size_limit", model=name)
            print(f"{name}: budget {budget} MiB, batch sizes run {sizes}, limit {limit:g}")
            # A batch of k items holds its k MiB product at least (ONNX Runtime may hold more at once):
            # no more than `budget` items fit; the first batch (nothing measured yet) has one, and the
            # budget leaves room for more than one.
            assert 2 <= limit <= budget, (name, limit, sizes)
            assert sizes[0] == 1 and 2 <= max(sizes) <= budget, (name, limit, sizes)
            # What a batch at the limit is expected to hold fits the budget, and holds its product.
            held = metric_sum(ports["metrics"], "quern_batch_memory_bytes", model=name)
            assert limit * MiB <= held <= budget * MiB, (name, limit, held)
    finally:
        stop_quern(proc)


def test_a_budget_that_is_not_a_size_fails_the_models_load_saying_so(tmp_path, model_file):
    path, _ = model_file
    repo = str(tmp_path / "repo")
    write(repo, "bad", path, budget="lots")
    proc, ports = start_quern(QUERN, repo)
    try:
        status, _, data = http_request(ports["HTTP"], "GET", "/v2/models/bad/ready")
        assert status != 200
        index = json.loads(http_request(ports["HTTP"], "POST", "/v2/repository/index", b"{}")[2])
        reason = next(m.get("reason", "") for m in index if m["name"] == "bad")
        assert "quern.memory_budget_mb" in reason and "lots" in reason, reason
    finally:
        stop_quern(proc)
