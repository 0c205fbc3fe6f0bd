"""The OpenVINO backend (`backend: "openvino"`): every ONNX model of the examples and of the test models
served by ONNX Runtime and by OpenVINO side by side in one server, the same inputs to both, and their
outputs compared (OpenVINO at f32: within float rounding of ONNX Runtime's; the INT8 twins within
their quantization step). The default detector at OpenVINO's own precision on this CPU (bf16 where
it has AVX512_BF16 or AMX) against ONNX Runtime FP32 on the labelled photographs: the same boxes.
Bad parameters are refused at load, naming the model and the parameter."""
import io
import json
import os
import re
import shutil
import zlib

import numpy as np
import pytest
from PIL import Image

from detection_labels import LABELS, PHOTOS, iou
from quern_testing import (cpu_has_bf16, http_request, metric_sum, pin_runtime, post_form, sanitized, start_quern,
                           stop_quern)

QUERN = os.environ["QUERN_BIN"]
TEST_MODELS = os.environ["QUERN_TEST_MODELS"]
EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "models")

# (folder, model): the ONNX models served by both runtimes.
MODELS = [(TEST_MODELS, m) for m in ("add_sub", "linear", "detect_yolov8", "fixed4", "tile4", "nobatch")] + [
    (EXAMPLES, m) for m in ("objects", "objects_fast", "objects_int8", "imagenet", "imagenet_int8", "small_cnn",
                            "faces", "face_descriptor", "text_direction", "ocr_detector", "ocr_recognizer")]
if sanitized(QUERN):
    # Under the sanitizers the test models and the detector: Quern's side of every call is the same,
    # and OpenVINO and ONNX Runtime themselves are not instrumented (the release stage runs them all).
    MODELS = [(f, m) for f, m in MODELS if f == TEST_MODELS or m == "objects"]
OV = "_openvino"


def as_openvino(src, dst, name, precision=None):
    """Copies model folder `src` to `dst` as model `name` run by OpenVINO (the configuration's
    backend, platform and name replaced; a bare model gets a configuration naming the backend)."""
    shutil.copytree(src, dst)
    config = dst / "config.pbtxt"
    text = config.read_text() if config.exists() else ""
    text = re.sub(r'(?m)^\s*(backend|platform|name)\s*:.*$', "", text)
    text = f'name: "{name}"\nbackend: "openvino"\n' + text
    if precision:
        text += f'parameters {{ key: "INFERENCE_PRECISION_HINT" value {{ string_value: "{precision}" }} }}\n'
    config.write_text(text)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    for folder, m in MODELS:
        shutil.copytree(os.path.join(folder, m), repo / m)
        if (repo / m / "config.pbtxt").exists():
            pin_runtime(repo / m)  # the reference: ONNX Runtime's FP32 (the test models run under 1 ms: it serves them)
        as_openvino(os.path.join(folder, m), repo / (m + OV), m + OV, precision="f32")
    as_openvino(os.path.join(EXAMPLES, "objects"), repo / "objects_bf16", "objects_bf16")
    log = []
    proc, ports = start_quern(QUERN, str(repo), log=log, start_timeout=300)  # 36 models, most compiled twice
    yield ports, log
    stop_quern(proc)


def metadata(port, model):
    status, _, body = http_request(port, "GET", f"/v2/models/{model}")
    assert status == 200, body
    return json.loads(body)


NUMPY = {"FP32": np.float32, "FP16": np.float16, "FP64": np.float64, "INT64": np.int64, "INT32": np.int32,
         "INT8": np.int8, "UINT8": np.uint8, "BOOL": np.bool_}


def inputs_for(meta, rng):
    """One random input per tensor: the batch dimension 1, other dynamic ones 64."""
    out = []
    for t in meta["inputs"]:
        shape = [(1 if i == 0 else 64) if d == -1 else d for i, d in enumerate(t["shape"])]
        dtype = NUMPY[t["datatype"]]
        if np.issubdtype(dtype, np.floating):
            a = rng.random(shape).astype(dtype)
        elif dtype == np.bool_:
            a = rng.random(shape) < 0.5
        else:
            a = rng.integers(0, 100, shape).astype(dtype)
        out.append((t["name"], t["datatype"], a))
    return out


def infer(port, model, inputs):
    body = {"inputs": [{"name": n, "shape": list(a.shape), "datatype": d, "data": a.ravel().tolist()}
                       for n, d, a in inputs]}
    status, _, data = http_request(port, "POST", f"/v2/models/{model}/infer", json.dumps(body).encode(), timeout=120)
    assert status == 200, (model, data[:500])
    return {o["name"]: np.array(o["data"], dtype=np.float64).reshape(o["shape"]) for o in json.loads(data)["outputs"]}


