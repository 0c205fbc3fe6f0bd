"""Models on GPUs: instance_group KIND_GPU / KIND_AUTO, ONNX Runtime's CUDA execution provider, and
Python models told their device, as Triton does.

Whether this machine has a GPU is asked of CUDA's driver directly (ctypes, not through Quern), and
whether ONNX Runtime's CUDA provider is installed is read beside the libonnxruntime that `quern`
loads (scripts/setup.sh installs it with QUERN_WITH_CUDA=1). Tests that need a GPU are skipped with
that reason on machines without one; the tests of what such a machine does with a GPU
configuration run there instead. Nothing here pretends to be a GPU."""
import ctypes
import os
import re
import shutil
import subprocess
import threading

import numpy as np
import pytest
import tritonclient.http as httpclient

from quern_testing import start_quern

QUERN = os.environ["QUERN_BIN"]
MODELS = os.environ["QUERN_TEST_MODELS"]


def cuda_devices():
    """(devices, why none) as CUDA's driver counts them."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0, "no NVIDIA driver (libcuda.so.1)"
    rc = cuda.cuInit(0)
    if rc != 0:
        return 0, f"cuInit failed with CUDA error {rc}"
    n = ctypes.c_int(0)
    rc = cuda.cuDeviceGetCount(ctypes.byref(n))
    if rc != 0:
        return 0, f"cuDeviceGetCount failed with CUDA error {rc}"
    return n.value, "" if n.value else "CUDA sees no device"


def ort_cuda_provider():
    """The CUDA provider beside the libonnxruntime.so.1 that `quern` loads (ldd), or None."""
    out = subprocess.run(["ldd", QUERN], capture_output=True, text=True, check=True).stdout
    m = re.search(r"libonnxruntime\.so\.1 => (\S+)", out)
    if not m:
        return None
    path = os.path.join(os.path.dirname(os.path.realpath(m.group(1))), "libonnxruntime_providers_cuda.so")
    return path if os.path.isfile(path) else None


GPUS, NO_GPU_WHY = cuda_devices()
PROVIDER = ort_cuda_provider()
needs_gpu = pytest.mark.skipif(GPUS == 0, reason=f"no GPU on this machine: {NO_GPU_WHY}")
needs_ort_gpu = pytest.mark.skipif(
    GPUS == 0 or PROVIDER is None,
    reason=f"no GPU on this machine: {NO_GPU_WHY}" if GPUS == 0 else
    "ONNX Runtime's CUDA provider is not installed (scripts/setup.sh with QUERN_WITH_CUDA=1)")
without_gpu = pytest.mark.skipif(GPUS > 0, reason="this machine has a GPU: the GPU tests run instead")

LINEAR = '''backend: "onnxruntime"
max_batch_size: 16
dynamic_batching { max_queue_delay_microseconds: 2000 }
instance_group [ {groups} ]
'''

WHERE_PY = '''import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.where = [1 if args["model_instance_kind"] == "GPU" else 0, int(args["model_instance_device_id"])]

    def execute(self, requests):
        out = []
        for r in requests:
            n = pb_utils.get_input_tensor_by_name(r, "x").as_numpy().shape[0]
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("where", np.array([self.where] * n, np.int32))]))
        return out
'''

WHERE_CONFIG = '''backend: "python"
max_batch_size: 4
input [ { name: "x" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "where" data_type: TYPE_INT32 dims: [ 2 ] } ]
instance_group [ {groups} ]
'''


def add_linear(repo, name, groups):
    shutil.copytree(os.path.join(MODELS, "linear"), repo / name)
    (repo / name / "config.pbtxt").write_text(LINEAR.replace("{groups}", groups))


def add_where(repo, name, groups):
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "1" / "model.py").write_text(WHERE_PY)
    (repo / name / "config.pbtxt").write_text(WHERE_CONFIG.replace("{groups}", groups))


def linear_expected(x):
    w = np.load(os.path.join(MODELS, "linear", "W.npy"))
    b = np.load(os.path.join(MODELS, "linear", "b.npy"))
    return x.astype(np.float64) @ w.astype(np.float64) + b


def infer(client, model, name, x, out):
    inp = httpclient.InferInput(name, list(x.shape), {np.float32: "FP32"}[x.dtype.type])
    inp.set_data_from_numpy(x)
    return client.infer(model, [inp]).as_numpy(out)


@pytest.fixture
def server(tmp_path):
    started = []

    def start(fill):
        fill(tmp_path)
        proc, ports = start_quern(QUERN, str(tmp_path))
        started.append(proc)
        return httpclient.InferenceServerClient(f"127.0.0.1:{ports['HTTP']}", concurrency=16), proc

    yield start
    for p in started:
        p.terminate()
        p.wait(timeout=60)


@without_gpu
def test_without_a_gpu_gpu_instances_are_refused_with_the_reason_and_the_rest_serve(server):
    def fill(repo):
        add_linear(repo, "on_gpu", "{ kind: KIND_CPU count: 1 }, { kind: KIND_GPU count: 1 }")
        add_linear(repo, "auto", "{ count: 2 }")  # KIND_AUTO: the CPU here
        add_where(repo, "where_gpu", "{ kind: KIND_GPU gpus: [ 0 ] }")
        add_where(repo, "where_cpu", "{ kind: KIND_CPU }")

    client, _ = server(fill)
    index = {m["name"]: m for m in client.get_model_repository_index()}
    for name, group in (("on_gpu", 1), ("where_gpu", 0)):
        assert index[name]["state"] == "UNAVAILABLE", index[name]
        reason = index[name]["reason"]
        assert f"model '{name}': instance_group {group} asks for KIND_GPU, but " in reason, reason
        if name == "on_gpu" and PROVIDER is None:  # ONNX Runtime's provider is missing before any GPU
            assert "CUDA execution provider is not installed" in reason, reason
        elif NO_GPU_WHY.startswith("no NVIDIA driver"):
            assert "libcuda.so.1" in reason, reason
    assert index["auto"]["state"] == "READY"
    x = np.random.default_rng(1).standard_normal((5, 8)).astype(np.float32)
    np.testing.assert_allclose(infer(client, "auto", "x", x, "y"), linear_expected(x), rtol=1e-5, atol=1e-5)
    groups = client.get_model_config("auto")["instance_group"]
    assert [(g["kind"], g["count"]) for g in groups] == [("KIND_CPU", 2)], groups  # as placed
    assert infer(client, "where_cpu", "x", np.zeros((3, 1), np.float32), "where").tolist() == [[0, 0]] * 3


@needs_ort_gpu
def test_a_gpu_instance_answers_like_numpy(server):
    client, _ = server(lambda repo: add_linear(repo, "on_gpu", "{ kind: KIND_GPU count: 1 gpus: [ 0 ] }"))
    rng = np.random.default_rng(2)
    for rows in (1, 3, 16):
        x = rng.standard_normal((rows, 8)).astype(np.float32)
        # TF32 matrix products on recent GPUs: about 1e-3 relative.
        np.testing.assert_allclose(infer(client, "on_gpu", "x", x, "y"), linear_expected(x), rtol=1e-2, atol=1e-2)
    groups = client.get_model_config("on_gpu")["instance_group"]
    assert [(g["kind"], g["count"], g.get("gpus")) for g in groups] == [("KIND_GPU", 1, [0])], groups


@needs_ort_gpu
def test_cpu_and_gpu_instances_side_by_side_answer_every_caller(server):
    client, proc = server(lambda repo: add_linear(
        repo, "mixed", "{ kind: KIND_CPU count: 2 }, { kind: KIND_GPU count: 1 }, { count: 1 }"))
    groups = client.get_model_config("mixed")["instance_group"]
    assert [g["kind"] for g in groups] == ["KIND_CPU", "KIND_GPU", "KIND_GPU"], groups
    rng = np.random.default_rng(3)
    inputs = [rng.standard_normal((1 + i % 4, 8)).astype(np.float32) for i in range(96)]
    answers = [None] * len(inputs)

    def call(i):
        answers[i] = infer(client, "mixed", "x", inputs[i], "y")

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for x, y in zip(inputs, answers):
        np.testing.assert_allclose(y, linear_expected(x), rtol=1e-2, atol=1e-2)
    if shutil.which("nvidia-smi"):
        apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                              capture_output=True, text=True).stdout.split()
        assert str(proc.pid) in apps, apps  # the server holds a CUDA context


@needs_gpu
def test_a_python_model_is_told_its_gpu(server):
    last = GPUS - 1
    client, _ = server(lambda repo: add_where(repo, "where_gpu", f"{{ kind: KIND_GPU gpus: [ {last} ] }}"))
    assert infer(client, "where_gpu", "x", np.zeros((2, 1), np.float32), "where").tolist() == [[1, last]] * 2


@pytest.mark.skipif(GPUS == 0 or PROVIDER is not None,
                    reason="needs a GPU and ONNX Runtime without its CUDA provider (the default setup)")
def test_with_a_gpu_but_no_cuda_provider_onnx_models_stay_on_the_cpu(server):
    def fill(repo):
        shutil.copytree(os.path.join(MODELS, "linear"), repo / "bare")  # no config: the automatic layout
        add_linear(repo, "auto", "{ count: 2 }")
        add_linear(repo, "on_gpu", "{ kind: KIND_GPU }")

    client, _ = server(fill)
    index = {m["name"]: m for m in client.get_model_repository_index()}
    assert index["bare"]["state"] == "READY" and index["auto"]["state"] == "READY", index
    assert "CUDA execution provider is not installed" in index["on_gpu"]["reason"], index["on_gpu"]
    groups = client.get_model_config("auto")["instance_group"]
    assert [(g["kind"], g["count"]) for g in groups] == [("KIND_CPU", 2)], groups
    x = np.random.default_rng(4).standard_normal((2, 8)).astype(np.float32)
    np.testing.assert_allclose(infer(client, "bare", "x", x, "y"), linear_expected(x), rtol=1e-5, atol=1e-5)


@needs_gpu
def test_kind_auto_tells_a_python_model_it_is_on_a_gpu_and_no_group_keeps_it_on_the_cpu(server):
    def fill(repo):
        add_where(repo, "where_auto", "{ count: 1 }")
        add_where(repo, "where_default", "{ count: 1 }")
        text = (repo / "where_default" / "config.pbtxt").read_text()
        (repo / "where_default" / "config.pbtxt").write_text(text[:text.index("instance_group")])

    client, _ = server(fill)
    got = infer(client, "where_auto", "x", np.zeros((1, 1), np.float32), "where").tolist()
    assert got[0][0] == 1, got  # GPU, as Triton's KIND_AUTO
    assert infer(client, "where_default", "x", np.zeros((1, 1), np.float32), "where").tolist() == [[0, 0]]
