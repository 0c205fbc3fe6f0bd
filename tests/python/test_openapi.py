"""docs/openapi.yaml against the live server.

Schemathesis (PyPI) reads the description and sends every operation generated requests — valid ones
and hostile ones (wrong types, missing fields, odd strings, huge numbers) — and checks each answer:
no 5xx, a status code and a content type the description lists for that operation, a body that
matches the documented schema, documented headers. Against a server without keys and against one
with keys (the requests carrying an admin key; Schemathesis also sends them without it and expects
a refusal). The seed is fixed so that a failure can be rerun as it happened (QUERN_OPENAPI_SEED
picks another). Beside that, the description names exactly the routes of docs/api/http.md's table
(which tests/router_test.cc holds against the server's routers), and the server serves the
description itself at GET /openapi.yaml.
"""
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
import yaml

from quern_testing import http_request, sanitized, start_quern, stop_quern

QUERN = os.environ["QUERN_BIN"]
MODELS = os.environ["QUERN_TEST_MODELS"]
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SPEC = os.path.join(ROOT, "docs", "openapi.yaml")
SEED = os.environ.get("QUERN_OPENAPI_SEED", "20261206")
# Schemathesis' runs are CPU-bound in Schemathesis itself (generating cases; the server's share is a
# twentieth), so on a busy machine a run takes several times its time on an idle one. Each run may
# take what is left of the file's time under ctest (TIMEOUT 600 in tests/CMakeLists.txt), less a
# margin to stop the server and report: a failure is then a hang, never a slow machine's queue.
DEADLINE = time.monotonic() + 560
ADMIN_KEY = "openapi-admin-key"
USER_KEY = "openapi-user-key"


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    path = tmp_path_factory.mktemp("repo")
    for name in ("add_sub", "linear", "detect_yolov8"):
        shutil.copytree(os.path.join(MODELS, name), path / name)
    return str(path)


def keyless_description(tmp_path):
    """The description of a server without keys: every route open (no security requirement)."""
    with open(SPEC, encoding="utf-8") as f:
        spec = yaml.safe_load(f)
    spec["security"] = []
    for ops in spec["paths"].values():
        for op in ops.values():
            if isinstance(op, dict):
                op.pop("security", None)
    path = tmp_path / "keyless.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return str(path)


CONFIG = os.path.join(os.path.dirname(__file__), "schemathesis.toml")
# The models' names as path parameters, so that generated requests reach the models (their inputs'
# checks, the engine, the jobs) rather than the 404 of a name the repository does not hold: add_sub
# for the model routes, the detector for the vision route that names one, and linear for loads and
# unloads, so that unloading it leaves the others' cases served. The run that names them (keyless,
# the release stage) sends no case of a strange name; the run with keys (both stages) generates them.
NAMED_MODELS = """
[[operations]]
include-path-regex = "^/v2/repository/models/"
parameters = { "path.model" = "linear" }

[[operations]]
include-path-regex = "^/v1/vision/custom/"
parameters = { "path.model" = "detect_yolov8" }

[parameters]
"path.model" = "add_sub"
"""


def named_models_config(tmp_path):
    """schemathesis.toml with the repository's models named (NAMED_MODELS)."""
    path = tmp_path / "schemathesis-named.toml"
    with open(CONFIG, encoding="utf-8") as f:
        path.write_text(f.read() + NAMED_MODELS)
    return str(path)


def schemathesis(spec, port, *extra, phases="examples,coverage,fuzzing", config=CONFIG):
    st = shutil.which("st", path=os.path.dirname(sys.executable))
    assert st, "schemathesis is not installed beside this Python (scripts/setup.sh installs it)"
    run = subprocess.run([st, "--no-color", "--config-file", config,
                          "run", spec, "--url", f"http://127.0.0.1:{port}", "--checks", "all", "--max-examples", "12",
                          "--seed", SEED, "--phases", phases, "--workers", "1",
                          "--request-timeout", "60", "--suppress-health-check", "filter_too_much", *extra],
                         capture_output=True, text=True, timeout=max(30, DEADLINE - time.monotonic()), env=dict(os.environ, QUERN_OPENAPI_KEY=ADMIN_KEY))
    assert run.returncode == 0, f"schemathesis (seed {SEED}) found:\n{run.stdout[-12000:]}\n{run.stderr[-3000:]}"


