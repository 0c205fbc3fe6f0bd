"""Decoupled Python models (model_transaction_policy { decoupled: true }) served by a real `quern
serve` and driven by the real tritonclient: any number of responses to a request, sent from any
thread of the model, during execute() or after it returned, over gRPC ModelStreamInfer. Expected
values are computed here."""
import http.client
import json
import os
import queue
import socket
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from quern_testing import start_quern, stop_quern, write_model, write_one_step_ensemble

QUERN = os.environ["QUERN_BIN"]

# As Triton's example (python_backend/examples/decoupled, square_int32) behaves: a thread per request
# sends IN responses of OUT = IN (numpy's default int64 for an INT32 output, as the example does),
# then only the final flag; execute() returns None at once.
SQUARE = '''
import json
import threading
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise pb_utils.TritonModelException("square must be decoupled")
        if config["input"][0]["dims"] != [1]:
            raise pb_utils.TritonModelException("IN's dims are " + repr(config["input"][0]["dims"]))
        self.threads = []

    def execute(self, requests):
        for request in requests:
            n = int(pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()[0])
            sender = request.get_response_sender()
            t = threading.Thread(target=self.respond, args=(n, sender))
            t.start()
            self.threads.append(t)
        return None

    def respond(self, n, sender):
        for _ in range(n):
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([n]))]))
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        try:
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except pb_utils.TritonModelException as e:
            assert "closed" in str(e)
        else:
            raise AssertionError("a closed sender sent again")

    def finalize(self):
        for t in self.threads:
            t.join()
'''

SQUARE_CONFIG = '''
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
'''

# From execute() itself: a countdown per request, the last response carrying the final flag with its
# data; a negative start is answered with an error, an odd one fails mid-way (its earlier responses
# stay sent). Batched: the requests of one batch come together.
COUNTDOWN = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        for request in requests:
            start = int(pb_utils.get_input_tensor_by_name(request, "START").as_numpy().reshape(-1)[0])
            sender = request.get_response_sender()
            if start < 0:
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError("start below zero: %d" % start)),
                            flags=final)
                continue
            for k in range(start, -1, -1):
                if start == 7 and k == 3:
                    raise ValueError("seven fails at three")
                out = pb_utils.Tensor("LEFT", np.array([[k]], np.int64))
                sender.send(pb_utils.InferenceResponse([out]), flags=final if k == 0 else 0)
        return None
'''

COUNTDOWN_CONFIG = '''
backend: "python"
max_batch_size: 8
model_transaction_policy { decoupled: true }
input [ { name: "START" data_type: TYPE_INT64 dims: [ 1 ] } ]
output [ { name: "LEFT" data_type: TYPE_INT64 dims: [ 1 ] } ]
dynamic_batching { max_queue_delay_microseconds: 20000 }
instance_group [ { count: 1 kind: KIND_CPU } ]
'''

# Sends until its caller goes (request.is_cancelled()), at most 3,000 responses 10 ms apart; notes
# in a file that it saw the cancellation.
UNTIL_CANCELLED = '''
import threading
import time
import numpy as np
import triton_python_backend_utils as pb_utils

SEEN = %r


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            threading.Thread(target=self.run, args=(request,)).start()
        return None

    def run(self, request):
        sender = request.get_response_sender()
        for i in range(3000):
            if request.is_cancelled():
                with open(SEEN, "a") as f:
                    f.write("cancelled after %%d\\n" %% i)
                break
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([i], np.int32))]))
            time.sleep(0.01)
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
'''


# As Triton's example (python_backend/examples/bls_decoupled) does: a model (not decoupled) calls the
# decoupled square_int32 with exec(decoupled=True) and sums what every response holds, the last
# response (only the final flag) included; the async form awaits two calls together.
BLS_SQUARE = '''
import asyncio
import numpy as np
import triton_python_backend_utils as pb_utils


def call(n):
    return pb_utils.InferenceRequest(model_name="square_int32", inputs=[pb_utils.Tensor("IN", n)],
                                     requested_output_names=["OUT"])


