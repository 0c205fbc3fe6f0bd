"""packaging/kubernetes/ as it is written: every resource validates against the Kubernetes schemas
(1.30 and 1.37) or KServe's CRD schema (scripts/validate_k8s.py), the validator refuses unknown
fields and wrong types (a schema check: names, selectors and the like are checked below, by
running the manifests' commands and comparing their parts), and each container runs as its manifest says: its arguments are flags `quern serve`
takes, its probes answer where they point (with API keys set, as the Secret would set them), the
Service's and the metrics annotation's ports are ones Quern listens on, and SIGTERM drains within
the pod's grace period. No cluster: the container's command runs here, its ports mapped to free
ones."""
import copy
import json
import os
import pathlib
import re
import signal
import shutil
import subprocess
import sys
import threading
import time

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from quern_testing import free_port, http_request, wait_until

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import validate_k8s  # noqa: E402

QUERN = os.environ["QUERN_BIN"]
MODELS = os.environ["QUERN_TEST_MODELS"]
KEY = "k8s-test-key"


def resources():
    out = {}
    for path in validate_k8s.manifest_files():
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                out[(doc["kind"], doc["metadata"]["name"])] = doc
    return out


def test_every_manifest_validates_against_its_schema():
    assert (validate_k8s.CRD_DIR / "serving.kserve.io_servingruntimes.yaml").is_file(), "run scripts/setup.sh"
    kinds = {kind for kind, _ in resources()}
    assert {"Deployment", "Service", "PodDisruptionBudget", "ServingRuntime", "InferenceService"} <= kinds, kinds
    assert validate_k8s.validate_files(validate_k8s.manifest_files()) == []


@pytest.mark.parametrize("kind,mutate,expect", [
    ("Deployment", lambda d: d["spec"]["template"]["spec"]["containers"][0].update(readinesProbe={}), "readinesProbe"),
    ("Deployment", lambda d: d["spec"]["template"]["spec"]["containers"][0]["ports"][0].update(containerPort="http"),
     "containerPort"),
    ("PodDisruptionBudget", lambda d: d["spec"].update(maxUnavailable=[1]), "maxUnavailable"),
    ("Service", lambda d: d["spec"]["ports"][1].update(appProtocl="h2c"), "appProtocl"),
    ("ServingRuntime", lambda d: d["spec"].update(protocolVersion=["v2"]), "protocolVersion"),
    ("ServingRuntime", lambda d: d["spec"]["containers"][0].update(args="serve"), "args"),
    ("InferenceService", lambda d: d["spec"]["predictor"]["model"].update(runtimee="quern"), "runtimee"),
])
def test_the_validator_refuses_unknown_fields_and_wrong_types(kind, mutate, expect):
    doc = copy.deepcopy(next(d for (k, _), d in resources().items() if k == kind))
    mutate(doc)
    found = validate_k8s.problems(doc, validate_k8s.crd_schemas())
    assert any(expect in p for p in found), found


def test_an_unknown_kind_is_an_error_not_a_skip():
    doc = {"apiVersion": "serving.kserve.io/v1alpha1", "kind": "ServingRuntimez", "metadata": {"name": "x"}}
    assert validate_k8s.problems(doc, validate_k8s.crd_schemas())
    doc = {"apiVersion": "apps/v1", "kind": "Deploymentz", "metadata": {"name": "x"}}
    assert validate_k8s.problems(doc, validate_k8s.crd_schemas())


class Container:
    """A manifest's container run here: `quern serve` with the manifest's arguments, the model
    repository path replaced by a test repository and each port by a free one."""

    def __init__(self, spec, repo_flag_value, repo, env=None):
        self.ports = {}  # manifest port -> the port used here
        args = []
        for a in spec["args"]:
            m = re.fullmatch(r"(--[a-z-]+-port)=(\d+)", a)
            if m:
                self.ports[int(m.group(2))] = free_port()
                a = f"{m.group(1)}={self.ports[int(m.group(2))]}"
            elif a == f"--model-repository={repo_flag_value}":
                a = f"--model-repository={repo}"
            elif a.startswith("--host="):
                # A pod is reached on its own address: the manifest must listen on every interface.
                assert a == "--host=0.0.0.0", a
                a = "--host=127.0.0.1"
            args.append(a)
        assert args[0] == "serve", args
        self.named = {p["name"]: p["containerPort"] for p in spec.get("ports", [])}
        self.log = []
        self.proc = subprocess.Popen([QUERN, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, **(env or {})})
        threading.Thread(target=lambda: [self.log.append(line) for line in self.proc.stdout], daemon=True).start()

    def port(self, p):
        """The port used here for a probe's port (a number or a containerPort's name)."""
        return self.ports[self.named[p] if isinstance(p, str) else p]

    def probe(self, probe):
        """True when the probe would succeed now."""
        try:
            if "grpc" in probe:
                with grpc.insecure_channel(f"127.0.0.1:{self.port(probe['grpc']['port'])}") as ch:
                    r = health_pb2_grpc.HealthStub(ch).Check(
                        health_pb2.HealthCheckRequest(service=probe["grpc"].get("service", "")), timeout=2)
                return r.status == health_pb2.HealthCheckResponse.SERVING
            get = probe["httpGet"]
            status, _, _ = http_request(self.port(get["port"]), "GET", get["path"], timeout=2)
            return 200 <= status < 400
        except (OSError, grpc.RpcError):
            return False

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


@pytest.fixture()
def repo(tmp_path):
    r = tmp_path / "models"
    r.mkdir()
    shutil.copytree(os.path.join(MODELS, "add_sub"), r / "add_sub")
    return r


