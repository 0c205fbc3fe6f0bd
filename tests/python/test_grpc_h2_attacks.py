"""The gRPC port under HTTP/2 attacks, sent as raw frames (the `h2` package, or bytes written by hand)
against a real `quern serve`: answers a client will not read, rapid reset (CVE-2023-44487's
pattern), CONTINUATION floods, calls whose message never comes, TLS connections beyond the bound.
Each attack must leave the server's memory within 300 MB of its idle figure (and give it back when
the attacker leaves) while other clients are served. Loopback only; bounded in count and time. The
figures they print are in docs/reliability.md."""
import os
import socket
import ssl
import struct
import subprocess
import threading
import time

import numpy as np
import pytest

from quern_testing import rss_mb, sanitized, start_quern, stop_quern, wait_until

QUERN = os.environ["QUERN_BIN"]

INFER = "/inference.GRPCInferenceService/ModelInfer"
LIVE = "/inference.GRPCInferenceService/ServerLive"


def write_spread(repo):
    """spread: y[1, 524288] = x[1, 1] repeated (Tile): a 4-byte input, a 2 MiB answer."""
    import onnx
    from onnx import TensorProto, helper
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 524288])
    reps = helper.make_tensor("reps", TensorProto.INT64, [2], [1, 524288])
    graph = helper.make_graph([helper.make_node("Tile", ["x", "reps"], ["y"])], "spread", [x], [y],
                              initializer=[reps])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    os.makedirs(repo / "spread" / "1", exist_ok=True)
    onnx.save(model, str(repo / "spread" / "1" / "model.onnx"))
    (repo / "spread" / "config.pbtxt").write_text(
        'backend: "onnxruntime"\nmax_batch_size: 0\n'
        'input [ { name: "x" data_type: TYPE_FP32 dims: [ 1, 1 ] } ]\n'
        'output [ { name: "y" data_type: TYPE_FP32 dims: [ 1, 524288 ] } ]\n')


def infer_message(model, value=1.0):
    """A serialized ModelInferRequest for `model` with one [1, 1] FP32 input x."""
    from tritonclient.grpc import service_pb2
    m = service_pb2.ModelInferRequest(model_name=model)
    m.inputs.add(name="x", datatype="FP32", shape=[1, 1])
    m.raw_input_contents.append(np.array([[value]], np.float32).tobytes())
    return m.SerializeToString()


def grpc_frame(message):
    return b"\x00" + struct.pack(">I", len(message)) + message


def call_headers(path, port):
    return [(":method", "POST"), (":scheme", "http"), (":path", path), (":authority", f"127.0.0.1:{port}"),
            ("content-type", "application/grpc"), ("te", "trailers")]