@pytest.mark.parametrize("folder,model", MODELS, ids=[m for _, m in MODELS])
def test_openvino_answers_as_onnx_runtime_does(server, folder, model):
    ports, _ = server
    port = ports["HTTP"]
    meta, meta_ov = metadata(port, model), metadata(port, model + OV)
    assert meta_ov["platform"] == "openvino"
    # The configuration completed from the file alike (OpenVINO reads the same ONNX names and types).
    assert [(t["name"], t["datatype"]) for t in meta_ov["inputs"]] == [(t["name"], t["datatype"]) for t in meta["inputs"]]
    assert [(t["name"], t["datatype"]) for t in meta_ov["outputs"]] == [(t["name"], t["datatype"]) for t in meta["outputs"]]
    rng = np.random.default_rng(zlib.crc32(model.encode()))  # the same inputs every run
    inputs = inputs_for(meta, rng)
    want, got = infer(port, model, inputs), infer(port, model + OV, inputs)
    assert want.keys() == got.keys()
    # Errors relative to the output's largest value, or to 1e-3 when all are smaller (a text detector's
    # map of random noise is ~1e-7 everywhere). The INT8 twins: OpenVINO and ONNX Runtime round the
    # requantized activations each their own way, an 8-bit step here and there (on these inputs:
    # 2.3 % of the classifier's largest logit, 7.2 % of the detector's largest output; other random
    # inputs gave up to 12 %; the detector's twin made with 7-bit weights on a CPU without VNNI, 17 %).
    rtol = 0.2 if model.endswith("_int8") else 2e-3
    for name in want:
        a, b = want[name], got[name]
        assert a.shape == b.shape, (model, name, a.shape, b.shape)
        scale = max(float(np.abs(a).max()), 1e-3)
        err = float(np.abs(a - b).max()) / scale
        print(f"{model}.{name} {list(a.shape)}: max |ort - ov| / max |ort| = {err:.2e}")
        assert err <= rtol, (model, name, err)


def test_the_detector_at_openvinos_own_precision_keeps_onnx_runtimes_boxes(server):
    """OpenVINO's default precision on this CPU (bf16 with AVX512_BF16 or AMX) against ONNX Runtime
    FP32, the same file and photographs through POST /v1/vision/custom/<model>: every FP32 box at
    confidence >= 0.25 is found by the other run with the same label at IoU >= 0.9 (allowing one
    miss in a hundred), and confidences move by less than 0.05."""
    if sanitized(QUERN):
        # OpenVINO's arithmetic is not Quern's code; the route and the backend run under the
        # sanitizers in test_openvino_answers_as_onnx_runtime_does[objects].
        pytest.skip("the release stage compares OpenVINO's boxes with ONNX Runtime's")
    ports, log = server
    port = ports["HTTP"]
    said = [line for line in log if "OpenVINO compiled" in line and "model=objects_bf16" in line]
    assert said and "INFERENCE_PRECISION_HINT=" in said[0], said
    kept, total, moved = 0, 0, []
    for photo in sorted(LABELS):
        buf = io.BytesIO()
        Image.open(os.path.join(PHOTOS, photo)).convert("RGB").save(buf, "PNG")
        image = buf.getvalue()
        boxes = {}
        for model in ("objects", "objects_bf16"):
            r = post_form(port, f"/v1/vision/custom/{model}", [("image", image)], min_confidence=0.2)
            assert r["success"] is True, r
            boxes[model] = [(p["label"], p["confidence"], (p["x_min"], p["y_min"], p["x_max"], p["y_max"]))
                            for p in r["predictions"]]
        for label, conf, box in boxes["objects"]:
            if conf < 0.25:
                continue
            total += 1
            match = [c for lab, c, b in boxes["objects_bf16"] if lab == label and iou(box, b) >= 0.9]
            if match:
                kept += 1
                moved.append(abs(max(match) - conf))
    print(f"{said[0].strip()}: {kept} of {total} FP32 boxes kept at IoU >= 0.9; confidence moved by "
          f"{np.mean(moved):.4f} on average, {max(moved):.4f} at most")
    assert total >= 20, "the photographs gave too few boxes to compare"
    assert kept >= 0.99 * total, (kept, total)
    assert max(moved) < 0.05, max(moved)


@pytest.mark.parametrize("key,value,says", [
    ("NUM_STREAMS", "0", "NUM_STREAMS must be a whole number in [1, 1024]"),
    ("INFERENCE_NUM_THREADS", "two", "INFERENCE_NUM_THREADS must be a whole number"),
    ("INFERENCE_PRECISION_HINT", "int4", "INFERENCE_PRECISION_HINT must be one of f32, bf16, f16"),
    ("PERFORMANCE_HINT", "FAST", "PERFORMANCE_HINT must be one of LATENCY, THROUGHPUT"),
])
def test_bad_parameters_fail_the_load_naming_the_model(tmp_path, key, value, says):
    repo = tmp_path / "repo"
    as_openvino(os.path.join(TEST_MODELS, "add_sub"), repo / "broken", "broken")
    with open(repo / "broken" / "config.pbtxt", "a") as f:
        f.write(f'parameters {{ key: "{key}" value {{ string_value: "{value}" }} }}\n')
    shutil.copytree(os.path.join(TEST_MODELS, "add_sub"), repo / "add_sub")
    log = []
    proc, ports = start_quern(QUERN, str(repo), log=log)
    try:
        status, _, body = http_request(ports["HTTP"], "GET", "/v2/models/broken/ready")
        assert status != 200
        assert http_request(ports["HTTP"], "GET", "/v2/models/add_sub/ready")[0] == 200
    finally:
        stop_quern(proc)
    text = "".join(log)
    assert "model 'broken'" in text and says in text, text[-2000:]