def total(responses):
    s, count = 0, 0
    for r in responses:
        if r.has_error():
            raise pb_utils.TritonModelException(r.error().message())
        out = pb_utils.get_output_tensor_by_name(r, "OUT")
        count += 1
        if out is not None:
            s += int(out.as_numpy()[0])
    return s, count


class TritonPythonModel:
    ASYNC

    def respond(self, s, count):
        return pb_utils.InferenceResponse([pb_utils.Tensor("SUM", np.array([s], np.int32)),
                                           pb_utils.Tensor("RESPONSES", np.array([count], np.int32))])
'''

BLS_SYNC = '''def execute(self, requests):
        out = []
        for request in requests:
            n = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            if n[0] < 0:  # exec() without decoupled=True: the call's error, as the response
                r = call(-n).exec()
                return [pb_utils.InferenceResponse(error=r.error())]
            out.append(self.respond(*total(call(n).exec(decoupled=True))))
        return out'''

BLS_ASYNC = '''async def execute(self, requests):
        out = []
        for request in requests:
            n = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            both = await asyncio.gather(call(n).async_exec(decoupled=True), call(n).async_exec(decoupled=True))
            (a, ca), (b, cb) = total(both[0]), total(both[1])
            out.append(self.respond(a + b, ca + cb))
        return out'''

BLS_CONFIG = '''
backend: "python"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "SUM" data_type: TYPE_INT32 dims: [ 1 ] }, { name: "RESPONSES" data_type: TYPE_INT32 dims: [ 1 ] } ]
'''


# Y = X + 1 (INT32), the step after square_int32 in the ensemble squares_plus_one.
ADD_ONE = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy().astype(np.int32) + 1)]) for r in requests]
'''

ADD_ONE_CONFIG = '''
backend: "python"
max_batch_size: 0
input [ { name: "X" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "Y" data_type: TYPE_INT32 dims: [ 1 ] } ]
'''

# IN -> square_int32 (IN responses of [IN]) -> add_one: a decoupled ensemble, each of the step's responses
# one answer, [IN + 1]; beside it IN -> add_one (runs once; every answer carries it).
SQUARES_PLUS_ONE = '''
platform: "ensemble"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "NEXT" data_type: TYPE_INT32 dims: [ 1 ] }, { name: "IN_PLUS_ONE" data_type: TYPE_INT32 dims: [ 1 ] } ]
ensemble_scheduling {
  step [
    { model_name: "square_int32" input_map { key: "IN" value: "IN" } output_map { key: "OUT" value: "sq" } },
    { model_name: "add_one" input_map { key: "X" value: "sq" } output_map { key: "Y" value: "NEXT" } },
    { model_name: "add_one" input_map { key: "X" value: "IN" } output_map { key: "Y" value: "IN_PLUS_ONE" } }
  ]
}
'''


# A model that is not decoupled, for generate: text in, text out.
ECHO_TEXT = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy().reshape(-1)[0]
            upper = text.decode("utf-8").upper().encode("utf-8")
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("text_output", np.array([upper], dtype=object)),
                                                   pb_utils.Tensor("length", np.array([len(text)], np.int32))]))
        return out
'''

ECHO_TEXT_CONFIG = '''
backend: "python"
max_batch_size: 0
input [ { name: "text_input" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "text_output" data_type: TYPE_STRING dims: [ 1 ] }, { name: "length" data_type: TYPE_INT32 dims: [ 1 ] } ]
'''


# Sends every 10 ms for two minutes and never looks at is_cancelled(): its batch must still end
# once its caller has gone (its sender then raises, which ends the thread).
IGNORES_CANCEL = '''
import threading
import time
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            threading.Thread(target=self.run, args=(request.get_response_sender(),)).start()
        return None

    def run(self, sender):
        try:
            for i in range(12000):
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([i], np.int32))]))
                time.sleep(0.01)
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except pb_utils.TritonModelException:
            pass  # closed by the server