class H2Client:
    """One HTTP/2 connection driven by hand (h2), with a thread that reads what the server sends
    (so the socket drains) and records stream ends, resets and GOAWAY."""

    def __init__(self, port, window=None, source="127.0.0.1", tls_context=None, hello_after=0.0):
        import h2.config
        import h2.connection
        import h2.settings
        sock = socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0))
        time.sleep(hello_after)  # (a client on a slow link: its TLS hello comes late)
        if tls_context:
            sock = tls_context.wrap_socket(sock, server_hostname="localhost")
        self.sock = sock
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        if window is not None:
            self.conn.local_settings = h2.settings.Settings(
                client=True, initial_values={h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window})
        self.conn.initiate_connection()
        self.lock = threading.Lock()
        self.ended = {}  # stream id -> grpc-status (str) or "reset"
        self.goaway = None
        self.error = None
        self.closed = threading.Event()
        self.pinged = threading.Event()
        self.flush()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def flush(self):
        with self.lock:
            data = self.conn.data_to_send()
        if data:
            self.sock.sendall(data)

    def _read(self):
        import h2.events
        try:
            while True:
                try:
                    data = self.sock.recv(65536)
                except TimeoutError:  # the server silent for the socket's timeout: still open
                    continue
                if not data:
                    break
                with self.lock:
                    try:
                        events = self.conn.receive_data(data)
                    except Exception as e:  # noqa: BLE001 -- the server broke the protocol or closed: the test looks
                        self.error = e
                        break
                    for e in events:
                        if isinstance(e, h2.events.TrailersReceived) or (
                                isinstance(e, h2.events.ResponseReceived) and
                                any(k == "grpc-status" for k, _ in e.headers)):
                            headers = dict(e.headers)
                            self.ended[e.stream_id] = headers.get("grpc-status")
                        elif isinstance(e, h2.events.StreamReset):
                            self.ended.setdefault(e.stream_id, "reset")
                        elif isinstance(e, h2.events.ConnectionTerminated):
                            self.goaway = e.error_code
                        elif isinstance(e, h2.events.PingAckReceived):
                            self.pinged.set()
                    out = self.conn.data_to_send()
                if out:
                    self.sock.sendall(out)
        except OSError:
            pass
        self.closed.set()

    def call(self, path, port, message=None, end=True):
        """Opens a call; sends `message` (framed) when given; returns its stream id."""
        with self.lock:
            sid = self.conn.get_next_available_stream_id()
            self.conn.send_headers(sid, call_headers(path, port), end_stream=message is None and end)
            if message is not None:
                self.conn.send_data(sid, grpc_frame(message), end_stream=end)
        self.flush()
        return sid

    def ping(self, timeout=15):
        """PING, and its ACK awaited: the server has read every frame sent before it."""
        self.pinged.clear()
        with self.lock:
            self.conn.ping(b"12345678")
        self.flush()
        assert self.pinged.wait(timeout), "no PING ACK"

    def reset(self, sid):
        with self.lock:
            self.conn.reset_stream(sid)
        self.flush()

    def close(self):
        try:
            self.sock.close()
        except OSError:
            pass


def grpc_live(port, timeout=5):
    """ServerLive over a new channel from a real gRPC client: True, or the error."""
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        try:
            return service_pb2_grpc.GRPCInferenceServiceStub(ch).ServerLive(service_pb2.ServerLiveRequest(),
                                                                            timeout=timeout).live
        except grpc.RpcError as e:
            return e


@pytest.fixture
def spread_server(tmp_path):
    if sanitized(QUERN):
        pytest.skip("AddressSanitizer's quarantine holds freed memory: resident memory says little")
    repo = tmp_path / "repo"
    write_spread(repo)
    proc, ports = start_quern(QUERN, str(repo), "--grpc-write-timeout-secs", "8")
    yield proc, ports
    proc.terminate()
    proc.wait(timeout=30)


def test_answers_a_client_never_reads_are_bounded_and_freed(spread_server):
    """Issue: a client whose HTTP/2 window is 0 sends 1,000 small ModelInfer calls per connection on 2
    connections to a model with a 2 MiB answer: the answers piled up (RSS 44 -> 4,105 MB) and stayed
    after the connections closed. Now at most 32 MiB of answers wait per connection (the calls beyond
    get RESOURCE_EXHAUSTED, whose trailers need no window), and they go when it closes."""
    proc, ports = spread_server
    port = ports["gRPC"]
    message = infer_message("spread")
    idle = rss_mb(proc.pid)
    attackers = [H2Client(port, window=0) for _ in range(2)]
    peak = idle
    sent = 0
    stop = time.monotonic() + 60
    for a in attackers:
        mine = 0
        while mine < 1000 and time.monotonic() < stop:
            try:
                a.call(INFER, port, message)
                mine += 1
            except Exception:  # noqa: BLE001 -- h2 keeps to the server's 256 open calls: wait for answers
                time.sleep(0.05)
            peak = max(peak, rss_mb(proc.pid))
        sent += mine
    # Every call ends but those whose answers wait (at most 32 MiB of them per connection).
    wait_until(lambda: sum(len(a.ended) for a in attackers) >= sent - 2 * 20, timeout=30,
               what="the calls beyond the unread answers ended")
    peak = max(peak, rss_mb(proc.pid))
    assert grpc_live(port) is True, "a new client was not served during the attack"
    ended = sum(len(a.ended) for a in attackers)
    exhausted = sum(1 for a in attackers for v in a.ended.values() if v == "8")
    held = max(peak, rss_mb(proc.pid))
    for a in attackers:
        a.close()
    after = wait_until(lambda: rss_mb(proc.pid) < idle + 100 and rss_mb(proc.pid), timeout=20,
                       what="memory given back after the attackers closed")
    print(f"zero-window client, {sent} calls with 2 MiB answers on 2 connections: idle {idle:.0f} MB, "
          f"peak {held:.0f} MB, after close {after:.0f} MB; {ended} calls ended ({exhausted} RESOURCE_EXHAUSTED)")
    assert held < idle + 300, (idle, held)
    assert exhausted > 0, ("no call was refused for unread answers", [(a.error, a.goaway) for a in attackers])
    assert proc.poll() is None