def test_an_unreadable_file_is_refused_with_openvinos_reason(tmp_path):
    repo = tmp_path / "repo"
    as_openvino(os.path.join(TEST_MODELS, "add_sub"), repo / "garbage", "garbage")
    (repo / "garbage" / "1" / "model.onnx").write_bytes(b"\x08\x07 not a model at all" * 10)
    log = []
    proc, ports = start_quern(QUERN, str(repo), log=log)
    try:
        assert http_request(ports["HTTP"], "GET", "/v2/models/garbage/ready")[0] != 200
        assert proc.poll() is None
    finally:
        stop_quern(proc)
    text = "".join(log)
    assert "model 'garbage': OpenVINO cannot read" in text, text[-2000:]


def test_openvino_ir_written_by_quern_serves_as_the_onnx_file_does(tmp_path):
    """`quern openvino-ir` writes the classifier as OpenVINO IR (model.xml + model.bin, and with --f16
    its weights in half the bytes); a folder holding only the IR serves the answers ONNX Runtime
    gives for the ONNX file (f16 weights: within 3 % of the largest logit)."""
    import subprocess
    repo = tmp_path / "repo"
    shutil.copytree(os.path.join(EXAMPLES, "imagenet"), repo / "imagenet")
    pin_runtime(repo / "imagenet")
    onnx = os.path.join(EXAMPLES, "imagenet", "1", "model.onnx")
    sizes = {}
    for name, flags in (("imagenet_ir", []), ("imagenet_ir16", ["--f16"])):
        as_openvino(os.path.join(EXAMPLES, "imagenet"), repo / name, name, precision="f32")
        os.remove(repo / name / "1" / "model.onnx")
        r = subprocess.run([QUERN, "openvino-ir", onnx, str(repo / name / "1" / "model.xml"), *flags],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert sorted(os.listdir(repo / name / "1")) == ["model.bin", "model.xml"]
        sizes[name] = os.path.getsize(repo / name / "1" / "model.bin")
    assert sizes["imagenet_ir16"] < 0.6 * sizes["imagenet_ir"], sizes
    bad = subprocess.run([QUERN, "openvino-ir", str(tmp_path / "missing.onnx"), str(tmp_path / "x.xml")],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "OpenVINO cannot write" in bad.stderr, bad.stderr
    proc, ports = start_quern(QUERN, str(repo))
    try:
        port = ports["HTTP"]
        inputs = inputs_for(metadata(port, "imagenet"), np.random.default_rng(5))
        want = infer(port, "imagenet", inputs)["logits"]
        scale = float(np.abs(want).max())
        for name, rtol in (("imagenet_ir", 2e-3), ("imagenet_ir16", 3e-2)):  # f16 weights: 1.0 % measured
            got = infer(port, name, inputs)["logits"]
            err = float(np.abs(got - want).max()) / scale
            print(f"{name}: max |ort - ov| / max |ort| = {err:.2e}")
            assert err <= rtol, (name, err)
    finally:
        stop_quern(proc)


def test_an_openvino_model_runs_without_a_network_and_opens_no_socket(tmp_path):
    """No telemetry and no download at run time: `quern infer` loads and runs the detector through
    OpenVINO in a network namespace of its own (no interface at all), under strace, and no process
    of it opens an IP socket."""
    if sanitized(QUERN):
        pytest.skip("what the runtime opens is the same in every build: the release stage traces it")
    import subprocess
    repo = tmp_path / "repo"
    as_openvino(os.path.join(EXAMPLES, "objects"), repo / "objects_ov", "objects_ov")
    trace = tmp_path / "trace"
    env = dict(os.environ)
    # LeakSanitizer cannot run under ptrace (a sanitizer build's leaks are checked by the other tests).
    env["ASAN_OPTIONS"] = ":".join(filter(None, [env.get("ASAN_OPTIONS", ""), "detect_leaks=0"]))
    r = subprocess.run(["unshare", "--net", "strace", "-f", "-qq", "-e", "trace=socket,connect", "-o", str(trace),
                        QUERN, "infer", str(repo), "objects_ov", "--input", "images=random"],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-2000:])
    assert "output0" in r.stdout, r.stdout[-2000:]
    calls = trace.read_text().splitlines()
    ip = [c for c in calls if "AF_INET" in c or "AF_INET6" in c]
    assert not ip, ip[:10]


CHOSEN = re.compile(r"runtime chosen by measurement \((?:the check input(?:, not warm-up sample [^)]*)?|"
                    r"its warm-up sample '(?P<sample>[^']+)'|"
                    r"kept in (?P<kept>\S+))\): "
                    r"(?P<chosen>.*?)(?:; over (?P<over>.*))? model=(?P<model>\S+)")
# Another runtime replaces ONNX Runtime only when this much faster (src/backends/auto_backend.h).
MARGIN = 0.9


def parse_choice(line, meanings=None):
    """(chosen label, {label: (ms or None, agreement or why left out)}) from the load's log line;
    `meanings`, when given, gets each timed runtime's comparison by meaning (its boxes), if any."""
    m = CHOSEN.search(line)
    assert m, line
    table, chosen = {}, None
    for part in [m.group("chosen")] + (m.group("over").split("; ") if m.group("over") else []):
        timed = re.match(r"(.+?): ([\d.e+-]+) ms(?: \(one instance \S+ ms, every core \S+ ms\))?, "
                         r"outputs within (\S+) of ONNX Runtime's(?:, (.+))?$", part.strip())
        if timed:
            table[timed.group(1)] = (float(timed.group(2)), float(timed.group(3)))
            if meanings is not None and timed.group(4):
                meanings[timed.group(1)] = timed.group(4)
        else:
            left = re.match(r"(.+?): (.*)$", part.strip())
            assert left, part
            table[left.group(1)] = (None, left.group(2))
        chosen = chosen or next(iter(table))
    return chosen, table


@pytest.mark.parametrize("no_bf16", [False, True], ids=["this-cpu", "no-bf16"])
def test_backend_auto_keeps_the_fastest_runtime_whose_answers_agree(tmp_path, no_bf16):
    """backend "auto": ONNX Runtime, OpenVINO f32 and (where the CPU has it) OpenVINO bf16 each run a
    check input at load; the fastest whose outputs agree with ONNX Runtime's (0.1 % at f32, 5 % at bf16)
    serves, the log says which and why, the metadata names its platform. The INT8 twin's OpenVINO
    runs round differently from ONNX Runtime's (8-14 %): ONNX Runtime serves it. QUERN_NO_BF16=1
    acts as a CPU without bf16."""
    if no_bf16 and sanitized(QUERN):
        pytest.skip("the release stage runs the choice without bf16 (one flag apart from this CPU's)")
    repo = tmp_path / "repo"
    # Every kind once: the detector (bf16 chosen here), the classifier, the INT8 twin (OpenVINO left
    # out) and a tiny model; a CPU without bf16 sees the classifier's case only (the choice among the
    # f32 runtimes; the twin's is the same without bf16), and so does the sanitizer build, where
    # OpenVINO's compiles take 3-5 times as long (the twin's 40-90 s; Quern's side is the same).
    examples = ("imagenet",) if no_bf16 or sanitized(QUERN) else ("objects", "imagenet", "objects_int8")
    for m in examples:
        shutil.copytree(os.path.join(EXAMPLES, m), repo / m)
        config = repo / m / "config.pbtxt"
        config.write_text(re.sub(r'(?m)^backend\s*:.*$', 'backend: "auto"', config.read_text()))
    shutil.copytree(os.path.join(TEST_MODELS, "add_sub"), repo / "add_sub")
    (repo / "add_sub" / "config.pbtxt").write_text('backend: "auto"\n')
    env = dict(os.environ)
    if no_bf16:
        env["QUERN_NO_BF16"] = "1"
    log = []
    # A cache of its own: measured here, not read from another test's servers.
    proc, ports = start_quern(QUERN, str(repo), "--runtime-cache", str(tmp_path / "cache"), log=log, env=env,
                              start_timeout=300)
    try:
        port = ports["HTTP"]
        choices, meanings, samples = {}, {}, {}
        for line in log:
            if "runtime chosen by measurement" in line:
                assert "kept in" not in line, line
                model = CHOSEN.search(line).group("model")
                meanings[model] = {}
                chosen, table = parse_choice(line, meanings[model])
                choices[model] = (chosen, table)
                samples[model] = CHOSEN.search(line).group("sample")
        assert set(choices) == set(examples) | {"add_sub"}, "".join(log)
        # The detector is checked on its warm-up sample (dog.jpg, examples/models/objects/config.pbtxt),
        # and every other runtime measured against ONNX Runtime on it by its boxes too: the dog, the
        # bicycle and the car of the photograph, the same at IoU >= 0.9.
        if "objects" in examples:
            assert samples["objects"] == "dog", samples
            compared = {k for k, (ms, _) in choices["objects"][1].items() if ms is not None and k != "onnxruntime"}
            assert compared and compared == meanings["objects"].keys(), (choices["objects"], meanings["objects"])
            for label, said in meanings["objects"].items():
                found = re.match(r"its (\d+) boxes at IoU >= 0\.9 \((.+)\)$", said)
                assert found and {"dog", "bicycle"} <= set(found.group(2).split(", ")), (label, said)
        assert all(s is None for m, s in samples.items() if m != "objects"), samples
        for model, (chosen, table) in choices.items():
            print(model, chosen, table)
            # bf16 is measured where the CPU has it (/proc/cpuinfo's flags), and not where told not to.
            assert ("openvino bf16" in table) == (cpu_has_bf16() and not no_bf16), (model, table)
            assert {"onnxruntime", "openvino f32"} <= table.keys(), (model, table)
            ms, _ = table[chosen]
            assert ms is not None, (model, table)
            # The fastest of those that agree, but for a margin that keeps ONNX Runtime where another
            # is as fast; a model whose ONNX Runtime run is under 1 ms is not measured further.
            assert all(t is None or t >= MARGIN * ms for t, _ in table.values()), (model, table)
            if table["onnxruntime"][0] < 1:
                assert chosen == "onnxruntime" and all("under 1 ms" in str(table[k][1]) for k in table
                                                       if k != "onnxruntime"), (model, table)
            meta = metadata(port, model)
            assert meta["platform"] == ("openvino" if chosen.startswith("openvino") else "onnxruntime_onnx"), meta
            # /metrics says it too.
            assert metric_sum(ports["metrics"], "quern_model_runtime", model=model, runtime=chosen) == 1, model
        # OpenVINO's INT8 arithmetic is not ONNX Runtime's: left out, saying so.
        if "objects_int8" in examples:
            _, int8 = choices["objects_int8"]
            assert choices["objects_int8"][0] == "onnxruntime", int8
            assert all("outputs differ from ONNX Runtime's" in str(note) for label, (t, note) in int8.items()
                       if label.startswith("openvino")), int8
        # Whatever serves answers as FP32 does, within the tolerance its precision was chosen by.
        ort = infer(port, "add_sub", [("INPUT0", "FP32", np.ones((1, 4), np.float32)),
                                      ("INPUT1", "FP32", np.full((1, 4), 2, np.float32))])
        assert ort["OUTPUT0"].tolist() == [[3, 3, 3, 3]] and ort["OUTPUT1"].tolist() == [[-1, -1, -1, -1]], ort
        if "objects" in examples:
            r = post_form(port, "/v1/vision/custom/objects",
                          [("image", open(os.path.join(PHOTOS, "dog.jpg"), "rb").read())], min_confidence=0.5)
            assert r["success"] is True and {"dog", "bicycle"} <= {p["label"] for p in r["predictions"]}, r
    finally:
        stop_quern(proc)


def test_quern_tune_prints_the_measured_choice(tmp_path):
    """`quern tune MODEL_DIR` loads the folder as backend "auto" would (whatever its configuration
    names) and logs the table and the choice; a folder without a model.onnx is refused."""
    import subprocess
    env = dict(os.environ)
    if sanitized(QUERN):
        # LeakSanitizer's tracer can fault stopping OpenVINO's TBB workers at exit ("Tracer caught
        # signal 11", its own failure, not a leak found): this exit code is checked, a server's is not.
        env["LSAN_OPTIONS"] = env.get("LSAN_OPTIONS", "") + ":detect_leaks=0"
    r = subprocess.run([QUERN, "tune", os.path.join(EXAMPLES, "imagenet")], capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    line = next(line for line in (r.stdout + r.stderr).splitlines() if "runtime chosen by measurement" in line)
    chosen, table = parse_choice(line)
    assert {"onnxruntime", "openvino f32"} <= table.keys() and table[chosen][0] is not None, table
    bad = subprocess.run([QUERN, "tune", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "has no <version>/model.onnx" in bad.stderr, bad.stderr


def lookup_model():
    """An ONNX model whose input `ids` [N, 4] (INT64) indexes a table of three rows [[1, 2], [3, 4],
    [5, 6]]: `rows` [N, 4, 2]."""
    from onnx import TensorProto, helper
    table = helper.make_tensor("table", TensorProto.FLOAT, [3, 2], [1, 2, 3, 4, 5, 6])
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "ids"], ["rows"], axis=0)], "lookup",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [-1, 4])],
        [helper.make_tensor_value_info("rows", TensorProto.FLOAT, [-1, 4, 2])], [table])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model


