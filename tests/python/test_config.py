"""`quern serve --config FILE`: the same settings as the flags, from a TOML file; flags given on the
command line override it; a key that is not a setting, a value of the wrong kind and a file that does
not parse are refused with the file, the line and the key."""
import json
import os
import re
import shutil
import subprocess
import time

import pytest

from quern_testing import free_port, http_request

QUERN = os.environ["QUERN_BIN"]
MODELS = os.environ["QUERN_TEST_MODELS"]


@pytest.fixture
def repo(tmp_path):
    r = tmp_path / "repo"
    r.mkdir()
    shutil.copytree(os.path.join(MODELS, "add_sub"), r / "add_sub")
    return r


def serve(config, *flags):
    """Starts quern with --config and flags; returns (process, {"HTTP": port, ...}) once it serves."""
    proc = subprocess.Popen([QUERN, "serve", "--config", str(config), *flags], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    ports = {}
    deadline = time.time() + 60
    log = []
    while time.time() < deadline:
        line = proc.stdout.readline()
        log.append(line)
        if not line or line.startswith("quern: serving "):
            break
        m = re.search(r"(HTTP|gRPC|metrics|vision) listening on [^:]+:(\d+)", line)
        if m:
            ports[m.group(1)] = int(m.group(2))
    if "HTTP" not in ports:
        proc.kill()
        raise AssertionError("quern did not start:\n" + "".join(log))
    return proc, ports


def refused(config, *flags):
    """Runs quern serve with a configuration it must refuse: (exit code, output)."""
    out = subprocess.run([QUERN, "serve", "--config", str(config), *flags], capture_output=True, text=True,
                         timeout=60)
    return out.returncode, out.stdout + out.stderr


def stop(proc):
    proc.terminate()
    assert proc.wait(timeout=30) == 0


def test_a_file_sets_what_the_flags_set(repo, tmp_path):
    http, metrics = free_port(), free_port()
    config = tmp_path / "quern.toml"
    config.write_text(f"""# quern serve settings
model-repository = "{repo}"
host = "127.0.0.1"
http-port = {http}
grpc-port = -1            # no gRPC
metrics-port = {metrics}
max-queue-wait-ms = 1500
allow-links-outside-repository = false
""")
    proc, ports = serve(config)
    try:
        assert ports == {"HTTP": http, "metrics": metrics}, "no gRPC listener, ports from the file"
        status, _, body = http_request(http, "GET", "/v2/health/ready")
        assert status == 200 and json.loads(body) == {"ready": True}
    finally:
        stop(proc)


def test_flags_on_the_command_line_override_the_file(repo, tmp_path):
    from_file, from_flag = free_port(), free_port()
    config = tmp_path / "quern.toml"
    config.write_text(f'model-repository = "{repo}"\nhost = "127.0.0.1"\nhttp-port = {from_file}\n'
                      'grpc-port = -1\nmetrics-port = 0\n')
    proc, ports = serve(config, "--http-port", str(from_flag))
    try:
        assert ports["HTTP"] == from_flag
        assert http_request(from_flag, "GET", "/v2/health/live")[0] == 200
        with pytest.raises(OSError):
            http_request(from_file, "GET", "/v2/health/live", timeout=2)
    finally:
        stop(proc)


def test_an_unknown_key_names_the_file_and_line(repo, tmp_path):
    config = tmp_path / "quern.toml"
    config.write_text(f'model-repository = "{repo}"\n\nhtp-port = 8000\n')
    code, out = refused(config)
    assert code == 2, out
    assert f"{config}:3: 'htp-port' is not a setting of quern serve" in out, out


def test_a_value_of_the_wrong_kind_names_the_file_and_line(repo, tmp_path):
    config = tmp_path / "quern.toml"
    config.write_text(f'model-repository = "{repo}"\nhttp-port = "eighty"\n')
    code, out = refused(config)
    assert code == 2, out
    assert f"{config}:2: 'http-port' takes a number" in out, out

    config.write_text(f'model-repository = "{repo}"\nconsume = "yes"\n')
    code, out = refused(config)
    assert code == 2, out
    assert f"{config}:2: 'consume' is a switch: give true or false" in out, out

    config.write_text(f'model-repository = "{repo}"\nhttp-port = [1, 2]\n')
    code, out = refused(config)
    assert code == 2, out
    assert f"{config}:2: 'http-port' takes one value, not a list" in out, out

    config.write_text(f'model-repository = "{repo}"\n[http]\nport = 1\n')
    code, out = refused(config)
    assert code == 2, out
    assert f"{config}:2: 'http'" in out, out


def test_a_file_that_does_not_parse_names_the_line(repo, tmp_path):
    config = tmp_path / "quern.toml"
    config.write_text(f'model-repository = "{repo}"\nhttp-port = = 3\n')
    code, out = refused(config)
    assert code == 2, out
    assert f"{config}:2:" in out, out

    code, out = refused(tmp_path / "missing.toml")
    assert code == 2, out
    assert "missing.toml" in out, out


def test_a_value_that_looks_like_a_flag_stays_a_value(repo, tmp_path):
    """A text value is the option's value, whatever it begins with: a key file named "--metrics-need-key"
    must not turn into that switch (and leave --api-keys without its file)."""
    keys = tmp_path / "--metrics-need-key"
    keys.write_text("a-key-of-at-least-sixteen-chars\n")
    http, metrics = free_port(), free_port()
    config = tmp_path / "quern.toml"
    config.write_text(f'model-repository = "{repo}"\nhost = "127.0.0.1"\nhttp-port = {http}\ngrpc-port = -1\n'
                      f'metrics-port = {metrics}\napi-keys = "{keys}"\n')
    # Relative to the working directory, as an operator would write it.
    config.write_text(config.read_text().replace(f'"{keys}"', '"--metrics-need-key"'))
    proc = subprocess.Popen([QUERN, "serve", "--config", str(config)], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        log = []
        for line in proc.stdout:
            log.append(line)
            if line.startswith("quern: serving"):
                break
        assert any(l.startswith("quern: serving") for l in log), "".join(log)
        assert http_request(http, "GET", "/v2/models/add_sub")[0] == 401, "the key file was read"
        assert http_request(metrics, "GET", "/metrics")[0] == 200, "metrics need no key: the switch stayed off"
    finally:
        stop(proc)