def test_rapid_reset_ends_the_connection_and_holds_nothing(spread_server):
    """HEADERS then RST_STREAM, as fast as the client can, on 2 connections for 6 s (reconnecting
    when told to go): each connection is sent GOAWAY after a burst, memory stays within 300 MB of
    idle and gRPC health answers throughout."""
    proc, ports = spread_server
    port = ports["gRPC"]
    idle = rss_mb(proc.pid)
    stop = time.monotonic() + 6
    counts = {"streams": 0, "connections": 0, "goaway": 0}
    peak = [idle]
    lives = []

    def attacker():
        while time.monotonic() < stop:
            try:
                c = H2Client(port)
            except OSError:
                time.sleep(0.05)
                continue
            counts["connections"] += 1
            try:
                while time.monotonic() < stop and not c.closed.is_set():
                    with c.lock:
                        sid = c.conn.get_next_available_stream_id()
                        c.conn.send_headers(sid, call_headers(INFER, port))
                        c.conn.reset_stream(sid)
                    c.flush()
                    counts["streams"] += 1
            except Exception:  # noqa: BLE001 -- the server closed the connection: reconnect
                pass
            if c.goaway is not None or c.closed.wait(1):
                counts["goaway"] += c.goaway is not None
            c.close()

    def probe():
        while time.monotonic() < stop:
            peak[0] = max(peak[0], rss_mb(proc.pid))
            lives.append(grpc_live(port, timeout=5))
            time.sleep(0.2)

    threads = [threading.Thread(target=attacker) for _ in range(2)] + [threading.Thread(target=probe)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(f"rapid reset, 2 attackers for 6 s: {counts['streams']} streams on {counts['connections']} "
          f"connections, {counts['goaway']} GOAWAY; idle {idle:.0f} MB, peak {peak[0]:.0f} MB")
    assert counts["goaway"] > 0, counts
    assert peak[0] < idle + 300, (idle, peak[0])
    failed = [r for r in lives if r is not True]
    assert lives and not failed, failed[:3]
    assert proc.poll() is None


def hpack_literal(name, value):
    """One header as an HPACK literal without indexing, new name (lengths < 127)."""
    return b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value


def test_continuation_flood_closes_the_connection_at_once(spread_server):
    """8 connections each send HEADERS without END_HEADERS, then CONTINUATION frames without end:
    each is closed within a bounded number of bytes, and a real client is served meanwhile."""
    proc, ports = spread_server
    port = ports["gRPC"]
    junk = hpack_literal(b"x-junk", b"j" * 100) * 150  # 15.6 KB of header bytes per frame
    results = []

    def flood():
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")
        first = hpack_literal(b":method", b"POST") + hpack_literal(b":path", INFER.encode())
        s.sendall(struct.pack(">I", len(first))[1:] + b"\x01\x00" + struct.pack(">I", 1) + first)
        sent = 0
        frame = struct.pack(">I", len(junk))[1:] + b"\x09\x00" + struct.pack(">I", 1) + junk
        start = time.monotonic()
        try:
            while sent < 64 << 20 and time.monotonic() - start < 15:
                s.sendall(frame)
                sent += len(frame)
        except OSError:
            pass
        results.append((sent, time.monotonic() - start))
        s.close()

    threads = [threading.Thread(target=flood) for _ in range(8)]
    for t in threads:
        t.start()
    live = grpc_live(port, timeout=10)
    for t in threads:
        t.join()
    print("CONTINUATION flood, 8 connections: closed after " +
          ", ".join(f"{sent / 1024:.0f} KB in {secs:.2f} s" for sent, secs in results))
    assert live is True, live
    # The server closes a connection after a few frames: what a client can write before it sees
    # the close is in the socket buffers (a few MB at most), never the 64 MB it tried.
    assert all(sent < 16 << 20 for sent, _ in results), results


def test_calls_whose_message_never_comes_end_and_one_address_cannot_hold_every_connection(tmp_path):
    """Issue: 1,024 connections from one client, each holding one call whose message never arrives,
    denied gRPC to everyone. Now such a call ends with DEADLINE_EXCEEDED after
    --grpc-message-timeout-secs, and one address may hold half of --grpc-max-connections: a client
    at another address (127.0.0.2 is loopback too) is served while the attack holds its half."""
    repo = tmp_path / "repo"
    write_spread(repo)
    proc, ports = start_quern(QUERN, str(repo), "--grpc-max-connections", "40", "--grpc-message-timeout-secs", "3")
    port = ports["gRPC"]
    held = []
    try:
        for _ in range(60):
            try:
                c = H2Client(port, source="127.0.0.2")
                c.call(INFER, port, message=None, end=False)  # headers, no message, no end
                held.append(c)
            except OSError:
                pass
        # The server closes the ones over the bound; the client sees it when their closing arrives.
        wait_until(lambda: sum(1 for c in held if not c.closed.is_set()) <= 20, timeout=15,
                   what="at most 20 connections of one address open")
        open_ones = [c for c in held if not c.closed.is_set()]
        assert len(open_ones) <= 20, f"{len(open_ones)} connections of one address held"
        assert grpc_live(port, timeout=5) is True, "a client at another address was refused"
        # The held calls end with DEADLINE_EXCEEDED (4) once their message is late.
        wait_until(lambda: all(c.ended.get(1) == "4" for c in open_ones), timeout=15,
                   what="held calls ended with DEADLINE_EXCEEDED")
        print(f"held calls: {len(held)} connections from 127.0.0.2, {len(open_ones)} kept (bound 40, 20 per "
              f"address); each call ended DEADLINE_EXCEEDED after 3 s; 127.0.0.1 served meanwhile")
    finally:
        for c in held:
            c.close()
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.parametrize("with_calls", [3, 2])
def test_a_client_at_both_bounds_makes_room_once(tmp_path, with_calls):
    """Issue: a new connection from a client at its own bound and at the server's closed that client's
    longest idle connection, then, counting it still, looked for another to close: with one idle
    connection it found none and refused the new one too (the idle one closed for nothing); with two,
    it closed both. Bounds 4 and 4, one address: 3 (or 2) connections each with a call open, the rest
    idle; a fifth connection is served, the oldest idle one is told to go, the others stay."""
    repo = tmp_path / "repo"
    write_spread(repo)
    proc, ports = start_quern(QUERN, str(repo), "--grpc-max-connections", "4",
                              "--grpc-max-connections-per-client", "4")
    port = ports["gRPC"]
    busy, idle, clients = [], [], []
    try:
        for _ in range(with_calls):
            c = H2Client(port)
            clients.append(c)
            c.call(INFER, port, message=None, end=False)  # a call open: its message has not come
            c.ping()  # (the server has begun the call: a call not yet begun leaves its connection idle)
            busy.append(c)
        for _ in range(4 - with_calls):
            c = H2Client(port)
            clients.append(c)
            c.ping()  # (admitted and counted before the next comes)
            idle.append(c)
        new = H2Client(port)
        clients.append(new)
        try:
            sid = new.call(LIVE, port, b"")
        except OSError as e:
            raise AssertionError(f"the fifth connection was closed at once: {e!r}") from None
        wait_until(lambda: sid in new.ended or new.closed.is_set(), timeout=15, what="the fifth connection's call")
        assert new.ended.get(sid) == "0", f"the fifth connection: call {new.ended.get(sid)!r}, error {new.error!r}"
        wait_until(lambda: idle[0].goaway is not None, timeout=15, what="the oldest idle connection to be told to go")
        for c in idle[1:] + busy:  # (a GOAWAY sent them before their PING's ACK would be seen by now)
            c.ping()
        assert not any(c.closed.is_set() or c.goaway is not None for c in idle[1:] + busy), \
            [(c.closed.is_set(), c.goaway, c.ended, c.error) for c in idle[1:] + busy]
    finally:
        for c in clients:
            c.close()
        stop_quern(proc)


def make_cert(tmp_path):
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out",
                    "server.pem", "-days", "2", "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost"],
                   check=True, capture_output=True, cwd=tmp_path)
    ctx = ssl.create_default_context(cafile=str(tmp_path / "server.pem"))
    ctx.set_alpn_protocols(["h2"])
    return ctx