def test_every_operation_answers_as_documented_without_keys(repo, tmp_path):
    if sanitized(QUERN):
        # The same routes and server code run under the sanitizers with keys (below); the release
        # stage checks the keyless description too.
        pytest.skip("the release build checks the keyless description")
    proc, ports = start_quern(QUERN, repo, "--model-control", "explicit")
    try:
        spec = keyless_description(tmp_path)
        # The stateful phase follows the description's links: a submitted job's id to its status and
        # result, and to its cancellation, so that real job records are checked against the schema.
        schemathesis(spec, ports["HTTP"], "--exclude-path", "/metrics", config=named_models_config(tmp_path),
                     phases="examples,coverage,fuzzing,stateful")
        schemathesis(spec, ports["metrics"], "--include-path", "/metrics")  # the metrics port's one route
    finally:
        stop_quern(proc)


def test_every_operation_answers_as_documented_with_keys(repo, tmp_path):
    keys, admin = tmp_path / "keys", tmp_path / "admin"
    keys.write_text(USER_KEY + "\n")
    admin.write_text(ADMIN_KEY + "\n")
    proc, ports = start_quern(QUERN, repo, "--model-control", "explicit", "--api-keys", str(keys),
                              "--admin-keys", str(admin))
    # The coverage phase (every boundary and negative case of every schema: two thirds of a run's
    # time, spent generating them) runs once, here under the sanitizers and keyless in the release
    # stage; what keys change (refusals without one, the admin routes) the other phases send too.
    phases = "examples,coverage,fuzzing" if sanitized(QUERN) else "examples,fuzzing"
    try:
        schemathesis(SPEC, ports["HTTP"], "--exclude-path", "/metrics", phases=phases)
        schemathesis(SPEC, ports["metrics"], "--include-path", "/metrics", phases=phases)
    finally:
        stop_quern(proc)


def documented_routes():
    """(method, path) of docs/api/http.md's route table, with [/versions/{version}] spelled out."""
    rows = set()
    with open(os.path.join(ROOT, "docs", "api", "http.md"), encoding="utf-8") as f:
        for line in f:
            m = re.match(r"^\| ([A-Z, ]+) \| `([^`]+)` \| ([a-zA-Z, ]+) \| ([a-z ]+) \|$", line)
            if not m:
                continue
            path = m.group(2)
            paths = [path.replace("[/versions/{version}]", ""), path.replace("[", "").replace("]", "")]
            for method in m.group(1).split(","):
                for p in paths:
                    rows.add((method.strip(), p))
    return rows


def test_the_description_names_the_routes_of_the_route_table():
    with open(SPEC, encoding="utf-8") as f:
        spec = yaml.safe_load(f)
    described = {(method.upper(), path) for path, ops in spec["paths"].items() for method in ops
                 if method in ("get", "post", "delete", "put", "patch")}
    documented = documented_routes()
    assert len(documented) > 30
    assert described == documented, (f"only described: {sorted(described - documented)}; "
                                     f"only in the route table: {sorted(documented - described)}")


def test_the_server_serves_its_description(repo, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text(USER_KEY + "\n")
    proc, ports = start_quern(QUERN, repo, "--api-keys", str(keys))
    try:
        status, headers, body = http_request(ports["HTTP"], "GET", "/openapi.yaml")  # no key: it names no model
        assert status == 200, body
        assert headers.get("Content-Type", headers.get("content-type")) == "application/yaml"
        with open(SPEC, "rb") as f:
            assert body == f.read()
    finally:
        stop_quern(proc)