def serve_alone(tmp_path, name, model, config):
    """A server of one ONNX model `model` (an onnx ModelProto) with `config`: (process, ports, the
    load's "runtime chosen by measurement" line)."""
    import onnx
    repo = tmp_path / "repo"
    (repo / name / "1").mkdir(parents=True)
    onnx.save(model, str(repo / name / "1" / "model.onnx"))
    (repo / name / "config.pbtxt").write_text(config)
    log = []
    proc, ports = start_quern(QUERN, str(repo), log=log, start_timeout=120)
    line = next((line for line in log if "runtime chosen by measurement" in line), None)
    if line is None:
        stop_quern(proc)
        raise AssertionError("no runtime chosen in the log: " + "".join(log))
    return proc, ports, line


def test_a_model_the_check_input_does_not_suit_is_served_by_onnx_runtime(tmp_path):
    """A model whose input is an index into a table of three rows: the made-up check input (whole
    numbers 0-9) is out of range, so there is nothing to measure on; the model loads anyway, on ONNX
    Runtime, the log saying why, and answers its own requests."""
    proc, ports, line = serve_alone(tmp_path, "lookup", lookup_model(), 'backend: "auto"\nmax_batch_size: 4\n')
    try:
        chosen, table_ = parse_choice(line)
        assert chosen == "onnxruntime" and "served without a measurement" in str(table_["onnxruntime"][1]), line
        assert metadata(ports["HTTP"], "lookup")["platform"] == "onnxruntime_onnx"
        got = infer(ports["HTTP"], "lookup", [("ids", "INT64", np.array([[0, 2, 1, 0]], np.int64))])["rows"]
        assert got.tolist() == [[[1, 2], [5, 6], [3, 4], [1, 2]]], got
    finally:
        stop_quern(proc)