def test_a_tls_handshake_that_spans_the_servers_sweeps_is_served(tmp_path):
    """Issue: the server's sweep (every 250 ms) sent a connection's first bytes while its TLS handshake
    still ran, beside the handshake on the same TLS stream: the handshake was cancelled and the client's
    first call failed ("Stream removed"). Clients whose hello comes 0.6 s late, and one whose handshake is
    done at once, are each served, one after the other, each on its own connection."""
    ctx = make_cert(tmp_path)
    repo = tmp_path / "repo"
    write_spread(repo)
    proc, ports = start_quern(QUERN, str(repo), "--grpc-tls-cert-file", str(tmp_path / "server.pem"),
                              "--grpc-tls-key-file", str(tmp_path / "server.key"))
    port = ports["gRPC"]
    try:
        for late in (0.6, 0.0, 0.6, 0.6):
            c = H2Client(port, tls_context=ctx, hello_after=late)
            try:
                sid = c.call(LIVE, port, b"")
                wait_until(lambda: sid in c.ended or c.closed.is_set(), timeout=15, what="ServerLive to end")
                assert c.ended.get(sid) == "0", (f"hello {late} s late: the call ended with {c.ended.get(sid)!r}, "
                                                 f"connection closed: {c.closed.is_set()}, error: {c.error!r}")
            finally:
                c.close()
    finally:
        stop_quern(proc)