def test_the_deployment_runs_as_written(repo):
    docs = resources()
    deploy = docs[("Deployment", "quern")]
    pod = deploy["spec"]["template"]["spec"]
    spec = pod["containers"][0]
    mount = next(m["mountPath"] for m in spec["volumeMounts"] if m["name"] == "models")
    # The keys come from the Secret as QUERN_API_KEYS: the probes must not need one.
    env_keys = next(e for e in spec["env"] if e["name"] == "QUERN_API_KEYS")
    assert env_keys["valueFrom"]["secretKeyRef"]["optional"] is True
    c = Container(spec, mount, repo, env={"QUERN_API_KEYS": KEY})
    try:
        wait_until(lambda: c.probe(spec["startupProbe"]), timeout=60, what="the startup probe")
        assert c.probe(spec["readinessProbe"]) and c.probe(spec["livenessProbe"])
        # Keys are on: a model route without one is refused, with one it answers.
        http = c.port("http")
        assert http_request(http, "GET", "/v2/models/add_sub/ready")[0] == 401
        assert http_request(http, "GET", "/v2/models/add_sub/ready",
                            headers={"Authorization": f"Bearer {KEY}"})[0] == 200
        # The Service's target ports are the container's, and each is one Quern listens on.
        service = docs[("Service", "quern")]
        assert service["spec"]["selector"] == deploy["spec"]["selector"]["matchLabels"]
        assert deploy["spec"]["selector"]["matchLabels"].items() <= pod_labels(deploy).items()
        for name in c.named:
            assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name) and len(name) <= 15, name
        assert service["spec"]["selector"].items() <= pod_labels(deploy).items()
        for p in service["spec"]["ports"]:
            assert c.port(p["targetPort"]) and p["port"] == c.named[p["targetPort"]]
        grpc_port = next(p for p in service["spec"]["ports"] if p["name"] == "grpc")
        assert c.named["grpc"] in c.ports
        with grpc.insecure_channel(f"127.0.0.1:{c.port(grpc_port['targetPort'])}") as ch:
            grpc.channel_ready_future(ch).result(timeout=5)
        # Prometheus scrapes the annotated port and path.
        ann = deploy["spec"]["template"]["metadata"]["annotations"]
        status, _, body = http_request(c.ports[int(ann["prometheus.io/port"])], "GET", ann["prometheus.io/path"])
        assert status == 200 and b"quern_" in body
        # The PodDisruptionBudget selects these pods.
        pdb = docs[("PodDisruptionBudget", "quern")]
        assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels(deploy).items()
        # SIGTERM after the preStop pause: not ready at once, gone within the grace period.
        pre_stop = spec["lifecycle"]["preStop"]["exec"]["command"]
        assert pre_stop[0] == "sleep"
        drain = float(next(a.split("=")[1] for a in spec["args"] if a.startswith("--drain-timeout-secs=")))
        grace = pod["terminationGracePeriodSeconds"]
        assert int(pre_stop[1]) + drain < grace, "the drain must end before the kubelet's SIGKILL"
        began = time.time()
        c.proc.send_signal(signal.SIGTERM)
        wait_until(lambda: not c.probe(spec["readinessProbe"]), timeout=5, what="not ready after SIGTERM")
        c.proc.wait(timeout=grace - int(pre_stop[1]))
        assert time.time() - began < grace - int(pre_stop[1])
        assert c.proc.returncode == 0, "".join(c.log)[-2000:]
    finally:
        c.stop()


def pod_labels(deploy):
    return deploy["spec"]["template"]["metadata"]["labels"]


def test_the_kserve_serving_runtime_runs_as_written(repo):
    runtime = resources()[("ServingRuntime", "quern")]
    spec = runtime["spec"]["containers"][0]
    assert spec["name"] == "kserve-container"  # the name KServe looks for
    # KServe's storage initializer writes the model repository to /mnt/models; KServe sends HTTP to
    # 8080 and gRPC (grpc-v2) to the container's gRPC port.
    c = Container(spec, "/mnt/models", repo)
    try:
        assert 8080 in c.ports, "KServe sends the Open Inference Protocol's HTTP to port 8080"
        wait_until(lambda: c.probe(spec["readinessProbe"]), timeout=60, what="the readiness probe")
        body = json.dumps({"inputs": [
            {"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]},
            {"name": "INPUT1", "shape": [1, 4], "datatype": "FP32", "data": [10, 20, 30, 40]}]}).encode()
        status, _, out = http_request(c.ports[8080], "POST", "/v2/models/add_sub/infer", body)
        assert status == 200, out
        outputs = {o["name"]: o["data"] for o in json.loads(out)["outputs"]}
        assert outputs["OUTPUT0"] == [11, 22, 33, 44] and outputs["OUTPUT1"] == [-9, -18, -27, -36]
        grpc_ports = [p for p in c.ports if p != 8080 and p != int(runtime["spec"]["annotations"]["prometheus.kserve.io/port"])]
        assert len(grpc_ports) == 1 and "grpc-v2" in runtime["spec"]["protocolVersions"]
        with grpc.insecure_channel(f"127.0.0.1:{c.ports[grpc_ports[0]]}") as ch:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert r.status == health_pb2.HealthCheckResponse.SERVING
        ann = runtime["spec"]["annotations"]
        status, _, _ = http_request(c.ports[int(ann["prometheus.kserve.io/port"])], "GET", ann["prometheus.kserve.io/path"])
        assert status == 200
        # The InferenceService example names this runtime and a format it declares.
        isvc = resources()[("InferenceService", "quern-objects")]
        model = isvc["spec"]["predictor"]["model"]
        assert model["runtime"] == runtime["metadata"]["name"]
        assert model["modelFormat"]["name"] in {f["name"] for f in runtime["spec"]["supportedModelFormats"]}
    finally:
        c.stop()
