"""KServe v2 gRPC against a real `quern serve`, driven by the real tritonclient[grpc] package (and grpcio's
own health-checking client). Expected values are computed with numpy from the inputs."""
import os
import queue
import shutil
import subprocess
import time

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from quern_testing import DTYPE_ARRAYS, DTYPE_NAMES, http_request, start_quern, wait_until

QUERN = os.environ["QUERN_BIN"]
MODELS = os.environ["QUERN_TEST_MODELS"]
PROTO_DIR = os.environ.get("QUERN_PROTO_DIR", "")


def start_server(repo, *extra):
    """Starts `quern serve`; returns (process, "host:port" of gRPC)."""
    proc, ports = start_quern(QUERN, repo, *extra)
    return proc, f"127.0.0.1:{ports['gRPC']}"


# The module server's ports (its metrics port: what tests wait on).
PORTS = {}


@pytest.fixture(scope="module")
def server():
    proc, ports = start_quern(QUERN, MODELS, "--grpc-max-message-bytes", "1000000", "--model-control", "explicit")
    PORTS.update(ports)
    address = f"127.0.0.1:{ports['gRPC']}"
    yield address
    proc.terminate()
    proc.wait(timeout=30)


def add_sub_inputs(a, b):
    inputs = [grpcclient.InferInput("INPUT0", list(a.shape), "FP32"),
              grpcclient.InferInput("INPUT1", list(b.shape), "FP32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    return inputs


def stats(client, model):
    return client.get_inference_statistics(model).model_stats[0]


def test_proto_is_wire_compatible_with_tritonclient():
    """Every message of Quern's grpc_service.proto has the same fields (name, number, type, label) as the
    specification's, as compiled into tritonclient."""
    from google.protobuf import descriptor_pb2
    import tempfile
    out = os.path.join(tempfile.mkdtemp(), "set.pb")
    subprocess.run(["protoc", f"-I{PROTO_DIR}", "--include_imports", f"--descriptor_set_out={out}",
                    os.path.join(PROTO_DIR, "grpc_service.proto")], check=True)
    fds = descriptor_pb2.FileDescriptorSet()
    fds.ParseFromString(open(out, "rb").read())
    ours = next(f for f in fds.file if f.name == "grpc_service.proto")
    theirs = descriptor_pb2.FileDescriptorProto()
    service_pb2.DESCRIPTOR.CopyToProto(theirs)
    assert ours.package == theirs.package == "inference"

    def fields(msgs, prefix=""):
        out = {}
        for m in msgs:
            name = prefix + m.name
            out[name] = sorted((f.name, f.number, f.type, f.label, f.type_name.split(".")[-1]) for f in m.field)
            out.update(fields(m.nested_type, name + "."))
        return out

    ours_f, theirs_f = fields(ours.message_type), fields(theirs.message_type)
    assert set(ours_f) == set(theirs_f)
    for name in theirs_f:
        assert ours_f[name] == theirs_f[name], name
    ours_rpcs = {(m.name, m.input_type, m.output_type, m.client_streaming, m.server_streaming)
                 for m in ours.service[0].method}
    theirs_rpcs = {(m.name, m.input_type, m.output_type, m.client_streaming, m.server_streaming)
                   for m in theirs.service[0].method}
    assert ours.service[0].name == theirs.service[0].name == "GRPCInferenceService"
    assert ours_rpcs == theirs_rpcs


def test_health_metadata_and_readiness(server):
    c = grpcclient.InferenceServerClient(server)
    assert c.is_server_live()
    assert c.is_server_ready()
    assert c.is_model_ready("add_sub")
    assert not c.is_model_ready("no_such_model")
    assert c.get_server_metadata().name == "quern"
    # The same extensions as over HTTP (GET /v2), classification among them.
    assert set(c.get_server_metadata().extensions) == {
        "binary_tensor_data", "statistics", "model_repository", "model_configuration", "schedule_policy",
        "parameters", "classification"}
    md = c.get_model_metadata("add_sub")
    assert md.name == "add_sub"
    assert [i.name for i in md.inputs] == ["INPUT0", "INPUT1"]
    assert list(md.inputs[0].shape) == [-1, 4]
    assert md.inputs[0].datatype == "FP32"
    with pytest.raises(InferenceServerException, match="unknown model 'nope'"):
        c.get_model_metadata("nope")


def test_standard_grpc_health_service(server):
    with grpc.insecure_channel(server) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        r = stub.Check(health_pb2.HealthCheckRequest(service=""))
        assert r.status == health_pb2.HealthCheckResponse.SERVING


def test_infer_raw_contents_matches_numpy(server):
    c = grpcclient.InferenceServerClient(server)
    rng = np.random.default_rng(3)
    a = rng.standard_normal((3, 4)).astype(np.float32)
    b = rng.standard_normal((3, 4)).astype(np.float32)
    r = c.infer("add_sub", add_sub_inputs(a, b), request_id="42")
    np.testing.assert_allclose(r.as_numpy("OUTPUT0"), a + b, rtol=1e-6)
    np.testing.assert_allclose(r.as_numpy("OUTPUT1"), a - b, rtol=1e-6)
    assert r.get_response().id == "42"
    assert r.get_response().model_version == "1"


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_compressed_calls_unary_and_stream(server, algorithm):
    """tritonclient's compression_algorithm: the client's grpc-encoding, each message compressed."""
    import queue
    c = grpcclient.InferenceServerClient(server)
    rng = np.random.default_rng(5)
    a = rng.standard_normal((4, 4)).astype(np.float32)
    b = np.zeros((4, 4), np.float32)  # compresses well
    r = c.infer("add_sub", add_sub_inputs(a, b), compression_algorithm=algorithm)
    np.testing.assert_allclose(r.as_numpy("OUTPUT0"), a + b, rtol=1e-6)
    answers = queue.Queue()
    c.start_stream(callback=lambda result, error: answers.put((result, error)), compression_algorithm=algorithm)
    try:
        for k in range(3):
            c.async_stream_infer("add_sub", add_sub_inputs(a * k, b), request_id=str(k))
        got = {}
        for _ in range(3):
            result, error = answers.get(timeout=30)
            assert error is None, error
            got[result.get_response().id] = result.as_numpy("OUTPUT0")
        for k in range(3):
            np.testing.assert_allclose(got[str(k)], a * k, rtol=1e-6)
    finally:
        c.stop_stream()


def test_a_compressed_message_that_inflates_past_the_limit_is_refused(server):
    """A message of 10 MB of zeros sent gzip-compressed (about 10 KB on the wire) to a server whose
    limit here is 1 MB: RESOURCE_EXHAUSTED once it inflates past the limit, and the server goes on."""
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc
    with grpc.insecure_channel(server) as ch:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            stub.ModelMetadata(service_pb2.ModelMetadataRequest(name="\x00" * (10 << 20)),
                               compression=grpc.Compression.Gzip, timeout=30)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value
        assert stub.ServerLive(service_pb2.ServerLiveRequest(), timeout=10).live


def test_typed_contents_through_the_raw_stub(server):
    """tritonclient always sends raw bytes; typed `contents` go through the generated stub."""
    with grpc.insecure_channel(server) as ch:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(ch)
        req = service_pb2.ModelInferRequest(model_name="add_sub", id="typed")
        for name, vals in [("INPUT0", [1, 2, 3, 4]), ("INPUT1", [10, 20, 30, 40])]:
            t = req.inputs.add(name=name, datatype="FP32", shape=[1, 4])
            t.contents.fp32_contents.extend(vals)
        resp = stub.ModelInfer(req)
        assert resp.id == "typed"
        out = {o.name: np.frombuffer(raw, np.float32) for o, raw in zip(resp.outputs, resp.raw_output_contents)}
        np.testing.assert_array_equal(out["OUTPUT0"], [11, 22, 33, 44])
        np.testing.assert_array_equal(out["OUTPUT1"], [-9, -18, -27, -36])
        # A count that does not match the shape is named.
        bad = service_pb2.ModelInferRequest(model_name="add_sub")
        t = bad.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 4])
        t.contents.fp32_contents.extend([1, 2, 3])
        with pytest.raises(grpc.RpcError) as e:
            stub.ModelInfer(bad)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "input 'INPUT0'" in e.value.details() and "needs 4 values" in e.value.details()