def test_tls_connections_are_counted_and_idle_ones_make_room(tmp_path):
    """Issue: --grpc-max-connections bounded plaintext only (4,300 TLS connections held). Now TLS
    connections count too: 120 idle TLS connections against a bound of 30 leave at most 30 open,
    and a real TLS client is served."""
    import tritonclient.grpc as grpcclient
    ctx = make_cert(tmp_path)
    repo = tmp_path / "repo"
    write_spread(repo)
    proc, ports = start_quern(QUERN, str(repo), "--grpc-tls-cert-file", str(tmp_path / "server.pem"),
                              "--grpc-tls-key-file", str(tmp_path / "server.key"), "--grpc-max-connections", "30",
                              "--grpc-max-connections-per-client", "30")
    port = ports["gRPC"]
    held = []
    try:
        for _ in range(120):
            try:
                held.append(H2Client(port, tls_context=ctx))
            except (OSError, ssl.SSLError):
                pass
        wait_until(lambda: sum(1 for c in held if not c.closed.is_set()) <= 30, timeout=15,
                   what="at most 30 TLS connections open")
        still_open = sum(1 for c in held if not c.closed.is_set())
        fds = len(os.listdir(f"/proc/{proc.pid}/fd"))
        c = grpcclient.InferenceServerClient(f"localhost:{port}", ssl=True,
                                             root_certificates=str(tmp_path / "server.pem"))
        assert c.is_server_live(client_timeout=10)
        print(f"120 idle TLS connections against --grpc-max-connections 30: {still_open} open, "
              f"server holds {fds} descriptors; a TLS client served")
        assert still_open <= 30, still_open
    finally:
        for h in held:
            h.close()
        proc.terminate()
        proc.wait(timeout=30)
