"""Ensembles through real clients: tritonclient (HTTP and gRPC) against `quern serve` with the example
ensemble imagenet_pipeline (imagenet_preprocess -> imagenet -> imagenet_top5) and its step models."""
import os
import shutil
import threading

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from PIL import Image
from tritonclient.utils import InferenceServerException

from quern_testing import start_quern

QUERN = os.environ["QUERN_BIN"]
EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples")
STEPS = ("imagenet_preprocess", "imagenet", "imagenet_top5")
PHOTOS = ("eagle.jpg", "dog.jpg", "giraffe.jpg", "kite.jpg")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    for m in STEPS + ("imagenet_pipeline",):
        shutil.copytree(os.path.join(EXAMPLES, "models", m), repo / m)
    proc, ports = start_quern(QUERN, str(repo))
    yield {"ports": ports, "repo": repo}
    proc.terminate()
    proc.wait(timeout=30)


def pixels(name):
    return np.ascontiguousarray(np.asarray(Image.open(os.path.join(EXAMPLES, "data", name)).convert("RGB")))


def http_input(name, array, dtype):
    inp = httpclient.InferInput(name, list(array.shape), dtype)
    inp.set_data_from_numpy(array, binary_data=True)
    return inp


def step_by_step(client, rgb):
    """The same chain called one model at a time by the client: the reference for the ensemble."""
    image = client.infer("imagenet_preprocess", [http_input("pixels", rgb, "UINT8")]).as_numpy("image")
    logits = client.infer("imagenet", [http_input("image", image, "FP32")]).as_numpy("logits")
    top = client.infer("imagenet_top5", [http_input("logits", logits, "FP32")])
    return logits, top


def test_the_ensemble_answers_as_its_steps_called_one_by_one(server):
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server['ports']['HTTP']}")
    rgb = pixels("eagle.jpg")
    result = client.infer("imagenet_pipeline", [http_input("pixels", rgb, "UINT8")])
    logits, top = step_by_step(client, rgb)
    for name in ("classes", "probabilities", "labels"):
        np.testing.assert_array_equal(result.as_numpy(name), top.as_numpy(name))
    # numpy's softmax of the logits, independently of the Python model.
    x = logits[0].astype(np.float64)
    p = np.exp(x - x.max())
    p /= p.sum()
    order = np.argsort(-p)[:5]
    assert result.as_numpy("classes")[0].tolist() == order.tolist()
    np.testing.assert_allclose(result.as_numpy("probabilities")[0], p[order], rtol=1e-5, atol=1e-7)
    # A person reading the photograph: a young bald eagle.
    names = [b.decode() for b in result.as_numpy("labels")[0]]
    assert "bald eagle" in names[:2], names


def test_grpc_client_and_configuration_in_tritons_schema(server):
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server['ports']['gRPC']}")
    config = client.get_model_config("imagenet_pipeline").config
    assert config.platform == "ensemble"
    assert [s.model_name for s in config.ensemble_scheduling.step] == list(STEPS)
    assert dict(config.ensemble_scheduling.step[2].output_map) == {
        "classes": "classes", "probabilities": "probabilities", "labels": "labels"}
    assert len(config.instance_group) == 0
    http = httpclient.InferenceServerClient(f"127.0.0.1:{server['ports']['HTTP']}")
    as_json = http.get_model_config("imagenet_pipeline")
    assert [s["model_name"] for s in as_json["ensemble_scheduling"]["step"]] == list(STEPS)
    assert as_json["ensemble_scheduling"]["step"][1]["input_map"] == {"image": "image"}

    rgb = pixels("dog.jpg")
    inp = grpcclient.InferInput("pixels", list(rgb.shape), "UINT8")
    inp.set_data_from_numpy(rgb)
    result = client.infer("imagenet_pipeline", [inp], outputs=[grpcclient.InferRequestedOutput("labels")])
    assert result.as_numpy("classes") is None, "only the requested output comes back"
    _, top = step_by_step(http, rgb)
    np.testing.assert_array_equal(result.as_numpy("labels"), top.as_numpy("labels"))
    assert http.is_model_ready("imagenet_pipeline")


def test_concurrent_callers_get_their_own_answers_and_meet_in_batches(server):
    http = httpclient.InferenceServerClient(f"127.0.0.1:{server['ports']['HTTP']}")
    expected = {name: step_by_step(http, pixels(name))[1].as_numpy("labels") for name in PHOTOS}
    before = http.get_inference_statistics("imagenet")["model_stats"][0]
    wrong, errors = [], []

    def caller(i):
        c = httpclient.InferenceServerClient(f"127.0.0.1:{server['ports']['HTTP']}")
        for k in range(6):
            name = PHOTOS[(i + k) % len(PHOTOS)]
            try:
                got = c.infer("imagenet_pipeline", [http_input("pixels", pixels(name), "UINT8")]).as_numpy("labels")
            except InferenceServerException as e:
                errors.append(str(e))
                continue
            if not np.array_equal(got, expected[name]):
                wrong.append((name, got))

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert not wrong, wrong[:3]
    after = http.get_inference_statistics("imagenet")["model_stats"][0]
    items = int(after["inference_count"]) - int(before["inference_count"])
    batches = int(after["execution_count"]) - int(before["execution_count"])
    assert items == 48
    assert batches < items, f"imagenet ran {items} items in {batches} batches: the callers never met"
    stats = http.get_inference_statistics("imagenet_pipeline")["model_stats"][0]
    assert int(stats["inference_stats"]["success"]["count"]) >= 48 + 2