def test_every_datatype_and_bytes(server):
    c = grpcclient.InferenceServerClient(server)
    arrays, dt = DTYPE_ARRAYS, DTYPE_NAMES
    inputs = []
    for name, a in arrays.items():
        i = grpcclient.InferInput(name, list(a.shape), dt[name])
        i.set_data_from_numpy(a)
        inputs.append(i)
    outputs = [grpcclient.InferRequestedOutput(n.replace("in_", "out_")) for n in arrays]
    r = c.infer("dtypes", inputs, outputs=outputs)
    for name, a in arrays.items():
        got = r.as_numpy(name.replace("in_", "out_"))
        assert got.shape == a.shape, name
        assert (got == a).all(), name


def test_requested_outputs_subset(server):
    c = grpcclient.InferenceServerClient(server)
    a, b = np.ones((1, 4), np.float32), np.full((1, 4), 2, np.float32)
    r = c.infer("add_sub", add_sub_inputs(a, b), outputs=[grpcclient.InferRequestedOutput("OUTPUT1")])
    assert [o.name for o in r.get_response().outputs] == ["OUTPUT1"]
    np.testing.assert_array_equal(r.as_numpy("OUTPUT1"), a - b)


def test_errors_map_to_grpc_codes_with_clear_messages(server):
    c = grpcclient.InferenceServerClient(server)
    a = np.zeros((1, 3), np.float32)
    with pytest.raises(InferenceServerException) as e:
        c.infer("add_sub", add_sub_inputs(a, a))
    assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "expected shape [-1,4], got [1,3]" in e.value.message()
    with pytest.raises(InferenceServerException) as e:
        c.infer("nope", add_sub_inputs(a, a))
    assert e.value.status() == "StatusCode.NOT_FOUND"
    i = grpcclient.InferInput("INPUT0", [1, 4], "INT32")
    i.set_data_from_numpy(np.zeros((1, 4), np.int32))
    j = grpcclient.InferInput("INPUT1", [1, 4], "FP32")
    j.set_data_from_numpy(np.zeros((1, 4), np.float32))
    with pytest.raises(InferenceServerException, match="INPUT0") as e:
        c.infer("add_sub", [i, j])
    assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
    with pytest.raises(InferenceServerException) as e:
        c.infer("add_sub", add_sub_inputs(np.ones((1, 4), np.float32), np.ones((1, 4), np.float32)), priority=7)
    assert "priority 7 is outside" in e.value.message()