def test_onnx_runtime_closed_while_openvino_is_measured_serves_once_opened_again(tmp_path):
    """ONNX Runtime is measured first, then closed while OpenVINO is measured (the load holds one
    runtime's model at a time), and opened again when it stays the choice. A convolution plus noise
    (RandomUniformLike, which each runtime draws its own way): OpenVINO's outputs differ, so ONNX
    Runtime serves, from the session opened again, what numpy computes within the noise's [0, 1)."""
    from onnx import TensorProto, helper, numpy_helper
    rng = np.random.default_rng(11)
    w = rng.normal(0, 0.5, (8, 3, 3, 3)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
         helper.make_node("RandomUniformLike", ["c"], ["noise"], low=0.0, high=1.0),
         helper.make_node("Add", ["c", "noise"], ["y"])], "noisy",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [-1, 3, 256, 256])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [-1, 8, 256, 256])], [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    proc, ports, line = serve_alone(tmp_path, "noisy", model, 'backend: "auto"\nmax_batch_size: 2\n')
    try:
        chosen, table_ = parse_choice(line)
        assert chosen == "onnxruntime" and table_["onnxruntime"][0] is not None, line
        assert "outputs differ" in str(table_["openvino f32"][1]), line
        x = rng.random((1, 3, 256, 256), dtype=np.float32)
        got = infer(ports["HTTP"], "noisy", [("x", "FP32", x)])["y"]
        # The convolution, in numpy: 3x3, padding 1.
        padded = np.pad(x[0], ((0, 0), (1, 1), (1, 1)))
        want = np.zeros((8, 256, 256), np.float32)
        for dy in range(3):
            for dx in range(3):
                want += np.einsum("oc,chw->ohw", w[:, :, dy, dx], padded[:, dy:dy + 256, dx:dx + 256])
        noise = got[0] - want
        assert noise.min() > -1e-3 and noise.max() < 1 + 1e-3 and 0.4 < noise.mean() < 0.6, (noise.min(), noise.max())
    finally:
        stop_quern(proc)


def test_a_warm_up_sample_of_the_models_own_data_is_the_check_input(tmp_path):
    """The lookup model above, whose made-up check input is out of its table's range, given a
    model_warmup sample read from a file of valid ids: measured on that sample, the log naming it. A
    sample of zeros is not taken (a made-up input says more), the log saying why; a FIFO in the
    sample file's place fails the model's load saying so, it does not hang the server."""
    import onnx
    model = lookup_model()
    repo = tmp_path / "repo"
    samples = {
        "from_file": 'input_data_file: "ids.bin"',
        "zeros": "zero_data: true",
        "fifo": 'input_data_file: "ids.bin"',
    }
    for name, fill in samples.items():
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "warmup").mkdir()
        onnx.save(model, str(repo / name / "1" / "model.onnx"))
        (repo / name / "config.pbtxt").write_text(
            'backend: "auto"\nmax_batch_size: 4\nmodel_warmup [ { name: "ids" batch_size: 1 inputs { key: "ids" '
            'value { data_type: TYPE_INT64 dims: [ 4 ] ' + fill + ' } } } ]\n')
    (repo / "from_file" / "warmup" / "ids.bin").write_bytes(np.array([0, 2, 1, 0], np.int64).tobytes())
    os.mkfifo(repo / "fifo" / "warmup" / "ids.bin")  # nothing ever writes it
    log = []
    proc, ports = start_quern(QUERN, str(repo), log=log, start_timeout=120)
    try:
        lines = {CHOSEN.search(l).group("model"): l for l in log if "runtime chosen by measurement" in l}
        assert CHOSEN.search(lines["from_file"]).group("sample") == "ids", lines["from_file"]
        _, table_ = parse_choice(lines["from_file"])
        assert table_["onnxruntime"][0] is not None, lines["from_file"]  # timed on the sample
        assert "(the check input, not warm-up sample 'ids': it holds no file's data)" in lines["zeros"], lines["zeros"]
        assert "not a regular file" in lines["fifo"], lines["fifo"]
        got = infer(ports["HTTP"], "from_file", [("ids", "INT64", np.array([[2, 2, 0, 1]], np.int64))])["rows"]
        assert got.tolist() == [[[5, 6], [5, 6], [1, 2], [3, 4]]], got
        status, _, body = http_request(ports["HTTP"], "GET", "/v2/models/fifo/ready")
        assert status != 200, body
        status, _, body = http_request(ports["HTTP"], "POST", "/v2/repository/index", b"{}")
        fifo = next(m for m in json.loads(body) if m["name"] == "fifo")
        assert fifo["state"] != "READY" and "is not a regular file" in fifo.get("reason", ""), fifo
    finally:
        stop_quern(proc)