def test_bad_input_names_the_ensemble(server):
    http = httpclient.InferenceServerClient(f"127.0.0.1:{server['ports']['HTTP']}")
    flat = np.zeros((4, 4), dtype=np.uint8)
    with pytest.raises(InferenceServerException) as e:
        http.infer("imagenet_pipeline", [http_input("pixels", flat, "UINT8")])
    assert "imagenet_pipeline" in str(e.value) and "pixels" in str(e.value), str(e.value)
    with pytest.raises(InferenceServerException) as e:
        http.infer("imagenet_pipeline", [http_input("pixels", pixels("eagle.jpg").astype(np.float32), "FP32")])
    assert "expected data type UINT8" in str(e.value), str(e.value)


REGIONS = '''
import numpy as np

def infer(inputs):
    # One request in (a count and a base value), that many rows out: a detector's regions.
    n = int(inputs["count"][0])
    i = np.arange(n, dtype=np.float32)[:, None]
    return {"rows": np.hstack([i, 2 * i, 3 * i, np.full((n, 1), inputs["base"][0], np.float32)])}
'''

JOIN = '''
import numpy as np

def infer(inputs):
    # The rows of one request back in one place: their sum.
    return {"total": np.array([inputs["doubled"].sum()], dtype=np.float32)}
'''

FAN = '''
platform: "ensemble"
max_batch_size: 0
input [ { name: "count" data_type: TYPE_INT32 dims: [ 1 ] }, { name: "base" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "doubled" data_type: TYPE_FP32 dims: [ -1, 4 ] }, { name: "total" data_type: TYPE_FP32 dims: [ 1 ] } ]
ensemble_scheduling { step [
  { model_name: "regions" input_map { key: "count" value: "count" } input_map { key: "base" value: "base" }
    output_map { key: "rows" value: "rows" } },
  { model_name: "add_sub" input_map { key: "INPUT0" value: "rows" } input_map { key: "INPUT1" value: "rows" }
    output_map { key: "OUTPUT0" value: "doubled" } },
  { model_name: "join" input_map { key: "doubled" value: "doubled" } output_map { key: "total" value: "total" } }
] }
'''


def python_model(repo, name, config, code):
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(config)
    (repo / name / "1" / "model.py").write_text(code)


@pytest.fixture(scope="module")
def fan_server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("fan")
    shutil.copytree(os.path.join(os.environ["QUERN_TEST_MODELS"], "add_sub"), repo / "add_sub")
    # Row batches wait up to 50 ms for company, so the rows of different requests meet.
    (repo / "add_sub" / "config.pbtxt").write_text("""
max_batch_size: 16
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] }, { name: "INPUT1" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] }, { name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 4 ] } ]
dynamic_batching { max_queue_delay_microseconds: 50000 }
instance_group [ { count: 1 } ]
""")
    python_model(repo, "regions", """backend: "python"
max_batch_size: 0
input [ { name: "count" data_type: TYPE_INT32 dims: [ 1 ] }, { name: "base" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "rows" data_type: TYPE_FP32 dims: [ -1, 4 ] } ]
instance_group [ { count: 2 } ]
""", REGIONS)
    python_model(repo, "join", """backend: "python"
max_batch_size: 0
input [ { name: "doubled" data_type: TYPE_FP32 dims: [ -1, 4 ] } ]
output [ { name: "total" data_type: TYPE_FP32 dims: [ 1 ] } ]
""", JOIN)
    (repo / "fan" / "1").mkdir(parents=True)
    (repo / "fan" / "config.pbtxt").write_text(FAN)
    proc, ports = start_quern(QUERN, str(repo))
    yield ports
    proc.terminate()
    proc.wait(timeout=30)


def expected_rows(n, base):
    i = np.arange(n, dtype=np.float32)[:, None]
    rows = np.hstack([i, 2 * i, 3 * i, np.full((n, 1), base, np.float32)])
    return 2 * rows


def fan(client, n, base):
    count = np.array([n], dtype=np.int32)
    b = np.array([base], dtype=np.float32)
    result = client.infer("fan", [http_input("count", count, "INT32"), http_input("base", b, "FP32")])
    return result.as_numpy("doubled"), result.as_numpy("total")


def test_fan_out_one_request_to_many_rows_and_back(fan_server):
    client = httpclient.InferenceServerClient(f"127.0.0.1:{fan_server['HTTP']}")
    for n in (1, 7, 16, 45, 0):
        doubled, total = fan(client, n, 0.5)
        want = expected_rows(n, 0.5)
        assert doubled.shape == (n, 4), (n, doubled.shape)
        np.testing.assert_array_equal(doubled, want)
        assert total.tolist() == [float(want.sum())], (n, total)


def test_the_rows_of_concurrent_requests_meet_in_batches(fan_server):
    client = httpclient.InferenceServerClient(f"127.0.0.1:{fan_server['HTTP']}")
    stats = lambda: client.get_inference_statistics("add_sub")["model_stats"][0]  # noqa: E731
    before = stats()
    wrong, errors, sent = [], [], []
    lock = threading.Lock()

    def caller(i):
        c = httpclient.InferenceServerClient(f"127.0.0.1:{fan_server['HTTP']}")
        for k in range(4):
            n, base = 3 + (i + k) % 3, float(i * 100 + k)
            try:
                doubled, total = fan(c, n, base)
            except InferenceServerException as e:
                errors.append(str(e))
                continue
            with lock:
                sent.append(n)
            if not np.array_equal(doubled, expected_rows(n, base)):
                wrong.append((i, k, doubled))

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert not wrong, wrong[:3]
    after = stats()
    assert int(after["inference_count"]) - int(before["inference_count"]) == sum(sent)
    # No request has more than 5 rows: a larger batch holds rows of several requests.
    sizes = [int(b["batch_size"]) for b in after["batch_stats"]]
    assert max(sizes) > 5, sizes