def test_oversize_message_is_resource_exhausted(server):
    c = grpcclient.InferenceServerClient(server)
    big = np.zeros((70000, 4), np.float32)  # 1.1 MB per input, over the 1 MB limit the server was given
    with pytest.raises(InferenceServerException) as e:
        c.infer("add_sub", add_sub_inputs(big, big))
    assert e.value.status() == "StatusCode.RESOURCE_EXHAUSTED"


def test_oversize_response_is_resource_exhausted_and_the_server_goes_on(server):
    c = grpcclient.InferenceServerClient(server)
    x = grpcclient.InferInput("x", [1, 100000], "FP32")  # 400 kB in; tile4 answers 1.6 MB, over the 1 MB limit
    x.set_data_from_numpy(np.ones((1, 100000), np.float32))
    with pytest.raises(InferenceServerException) as e:
        c.infer("tile4", [x])
    assert e.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
    small = np.arange(6, dtype=np.float32).reshape(2, 3)
    x = grpcclient.InferInput("x", [2, 3], "FP32")
    x.set_data_from_numpy(small)
    np.testing.assert_array_equal(c.infer("tile4", [x]).as_numpy("y"), np.tile(small, (1, 4)))


def test_health_follows_readiness_of_every_model(tmp_path):
    """A model that fails to load makes the server not ready (ServerReady and grpc.health.v1 NOT_SERVING);
    once it loads, both turn ready."""
    (tmp_path / "late" / "1").mkdir(parents=True)
    (tmp_path / "late" / "1" / "model.onnx").write_bytes(b"not an onnx model")
    shutil.copytree(os.path.join(MODELS, "add_sub"), tmp_path / "add_sub")
    proc, address = start_server(str(tmp_path), "--model-control", "explicit")
    try:
        c = grpcclient.InferenceServerClient(address)
        assert c.is_server_live()
        assert not c.is_server_ready()
        with grpc.insecure_channel(address) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            for service in ("", "inference.GRPCInferenceService"):
                r = health.Check(health_pb2.HealthCheckRequest(service=service))
                assert r.status == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.RpcError) as e:
                health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"))
            assert e.value.code() == grpc.StatusCode.NOT_FOUND
            unknown = health.Watch(health_pb2.HealthCheckRequest(service="no.such.Service"))
            assert next(unknown).status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
            unknown.cancel()
            # A watch hears the status now, then each change, and ends when the server stops.
            watch = health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=60)
            heard = [next(watch).status]
            shutil.copy(os.path.join(MODELS, "add_sub", "1", "model.onnx"), tmp_path / "late" / "1" / "model.onnx")
            c.load_model("late")
            assert c.is_server_ready()
            heard.append(next(watch).status)
            assert heard == [health_pb2.HealthCheckResponse.NOT_SERVING, health_pb2.HealthCheckResponse.SERVING]
            assert health.Check(health_pb2.HealthCheckRequest(service="")).status == \
                health_pb2.HealthCheckResponse.SERVING
            proc.terminate()
            rest = [m.status for m in watch]  # ends: the server finished the watch
            assert rest[-1:] == [health_pb2.HealthCheckResponse.NOT_SERVING], rest
            assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.terminate()
        proc.wait(timeout=30)


