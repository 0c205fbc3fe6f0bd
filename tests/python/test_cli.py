"""The command line as people expect it: `quern --version` states CMakeLists.txt's project version,
`quern serve --help` shows each option's default, and `quern infer REPO MODEL` loads only that model
(and the models an ensemble runs), not the whole repository."""
import os
import re
import shutil
import subprocess

import numpy as np

QUERN = os.environ["QUERN_BIN"]
MODELS = os.environ["QUERN_TEST_MODELS"]
ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def run(*args, timeout=60):
    return subprocess.run([QUERN, *args], capture_output=True, text=True, timeout=timeout)


def test_version_is_the_projects():
    with open(os.path.join(ROOT, "CMakeLists.txt")) as f:
        want = re.search(r"project\(quern VERSION ([0-9.]+)", f.read()).group(1)
    r = run("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"quern {want}", r


def test_serve_help_shows_the_defaults():
    r = run("serve", "--help")
    assert r.returncode == 0, r
    for flag, default in (("--http-port", "8000"), ("--grpc-port", "8001"), ("--metrics-port", "8002"),
                          ("--max-queue-wait-ms", "5000"), ("--host", "0.0.0.0")):
        line = next((l for l in r.stdout.splitlines() if l.strip().startswith(flag + " ")), "")
        assert re.search(r"=" + re.escape(default) + r"(\s|$)", line), (flag, line)


MARKER_MODEL = '''
import os


class TritonPythonModel:
    def initialize(self, args):
        open(os.environ["QUERN_TEST_MARKER"], "w").close()

    def execute(self, requests):
        return []
'''


def test_infer_loads_only_the_model_it_runs(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copytree(os.path.join(MODELS, "add_sub"), repo / "add_sub")
    # A Python model that leaves a file behind when it is loaded.
    (repo / "marker" / "1").mkdir(parents=True)
    (repo / "marker" / "1" / "model.py").write_text(MARKER_MODEL)
    (repo / "marker" / "config.pbtxt").write_text('''name: "marker"
backend: "python"
max_batch_size: 0
input [ { name: "x" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 1 ] } ]
''')
    # An ensemble of add_sub: its step is loaded with it.
    (repo / "twice" / "1").mkdir(parents=True)
    (repo / "twice" / "config.pbtxt").write_text('''name: "twice"
platform: "ensemble"
max_batch_size: 8
input [ { name: "A" data_type: TYPE_FP32 dims: [ 4 ] }, { name: "B" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "SUM" data_type: TYPE_FP32 dims: [ 4 ] } ]
ensemble_scheduling { step [ { model_name: "add_sub" model_version: -1
  input_map { key: "INPUT0" value: "A" } input_map { key: "INPUT1" value: "B" }
  output_map { key: "OUTPUT0" value: "SUM" } } ] }
''')
    a = np.arange(4, dtype=np.float32)[None]
    np.save(tmp_path / "a.npy", a)
    marker = tmp_path / "loaded"
    env = dict(os.environ, QUERN_TEST_MARKER=str(marker))
    for model, inputs, out in (("add_sub", ["INPUT0=" + str(tmp_path / "a.npy"), "INPUT1=zeros"], "OUTPUT0"),
                               ("twice", ["A=" + str(tmp_path / "a.npy"), "B=" + str(tmp_path / "a.npy")], "SUM")):
        args = [QUERN, "infer", str(repo), model]
        for i in inputs:
            args += ["--input", i]
        r = subprocess.run(args, capture_output=True, text=True, timeout=60, env=env)
        assert r.returncode == 0, r
        want = a * (2 if model == "twice" else 1)
        line = next(l for l in r.stdout.splitlines() if l.startswith(out + " "))
        got = [float(v) for v in line.split(":", 1)[1].split()]
        assert got == want.ravel().tolist(), (line, want)
        assert not marker.exists(), f"quern infer {model} loaded the Python model 'marker' too"
    # The marker model itself, asked for, is loaded (the test's marker works).
    r = subprocess.run([QUERN, "infer", str(repo), "marker", "--input", "x=zeros"], capture_output=True, text=True,
                       timeout=60, env=env)
    assert marker.exists(), r


def start_lines(tmp_path, *flags, env=None):
    """The lines `quern serve` prints up to "serving ...", for add_sub with `flags`."""
    from quern_testing import start_quern
    repo = tmp_path / "repo"
    if not repo.exists():
        repo.mkdir()
        shutil.copytree(os.path.join(MODELS, "add_sub"), repo / "add_sub")
    log = []
    proc, _ = start_quern(QUERN, str(repo), *flags, env=env, log=log)
    try:
        import time
        deadline = time.time() + 10
        while not any("serving " in line for line in log) and time.time() < deadline:
            time.sleep(0.05)
        return [line.strip() for line in log]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_serve_says_who_may_call_whether_the_wire_is_encrypted_and_where_jobs_go(tmp_path):
    plain = start_lines(tmp_path)
    for want in ("API keys: none; every request is served without one", "TLS: off; plaintext on every port",
                 "jobs: kept in this process's memory (lost if it stops)", "models: 1 ready"):
        assert any(want in line for line in plain), (want, plain)
    from test_security import make_certificates
    make_certificates(tmp_path)
    env = dict(os.environ, QUERN_API_KEYS="user-key-1,user-key-2", QUERN_ADMIN_KEYS="admin-key-1")
    closed = start_lines(tmp_path, "--api-key-rate-limit", "5", "--tls-cert-file", str(tmp_path / "server.pem"),
                         "--tls-key-file", str(tmp_path / "server.key"), "--tls-client-ca-file",
                         str(tmp_path / "ca.pem"), env=env)
    for want in ("API keys: 3 (1 admin); every request needs one, at most 5/s per key",
                 "TLS: on for HTTP and gRPC, client certificates required"):
        assert any(want in line for line in closed), (want, closed)


def test_the_tls_line_names_grpc_alone_when_only_grpc_has_tls(tmp_path):
    from test_security import make_certificates
    make_certificates(tmp_path)
    lines = start_lines(tmp_path, "--grpc-tls-cert-file", str(tmp_path / "server.pem"), "--grpc-tls-key-file",
                        str(tmp_path / "server.key"), "--grpc-tls-client-ca-file", str(tmp_path / "ca.pem"))
    assert any("TLS: on for gRPC, client certificates required on gRPC" in line for line in lines), lines