def test_an_unconfigured_onnx_model_is_measured_once_and_its_choice_kept(tmp_path):
    """An ONNX model without config.pbtxt is backend "auto": measured at its first load, the choice
    kept in the runtime cache (one file per model file and machine) and opened from there at the next
    start without measuring; a changed model file is measured again. A model whose ONNX Runtime run
    takes under 1 ms is served by ONNX Runtime unmeasured, and nothing is kept for it. --data-dir puts
    the cache in <data-dir>/runtimes."""
    import onnx
    repo, cache = tmp_path / "repo", tmp_path / "cache"
    (repo / "classifier" / "1").mkdir(parents=True)
    shutil.copy(os.path.join(EXAMPLES, "imagenet", "1", "model.onnx"), repo / "classifier" / "1" / "model.onnx")
    shutil.copytree(os.path.join(TEST_MODELS, "linear"), repo / "linear")
    assert not (repo / "linear" / "config.pbtxt").exists()

    def start(*flags):
        log = []
        proc, ports = start_quern(QUERN, str(repo), *flags, log=log, start_timeout=300)
        lines = {CHOSEN.search(l).group("model"): l for l in log if "runtime chosen by measurement" in l}
        assert set(lines) == {"classifier", "linear"}, "".join(log)
        return proc, ports, lines

    proc, ports, first = start("--runtime-cache", str(cache))
    try:
        chosen, table = parse_choice(first["classifier"])
        assert "kept in" not in first["classifier"] and table["openvino f32"][0] is not None, table
        assert metadata(ports["HTTP"], "classifier")["platform"] == (
            "openvino" if chosen.startswith("openvino") else "onnxruntime_onnx")
        tiny, tiny_table = parse_choice(first["linear"])
        assert tiny == "onnxruntime" and "under 1 ms" in str(tiny_table["openvino f32"][1]), first["linear"]
        assert metadata(ports["HTTP"], "linear")["platform"] == "onnxruntime_onnx"
    finally:
        stop_quern(proc)
    kept = sorted(cache.glob("*.choice"))
    assert len(kept) == 1, kept  # the classifier's; none for the tiny model
    assert f"choice={chosen}\n" in kept[0].read_text(), kept[0].read_text()

    # Restarted: the kept choice, not measured again.
    proc, ports, second = start("--runtime-cache", str(cache))
    try:
        m = CHOSEN.search(second["classifier"])
        assert m.group("kept") == str(kept[0]) and parse_choice(second["classifier"])[0] == chosen, second
        assert metric_sum(ports["metrics"], "quern_model_runtime", model="classifier", runtime=chosen) == 1
    finally:
        stop_quern(proc)

    if sanitized(QUERN):
        return  # the sanitizer stage reads and writes the cache above; its hostile files: the release stage

    # A kept file replaced by a FIFO, then by a link to a file that says otherwise: neither is read
    # (the load neither hangs nor follows the link), the model is measured again and the file rewritten.
    for hostile in ("fifo", "link"):
        kept[0].unlink()
        if hostile == "fifo":
            os.mkfifo(kept[0])
        else:
            (tmp_path / "elsewhere").write_text("choice=onnxruntime\nopenvino=\nmeasured=planted\n")
            os.symlink(tmp_path / "elsewhere", kept[0])
        proc, ports, again = start("--runtime-cache", str(cache))
        stop_quern(proc)
        assert CHOSEN.search(again["classifier"]).group("kept") is None, (hostile, again["classifier"])
        assert kept[0].is_file() and not kept[0].is_symlink() and kept[0].read_text().startswith("choice="), hostile
    assert (tmp_path / "elsewhere").read_text().endswith("planted\n")  # the link's target untouched

    # The model file changed (the same graph, another producer string): measured again, kept apart.
    model = onnx.load(str(repo / "classifier" / "1" / "model.onnx"))
    model.producer_name = "changed"
    onnx.save(model, str(repo / "classifier" / "1" / "model.onnx"))
    proc, ports, third = start("--runtime-cache", str(cache))
    stop_quern(proc)
    assert CHOSEN.search(third["classifier"]).group("kept") is None, third["classifier"]
    assert len(list(cache.glob("*.choice"))) == 2

    # --data-dir: kept in <data-dir>/runtimes.
    proc, ports, fourth = start("--data-dir", str(tmp_path / "data"))
    stop_quern(proc)
    assert CHOSEN.search(fourth["classifier"]).group("kept") is None
    assert len(list((tmp_path / "data" / "runtimes").glob("*.choice"))) == 1