def test_health_watches_left_before_their_request_do_not_harm_the_server(server):
    """Watch calls whose client leaves before sending its request (the read ends, and the call is
    cancelled: both must come to one end of the call), and watches cancelled at once."""
    import threading
    with grpc.insecure_channel(server) as ch:
        watch = ch.stream_stream("/grpc.health.v1.Health/Watch", request_serializer=lambda b: b,
                                 response_deserializer=health_pb2.HealthCheckResponse.FromString)
        for _ in range(50):
            never = threading.Event()

            def nothing():
                never.wait(5)
                return
                yield  # a generator that sends no message

            call = watch(nothing())
            call.cancel()
            never.set()
        for _ in range(50):
            stream = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=""), timeout=0.002)
            try:
                for _ in stream:
                    pass
            except grpc.RpcError:
                pass
        r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert r.status == health_pb2.HealthCheckResponse.SERVING


def test_unimplemented_rpcs_say_so(server):
    c = grpcclient.InferenceServerClient(server)
    with pytest.raises(InferenceServerException) as e:
        c.get_system_shared_memory_status()
    assert e.value.status() == "StatusCode.UNIMPLEMENTED"
    assert "not implemented by Quern" in e.value.message()


def test_config_statistics_and_repository(server):
    c = grpcclient.InferenceServerClient(server)
    cfg = c.get_model_config("versions").config
    assert cfg.name == "versions" and cfg.max_batch_size == 8
    before = stats(c, "linear")
    x = np.ones((3, 8), np.float32)
    i = grpcclient.InferInput("x", [3, 8], "FP32")
    i.set_data_from_numpy(x)
    for _ in range(2):
        c.infer("linear", [i])
    after = stats(c, "linear")
    assert after.inference_count - before.inference_count == 6
    assert after.inference_stats.success.count - before.inference_stats.success.count == 2
    assert any(b.batch_size == 3 for b in after.batch_stats)
    index = {(m.name, m.version): m.state for m in c.get_model_repository_index().models}
    assert index[("versions", "2")] == "READY"
    c.unload_model("versions")
    assert not c.is_model_ready("versions")
    c.load_model("versions")
    assert c.is_model_ready("versions", "1") and c.is_model_ready("versions", "2")
    with pytest.raises(InferenceServerException):
        c.load_model("no_such_model")