'''


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    seen = tmp_path_factory.mktemp("seen") / "seen.txt"
    seen_http = seen.parent / "seen_http.txt"
    write_model(repo, "square_int32", SQUARE_CONFIG, SQUARE)
    write_model(repo, "countdown", COUNTDOWN_CONFIG, COUNTDOWN)
    write_model(repo, "until_cancelled", SQUARE_CONFIG, UNTIL_CANCELLED % str(seen))
    write_model(repo, "until_cancelled_http", SQUARE_CONFIG, UNTIL_CANCELLED % str(seen_http))
    write_model(repo, "echo_text", ECHO_TEXT_CONFIG, ECHO_TEXT)
    write_model(repo, "add_one", ADD_ONE_CONFIG, ADD_ONE)
    (repo / "squares_plus_one" / "1").mkdir(parents=True)
    (repo / "squares_plus_one" / "config.pbtxt").write_text(SQUARES_PLUS_ONE)
    write_model(repo, "ignores_cancel", SQUARE_CONFIG + '''
        parameters { key: "quern.execute_timeout_ms" value: { string_value: "600000" } }''', IGNORES_CANCEL)
    write_model(repo, "bls_square", BLS_CONFIG, BLS_SQUARE.replace("ASYNC", BLS_SYNC))
    write_model(repo, "bls_square_async", BLS_CONFIG, BLS_SQUARE.replace("ASYNC", BLS_ASYNC))
    # An ensemble whose one step is bls_square (which calls the decoupled square_int32), and one whose
    # step is square_int32 itself.
    for name, step, out in (("bls_ensemble", "bls_square", "SUM"), ("decoupled_ensemble", "square_int32", "OUT")):
        write_one_step_ensemble(repo, name, step, "IN", "TYPE_INT32", "OUT", "TYPE_INT32", step_out=out)
    proc, ports = start_quern(QUERN, str(repo))
    yield {"ports": ports, "seen": seen, "seen_http": seen_http}
    stop_quern(proc)


def stream(served, model, requests, **kwargs):
    """Sends `requests` ((id, [InferInput])) on one stream; every (id, response or error, final) that
    came back, once the stream has ended."""
    got = queue.Queue()
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{served['ports']['gRPC']}")
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    for rid, inputs in requests:
        client.async_stream_infer(model, inputs, request_id=rid, **kwargs)
    client.stop_stream()
    client.close()
    out = []
    while not got.empty():
        result, error = got.get()
        if error is not None:
            out.append((None, error, None))
            continue
        response = result.get_response()
        final = response.parameters["triton_final_response"].bool_param
        out.append((response.id, result, final))
    return out


def int_input(name, value, dtype, shape):
    i = grpcclient.InferInput(name, shape, dtype)
    i.set_data_from_numpy(np.array(value, dtype={"INT32": np.int32, "INT64": np.int64}[dtype]).reshape(shape))
    return i


def test_responses_sent_from_threads_after_execute_returned_reach_their_request(served):
    starts = [4, 2, 0, 1]
    got = stream(served, "square_int32", [(str(i), [int_input("IN", [n], "INT32", [1])]) for i, n in enumerate(starts)])
    # As Triton's square client expects: n responses of [n] each, none for 0 (only the final flag).
    assert len(got) == sum(starts), got
    by_id = {}
    for rid, result, final in got:
        assert final is False
        by_id.setdefault(rid, []).append(result.as_numpy("OUT"))
    assert sorted(by_id) == [str(i) for i, n in enumerate(starts) if n > 0]
    for i, n in enumerate(starts):
        for out in by_id.get(str(i), []):
            assert out.dtype == np.int32 and out.tolist() == [n]
        assert len(by_id.get(str(i), [])) == n


def test_an_empty_final_response_when_the_client_asks_for_it(served):
    starts = [3, 0]
    got = stream(served, "square_int32", [(str(i), [int_input("IN", [n], "INT32", [1])]) for i, n in enumerate(starts)],
                 enable_empty_final_response=True)
    assert len(got) == sum(starts) + len(starts), got
    for i, n in enumerate(starts):
        mine = [(result, final) for rid, result, final in got if rid == str(i)]
        assert [final for _, final in mine] == [False] * n + [True]
        assert mine[-1][0].as_numpy("OUT") is None  # the last one carries only the flag


def test_responses_come_in_order_and_an_error_or_exception_closes_only_its_request(served):
    starts = {"a": 5, "b": -2, "c": 1, "d": 7}
    got = stream(served, "countdown", [(rid, [int_input("START", [[n]], "INT64", [1, 1])]) for rid, n in starts.items()])
    errors = [error for rid, _, error in [(g[0], None, g[1]) for g in got if g[0] is None]]
    by_id = {}
    for rid, result, final in got:
        if rid is not None:
            by_id.setdefault(rid, []).append((result.as_numpy("LEFT").reshape(-1).tolist(), final))
    assert by_id["a"] == [([k], k == 0) for k in range(5, -1, -1)]
    assert by_id["c"] == [([1], False), ([0], True)]
    # "b": one error; "d": its responses before the exception, then the exception's error (a stream's
    # error names no request id in tritonclient's callback: counted).
    assert by_id["d"] == [([k], False) for k in (7, 6, 5, 4)]
    texts = sorted(str(e) for e in errors)
    assert len(texts) == 2, texts
    assert any("start below zero: -2" in t for t in texts), texts
    assert any("seven fails at three" in t for t in texts), texts


def test_a_call_that_takes_one_answer_is_refused_with_a_clear_error(served):
    http = httpclient.InferenceServerClient(f"127.0.0.1:{served['ports']['HTTP']}")
    i = httpclient.InferInput("IN", [1], "INT32")
    i.set_data_from_numpy(np.array([2], np.int32))
    with pytest.raises(InferenceServerException) as e:
        http.infer("square_int32", [i])
    assert "decoupled" in str(e.value) and "square_int32" in str(e.value) and "ModelStreamInfer" in str(e.value)
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{served['ports']['gRPC']}")
    with pytest.raises(InferenceServerException) as e:
        grpc.infer("square_int32", [int_input("IN", [2], "INT32", [1])])
    assert "decoupled" in str(e.value), str(e.value)
    # Its configuration says so, as Triton's does.
    config = http.get_model_config("square_int32")
    assert config["model_transaction_policy"] == {"decoupled": True}, config


def test_a_client_that_goes_is_seen_by_the_model_and_frees_its_instance(served):
    def start_and_leave():
        got = queue.Queue()
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{served['ports']['gRPC']}")
        client.start_stream(callback=lambda result, error: got.put((result, error)))
        client.async_stream_infer("until_cancelled", [int_input("IN", [0], "INT32", [1])], request_id="long")
        result, error = got.get(timeout=30)  # the model's one instance runs it
        assert error is None and result.as_numpy("OUT").tolist() == [0]
        client.stop_stream(cancel_requests=True)
        client.close()

    def seen(lines):
        deadline = time.monotonic() + 25
        while time.monotonic() < deadline:
            if served["seen"].exists() and served["seen"].read_text().count("cancelled after ") >= lines:
                return True
            time.sleep(0.05)
        return False

    # The model sees its request cancelled (3,000 responses would take 30 s), and its one instance
    # then serves the next caller, who leaves too.
    start_and_leave()
    assert seen(1), "the model never saw its request cancelled"
    start_and_leave()
    assert seen(2), "the model never saw the second request cancelled"


def test_a_model_calls_a_decoupled_model_and_reads_every_response(served):
    """Triton's bls_decoupled clients: SUM == n * n from exec(decoupled=True), 2 * n * n from two
    async_exec(decoupled=True) awaited together (n responses and the last, empty one, per call)."""
    http = httpclient.InferenceServerClient(f"127.0.0.1:{served['ports']['HTTP']}")

    def infer(model, n):
        i = httpclient.InferInput("IN", [1], "INT32")
        i.set_data_from_numpy(np.array([n], np.int32))
        return http.infer(model, [i])

    for n in (4, 2, 0, 1):
        r = infer("bls_square", n)
        assert r.as_numpy("SUM").tolist() == [n * n] and r.as_numpy("RESPONSES").tolist() == [n + 1]
        r = infer("bls_square_async", n)
        assert r.as_numpy("SUM").tolist() == [2 * n * n] and r.as_numpy("RESPONSES").tolist() == [2 * (n + 1)]
    # exec() without decoupled=True on a decoupled model: the call's error says what to do.
    with pytest.raises(InferenceServerException) as e:
        infer("bls_square", -3)
    assert "decoupled" in str(e.value) and "exec(decoupled=True)" in str(e.value), str(e.value)


def post(served, path, body, raw=False):
    """POST `body` (JSON, or bytes as they are); (status, headers, body bytes) once the answer has
    ended (http.client reads a chunked body whole)."""
    conn = http.client.HTTPConnection("127.0.0.1", served["ports"]["HTTP"], timeout=60)
    conn.request("POST", path, body=body if raw else json.dumps(body), headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    data = r.read()
    conn.close()
    return r.status, dict((k.lower(), v) for k, v in r.getheaders()), data


def events(data):
    """The JSON objects of a server-sent events body ("data: <json>" events, a blank line after each)."""
    text = data.decode("utf-8")
    assert text.endswith("\n\n") or text == "", repr(text)
    return [json.loads(e[len("data: "):]) for e in text.split("\n\n") if e]


def test_generate_answers_a_model_with_its_inputs_by_name(served):
    status, headers, data = post(served, "/v2/models/echo_text/generate",
                                 {"text_input": "h\u00e9llo w\u00f6rld", "parameters": {"temperature": 0}, "other": 1})
    assert status == 200, data
    assert headers["content-type"].startswith("application/json")
    assert json.loads(data) == {"model_name": "echo_text", "model_version": "1", "text_output": "H\u00c9LLO W\u00d6RLD",
                                "length": len("h\u00e9llo w\u00f6rld".encode())}
    # generate_stream of a model that answers once: one event.
    status, headers, data = post(served, "/v2/models/echo_text/versions/1/generate_stream", {"text_input": "abc"})
    assert status == 200 and headers["content-type"].startswith("text/event-stream"), (status, headers)
    assert events(data) == [{"model_name": "echo_text", "model_version": "1", "text_output": "ABC", "length": 3}]
    # Bad requests: named.
    for body, text in ((b"{not json", "not JSON"), (b"[1, 2]", "JSON object"),
                       (json.dumps({"text_input": 5}).encode(), "text_input"),
                       (json.dumps({}).encode(), "text_input")):
        status, _, data = post(served, "/v2/models/echo_text/generate", body, raw=True)
        assert status == 400 and text in json.loads(data)["error"], (body, data)
    status, _, data = post(served, "/v2/models/no_such_model/generate_stream", {"text_input": "x"})
    assert status == 404 and "no_such_model" in json.loads(data)["error"]


def test_generate_stream_sends_each_response_of_a_decoupled_model_as_an_event(served):
    status, headers, data = post(served, "/v2/models/countdown/generate_stream", {"START": 3})
    assert status == 200 and headers["content-type"].startswith("text/event-stream") and \
        headers.get("transfer-encoding") == "chunked", (status, headers)
    assert [e["LEFT"] for e in events(data)] == [3, 2, 1, 0]
    # An error after some responses: an error event, then the end.
    status, _, data = post(served, "/v2/models/countdown/generate_stream", {"START": [7]})
    got = events(data)
    assert [e.get("LEFT") for e in got[:-1]] == [7, 6, 5, 4] and "seven fails at three" in got[-1]["error"], got
    # An error before any response: a JSON error with its status.
    status, headers, data = post(served, "/v2/models/countdown/generate_stream", {"START": -1})
    assert status >= 400 and headers["content-type"].startswith("application/json")
    assert "start below zero" in json.loads(data)["error"]
    # generate takes one response: several are refused, saying where they go; one is the answer.
    status, _, data = post(served, "/v2/models/countdown/generate", {"START": 2})
    assert status == 400 and "3 responses" in json.loads(data)["error"] and "generate_stream" in json.loads(data)["error"]
    status, _, data = post(served, "/v2/models/countdown/generate", {"START": 0})
    assert status == 200 and json.loads(data)["LEFT"] == 0, data


def test_a_generate_stream_client_that_leaves_cancels_its_request(served):
    port = served["ports"]["HTTP"]
    for attempt in (1, 2):  # the model's one instance is free again for the second
        s = socket.create_connection(("127.0.0.1", port), timeout=30)
        body = json.dumps({"IN": 0}).encode()
        s.sendall(b"POST /v2/models/until_cancelled_http/generate_stream HTTP/1.1\r\nHost: x\r\n"
                  b"Content-Type: application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        got = b""
        while b"data: " not in got:
            chunk = s.recv(65536)
            assert chunk, got
            got += chunk
        assert got.startswith(b"HTTP/1.1 200 ")
        s.close()
        deadline = time.monotonic() + 25
        while time.monotonic() < deadline:
            if served["seen_http"].exists() and served["seen_http"].read_text().count("cancelled after ") >= attempt:
                break
            time.sleep(0.05)
        assert served["seen_http"].exists() and served["seen_http"].read_text().count("cancelled after ") >= attempt


def test_calls_to_a_decoupled_model_through_an_ensemble_and_a_job(served):
    """A model that calls the decoupled square_int32 (BLS) serves as an ensemble's step and as a job;
    an ensemble with the decoupled model as a step is decoupled (one answer refused, saying why); a
    job of either keeps every response, in order ("responses" instead of "result"), also as binary
    data; a job whose model sends only the final flag has none."""
    port = served["ports"]["HTTP"]
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)

    def call(method, path, body=None):
        c.request(method, path, body=None if body is None else json.dumps(body))
        r = c.getresponse()
        return r.status, json.loads(r.read())

    def job(model, n, binary=False):
        request = {"inputs": [{"name": "IN", "shape": [1], "datatype": "INT32", "data": [n]}]}
        if binary:
            request["parameters"] = {"binary_data_output": True}
        status, accepted = call("POST", f"/v2/models/{model}/jobs", request)
        assert status == 202, accepted
        deadline = time.monotonic() + 30
        while True:
            c.request("GET", f"/v2/jobs/{accepted['job_id']}")
            r = c.getresponse()
            body = r.read()
            header = r.getheader("Inference-Header-Content-Length")
            got = json.loads(body[:int(header)] if header else body)
            if got["status"] not in ("queued", "running") or time.monotonic() > deadline:
                return got, body[int(header):] if header else b""
            time.sleep(0.02)

    request = {"inputs": [{"name": "IN", "shape": [1], "datatype": "INT32", "data": [3]}]}
    status, answer = call("POST", "/v2/models/bls_ensemble/infer", request)
    assert status == 200 and answer["outputs"][0]["data"] == [9], answer
    # An ensemble with the decoupled model as a step is decoupled: one answer is refused, saying why.
    status, answer = call("POST", "/v2/models/decoupled_ensemble/infer", request)
    assert status == 400 and "decoupled" in answer["error"] and "generate_stream" in answer["error"], answer
    for model in ("bls_square", "bls_ensemble"):
        done, _ = job(model, 3)
        assert done["status"] == "done" and "responses" not in done, done
        assert [o for o in done["result"]["outputs"] if o["name"] in ("SUM", "OUT")][0]["data"] == [9], done
    for model, name in (("square_int32", "OUT"), ("decoupled_ensemble", "OUT"), ("squares_plus_one", "NEXT")):
        done, _ = job(model, 3)
        assert done["status"] == "done" and "result" not in done, done
        want = 4 if name == "NEXT" else 3
        assert [[o["data"] for o in r["outputs"] if o["name"] == name] for r in done["responses"]] == [[[want]]] * 3, done
        none, _ = job(model, 0)
        assert none["status"] == "done" and none["responses"] == [], none
    # An error among the responses (countdown from 7 raises at 3, after four responses) fails the job.
    status, accepted = call("POST", "/v2/models/countdown/jobs",
                            {"inputs": [{"name": "START", "shape": [1, 1], "datatype": "INT64", "data": [7]}]})
    assert status == 202, accepted
    deadline = time.monotonic() + 30
    while True:
        status, failed = call("GET", f"/v2/jobs/{accepted['job_id']}")
        if failed["status"] not in ("queued", "running") or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert failed["status"] == "failed" and "seven fails at three" in failed["error"], failed
    # As binary data: each response's part in order after the JSON.
    done, parts = job("square_int32", 2, binary=True)
    sizes = [o["parameters"]["binary_data_size"] for r in done["responses"] for o in r["outputs"]]
    assert sizes == [4, 4] and np.frombuffer(parts, np.int32).tolist() == [2, 2], (done, parts)
    c.close()


def test_a_decoupled_step_makes_its_ensemble_stream_each_response_through_the_steps_after_it(served):
    """squares_plus_one: each of square_int32's responses to IN = n runs add_one, one answer [n + 1]
    each, in order, every one with IN_PLUS_ONE (a step that does not read the decoupled one's answers,
    run once); over gRPC ModelStreamInfer (the empty final response when asked), HTTP generate_stream
    and generate (one response); n = 0: no answer but the final flag. Its configuration says it is
    decoupled."""
    starts = [3, 0, 2]
    got = stream(served, "squares_plus_one", [(str(i), [int_input("IN", [n], "INT32", [1])])
                                               for i, n in enumerate(starts)], enable_empty_final_response=True)
    for i, n in enumerate(starts):
        mine = [(result, final) for rid, result, final in got if rid == str(i)]
        assert [final for _, final in mine] == [False] * n + [True], (n, got)
        for result, _ in mine[:-1]:
            assert result.as_numpy("NEXT").tolist() == [n + 1] and result.as_numpy("IN_PLUS_ONE").tolist() == [n + 1]
        assert mine[-1][0].as_numpy("NEXT") is None
    assert not [g for g in got if g[0] is None], got  # no error
    status, _, data = post(served, "/v2/models/squares_plus_one/generate_stream", {"IN": 4})
    assert status == 200 and [(e["NEXT"], e["IN_PLUS_ONE"]) for e in events(data)] == [(5, 5)] * 4, data
    status, _, data = post(served, "/v2/models/squares_plus_one/generate", {"IN": 1})
    assert status == 200 and json.loads(data)["NEXT"] == 2, data
    c = http.client.HTTPConnection("127.0.0.1", served["ports"]["HTTP"], timeout=30)
    c.request("GET", "/v2/models/squares_plus_one/config")
    config = json.loads(c.getresponse().read())
    c.close()
    assert config.get("model_transaction_policy", {}).get("decoupled") is True, config


def test_a_batch_whose_callers_left_ends_even_when_the_model_does_not_look(served):
    """The model streams for two minutes and never asks is_cancelled(); its one instance serves the next
    caller soon after the first one leaves (the batch is ended for it), not when it would finish."""
    for attempt in (1, 2):
        got = queue.Queue()
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{served['ports']['gRPC']}")
        client.start_stream(callback=lambda result, error: got.put((result, error)))
        started = time.monotonic()
        client.async_stream_infer("ignores_cancel", [int_input("IN", [0], "INT32", [1])], request_id=str(attempt))
        result, error = got.get(timeout=60)
        assert error is None and result.as_numpy("OUT").tolist() == [0]
        assert time.monotonic() - started < 45, "the instance was held by the caller that had left"
        client.stop_stream(cancel_requests=True)
        client.close()


def test_generate_stream_to_an_http_1_0_client_ends_with_the_connection(served):
    """HTTP/1.0 has no chunked encoding: the events come as they are, and the body ends when the
    server closes the connection."""
    body = json.dumps({"START": 2}).encode()
    s = socket.create_connection(("127.0.0.1", served["ports"]["HTTP"]), timeout=30)
    s.sendall(b"POST /v2/models/countdown/generate_stream HTTP/1.0\r\nContent-Type: application/json\r\n"
              b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    data = b""
    while True:
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
    s.close()
    head, _, rest = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ") and b"text/event-stream" in head, head
    assert b"Transfer-Encoding" not in head and b"Content-Length" not in head, head
    assert [e["LEFT"] for e in events(rest)] == [2, 1, 0]
