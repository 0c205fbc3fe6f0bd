"""KServe v2 HTTP against a real `quern serve`, driven by the real tritonclient package.

Expected values are computed with numpy from the inputs."""
import os
import re
import subprocess
import time

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

QUERN = os.environ["QUERN_BIN"]
MODELS = os.environ["QUERN_TEST_MODELS"]


@pytest.fixture(scope="module")
def server():
    proc = subprocess.Popen([QUERN, "serve", "--model-repository", MODELS, "--http-port", "0", "--host", "127.0.0.1"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    port = None
    deadline = time.time() + 60
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        m = re.search(r"HTTP listening on [^:]+:(\d+)", line)
        if m:
            port = int(m.group(1))
            break
    assert port, "server did not report its port"
    yield f"127.0.0.1:{port}"
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