def test_concurrent_async_clients_get_their_own_results(server):
    c = grpcclient.InferenceServerClient(server)
    results = queue.Queue()
    expected = {}
    for k in range(64):
        a = np.full((1 + k % 3, 4), k, np.float32)
        b = np.arange(a.size, dtype=np.float32).reshape(a.shape)
        expected[str(k)] = (a + b, a - b)
        c.async_infer("add_sub", add_sub_inputs(a, b), lambda result, error: results.put((result, error)),
                      request_id=str(k))
    for _ in range(64):
        r, e = results.get(timeout=30)
        assert e is None
        s, d = expected.pop(r.get_response().id)
        np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), s)
        np.testing.assert_array_equal(r.as_numpy("OUTPUT1"), d)
    assert not expected


def test_stream_many_requests_out_of_order_and_errors_do_not_end_it(server):
    c = grpcclient.InferenceServerClient(server)
    results = queue.Queue()
    c.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        # slow_batch waits up to 1 s for a full batch; add_sub answers at once: completion order differs from
        # submission order. fail_on_3 fails for [N, 3] inputs: an error for that request only.
        x = np.array([[1, 2, 3]], np.float32)
        s = grpcclient.InferInput("x", [1, 3], "FP32")
        s.set_data_from_numpy(x)
        c.async_stream_infer("slow_batch", [s], request_id="slow")
        expected = {}
        for k in range(32):
            a = np.full((1, 4), k, np.float32)
            b = np.ones((1, 4), np.float32)
            expected[f"fast{k}"] = a + b
            c.async_stream_infer("add_sub", add_sub_inputs(a, b), request_id=f"fast{k}")
        f = grpcclient.InferInput("x", [1, 3], "FP32")
        f.set_data_from_numpy(x)
        c.async_stream_infer("fail_on_3", [f], request_id="bad")
        order, errors = [], []
        for _ in range(34):
            r, e = results.get(timeout=30)
            if e is not None:
                errors.append(str(e))
                continue
            rid = r.get_response().id
            order.append(rid)
            if rid == "slow":
                np.testing.assert_allclose(r.as_numpy("y"), 2 * x)
            else:
                np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), expected.pop(rid))
        assert not expected
        assert len(errors) == 1 and "fail_on_3" in errors[0]
        assert order[-1] == "slow", "the slow request was answered last though submitted first"
    finally:
        c.stop_stream()


def pending(model):
    """Requests waiting in `model`'s queue now (the server's quern_pending_requests)."""
    _, _, body = http_request(PORTS["metrics"], "GET", "/metrics")
    for line in body.decode().splitlines():
        if line.startswith(f'quern_pending_requests{{model="{model}"'):
            return int(float(line.split()[-1]))
    return 0


def test_deadline_expiry_removes_the_request_before_it_runs(server):
    c = grpcclient.InferenceServerClient(server)
    before = stats(c, "slow_batch")
    x = grpcclient.InferInput("x", [1, 3], "FP32")
    x.set_data_from_numpy(np.ones((1, 3), np.float32))
    with pytest.raises(InferenceServerException) as e:
        c.infer("slow_batch", [x], client_timeout=0.2)  # the batch would form only after 1 s
    assert e.value.status() == "StatusCode.DEADLINE_EXCEEDED"
    # Counted as failed once dropped (at the latest when its batch would have formed), and never run.
    def counted():
        s = stats(c, "slow_batch")
        return s if s.inference_stats.fail.count == before.inference_stats.fail.count + 1 else None

    after = wait_until(counted, what="the expired request counted as failed")
    assert after.execution_count == before.execution_count, "the expired request was computed"


