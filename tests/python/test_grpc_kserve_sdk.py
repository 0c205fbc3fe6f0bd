"""KServe's own Python SDK (kserve.InferenceGRPCClient, as KServe's docs show it) against a real
`quern serve`, unchanged. A file of its own: the SDK's generated messages and tritonclient's define
the same `inference.*` names, which one Python process cannot hold twice."""
import asyncio
import os

import numpy as np
import pytest

from quern_testing import start_quern

QUERN = os.environ["QUERN_BIN"]
MODELS = os.environ["QUERN_TEST_MODELS"]


@pytest.fixture(scope="module")
def server():
    proc, ports = start_quern(QUERN, MODELS)
    yield f"127.0.0.1:{ports['gRPC']}"
    proc.terminate()
    proc.wait(timeout=30)


def test_health_readiness_and_an_inference(server):
    from kserve import InferenceGRPCClient, InferInput, InferRequest

    async def run():
        c = InferenceGRPCClient(server)
        try:
            assert await c.is_server_live() and await c.is_server_ready() and await c.is_model_ready("add_sub")
            a = np.random.default_rng(9).standard_normal((2, 4)).astype(np.float32)
            x, y = InferInput("INPUT0", [2, 4], "FP32"), InferInput("INPUT1", [2, 4], "FP32")
            x.set_data_from_numpy(a)
            y.set_data_from_numpy(a * 3)
            r = await c.infer(InferRequest(model_name="add_sub", infer_inputs=[x, y], request_id="sdk"))
            assert r.id == "sdk"
            out = {o.name: o.as_numpy() for o in r.outputs}
            np.testing.assert_allclose(out["OUTPUT0"], a * 4, rtol=1e-6)
            np.testing.assert_allclose(out["OUTPUT1"], a * -2, rtol=1e-6)
        finally:
            await c.close()
    asyncio.run(run())


def test_an_unknown_model_is_a_clear_error(server):
    from kserve import InferenceGRPCClient, InferInput, InferRequest

    async def run():
        c = InferenceGRPCClient(server)
        try:
            x = InferInput("x", [1], "FP32")
            x.set_data_from_numpy(np.ones(1, np.float32))
            with pytest.raises(Exception) as e:
                await c.infer(InferRequest(model_name="no_such_model", infer_inputs=[x]))
            assert "no_such_model" in str(e.value), e.value
        finally:
            await c.close()
    asyncio.run(run())