def test_an_idle_openvino_model_gives_its_run_memory_back(tmp_path):
    """A model whose run holds a large tensor between its small input and output: [N, 4, 64, 64]
    -> 1x1 convolution to 64 channels -> nearest resize by 6 ([N, 64, 384, 384], 37.7 MB an item)
    -> sigmoid -> mean over the image. Two instances (a stream each) run batches side by side, so
    both streams hold their run memory; once the model has been idle for a whole idle time (5 s)
    its memory goes back (the log says so at debug level; 60 s allowed here), and it answers as
    before, as numpy computes (the resize repeats each pixel 36 times, so the mean is that of the
    convolution's sigmoid). Under the sanitizers freed memory stays in their quarantine: there the
    release and the runs after it are checked, the resident memory by the release stage."""
    import threading
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    from quern_testing import rss_mb, wait_until
    rng = np.random.default_rng(5)
    w = rng.normal(0, 0.5, (64, 4, 1, 1)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["c"]),
         helper.make_node("Resize", ["c", "", "scales"], ["big"], mode="nearest"),
         helper.make_node("Sigmoid", ["big"], ["s"]),
         helper.make_node("ReduceMean", ["s"], ["y"], axes=[2, 3], keepdims=0)], "wide_middle",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [-1, 4, 64, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [-1, 64])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.array([1, 1, 6, 6], np.float32), "scales")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    repo = tmp_path / "repo"
    (repo / "wide_middle" / "1").mkdir(parents=True)
    onnx.save(model, str(repo / "wide_middle" / "1" / "model.onnx"))
    (repo / "wide_middle" / "config.pbtxt").write_text(
        'backend: "openvino"\nmax_batch_size: 2\ninstance_group [{ count: 2, kind: KIND_CPU }]\n'
        'dynamic_batching { max_queue_delay_microseconds: 2000 }\n'
        'parameters { key: "INFERENCE_PRECISION_HINT" value { string_value: "f32" } }\n')

    def want(x):
        c = np.einsum("oc,nchw->nohw", w[:, :, 0, 0], x.astype(np.float64))
        return (1 / (1 + np.exp(-c))).mean(axis=(2, 3))

    given_back = "OpenVINO's run memory given back (idle) model=wide_middle"
    log = []
    proc, ports = start_quern(QUERN, str(repo), "--log-level", "debug", log=log)
    try:
        loaded = rss_mb(proc.pid)
        x = rng.random((2, 4, 64, 64), dtype=np.float32)
        errors = []

        def caller():
            try:
                for _ in range(4):
                    got = infer(ports["HTTP"], "wide_middle", [("x", "FP32", x)])["y"]
                    np.testing.assert_allclose(got, want(x), atol=1e-4)
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)
        callers = [threading.Thread(target=caller) for _ in range(3)]
        for t in callers:
            t.start()
        for t in callers:
            t.join(timeout=300)
        assert not any(t.is_alive() for t in callers), "a caller still waits for its answer after 300 s"
        assert not errors, errors
        busy = rss_mb(proc.pid)
        # A batch of two holds at least 2 x 37.7 MB in one stream while it runs; the streams keep it.
        item_mb = 64 * 384 * 384 * 4 / 2**20
        assert busy - loaded > item_mb, (loaded, busy)
        wait_until(lambda: any(given_back in line for line in log), timeout=60,
                   what=f"'{given_back}' in the log")
        if not sanitized(QUERN):
            rested = wait_until(lambda: rss_mb(proc.pid) < busy - item_mb and rss_mb(proc.pid), timeout=10,
                                what=f"the run memory given back (loaded {loaded:.0f} MB, busy {busy:.0f} MB)")
            print(f"loaded {loaded:.0f} MB, after the batches {busy:.0f} MB, idle {rested:.0f} MB")
        for _ in range(2):  # the memory allocated again, twice over
            got = infer(ports["HTTP"], "wide_middle", [("x", "FP32", x)])["y"]
            np.testing.assert_allclose(got, want(x), atol=1e-4)
        assert proc.poll() is None
    finally:
        stop_quern(proc)