def test_cancelled_call_leaves_the_queue_at_once_and_is_not_computed(tmp_path):
    """A call cancelled while it waits for company leaves the queue then, not when the batching
    delay ends (here ten minutes), and is never computed: the next full batch holds the others only."""
    import quern_testing
    os.makedirs(tmp_path / "slow_cancel" / "1")
    shutil.copy(os.path.join(MODELS, "slow_batch", "1", "model.onnx"), tmp_path / "slow_cancel" / "1" / "model.onnx")
    (tmp_path / "slow_cancel" / "config.pbtxt").write_text(
        "max_batch_size: 4\ndynamic_batching { max_queue_delay_microseconds: 600000000 }\n")
    proc, ports = start_quern(QUERN, str(tmp_path))
    try:
        c = grpcclient.InferenceServerClient(f"127.0.0.1:{ports['gRPC']}")
        before = stats(c, "slow_cancel")
        x = grpcclient.InferInput("x", [1, 3], "FP32")
        x.set_data_from_numpy(np.ones((1, 3), np.float32))
        future = c.async_infer("slow_cancel", [x], lambda result, error: None)
        wait_until(lambda: quern_testing.pending(ports["metrics"], "slow_cancel") == 1, timeout=30,
                   what="the call queued (slow_cancel waits 10 minutes for company)")
        future.cancel()
        wait_until(lambda: stats(c, "slow_cancel").inference_stats.fail.count == before.inference_stats.fail.count + 1,
                   timeout=30, what="the cancelled call to leave the queue, counted as failed")
        assert quern_testing.pending(ports["metrics"], "slow_cancel") == 0
        # Four more fill a batch at once: it holds those four, not the cancelled one.
        done = queue.Queue()
        for k in range(4):
            y = grpcclient.InferInput("x", [1, 3], "FP32")
            y.set_data_from_numpy(np.full((1, 3), k, np.float32))
            c.async_infer("slow_cancel", [y], lambda result, error: done.put(error))
        assert [done.get(timeout=60) for _ in range(4)] == [None] * 4
        after = stats(c, "slow_cancel")
        assert after.execution_count == before.execution_count + 1, after
        assert after.inference_count == before.inference_count + 4, after
        assert after.inference_stats.fail.count == before.inference_stats.fail.count + 1
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_classification_extension_unary_and_stream(server):
    c = grpcclient.InferenceServerClient(server)
    a = np.array([[1.1, 3.3, 0.5, 2.4], [0, -2, 9, 9]], np.float32)
    b = np.ones((2, 4), np.float32)
    want = [[((a + b)[r][i], int(i)) for i in np.argsort(-(a + b)[r], kind="stable")[:3]] for r in range(2)]

    def parsed(got):
        return [[(np.float32(x.split(b":")[0]), int(x.split(b":")[1])) for x in row] for row in got]

    outputs = [grpcclient.InferRequestedOutput("OUTPUT0", class_count=3), grpcclient.InferRequestedOutput("OUTPUT1")]
    r = c.infer("add_sub", add_sub_inputs(a, b), outputs=outputs)
    assert r.get_output("OUTPUT0").datatype == "BYTES"
    assert parsed(r.as_numpy("OUTPUT0")) == want
    np.testing.assert_array_equal(r.as_numpy("OUTPUT1"), a - b)
    with pytest.raises(InferenceServerException, match="classification"):
        c.infer("add_sub", add_sub_inputs(a, b), outputs=[grpcclient.InferRequestedOutput("OUTPUT0", class_count=-1)])
    # The same over a stream.
    results = queue.Queue()
    c.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        c.async_stream_infer("add_sub", add_sub_inputs(a, b), outputs=outputs)
        result, error = results.get(timeout=30)
        assert error is None, error
        assert parsed(result.as_numpy("OUTPUT0")) == want
    finally:
        c.stop_stream()
