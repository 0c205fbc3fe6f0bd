"""scripts/quantize.py (quern quantize) on a small image classifier built here: it writes an INT8 twin
(QDQ) beside the model, renamed, with a report whose top-1 / top-5 agreement is the one computed here
independently (onnxruntime runs both files on the check photographs, pre-processed here with PIL and
numpy); calibration and check images may not overlap; the twin is served by Quern."""
import json
import os
import re
import shlex
import shutil
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from quern_testing import start_quern

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
QUANTIZE = os.path.join(ROOT, "scripts", "quantize.py")
PHOTOS = os.path.join(ROOT, "third_party", "real-models", "photos")
CALIBRATION = ["kite.jpg", "scream.jpg", "obama2.jpg", "obama3.jpg"]
CHECK = ["dog.jpg", "person.jpg", "horses.jpg", "giraffe.jpg", "eagle.jpg", "grace_hopper.jpg", "obama.jpg",
         "biden.jpg"]
SIZE = 32


def small_classifier(path):
    """Conv(3->16, 3x3) -> Relu -> Conv(16->32, 3x3, stride 2) -> Relu -> GlobalAveragePool -> Flatten ->
    Gemm(32->10) -> Softmax, weights drawn from a fixed seed."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    rng = np.random.default_rng(3)
    w1 = rng.normal(0, 0.3, (16, 3, 3, 3)).astype(np.float32)
    w2 = rng.normal(0, 0.2, (32, 16, 3, 3)).astype(np.float32)
    w3 = rng.normal(0, 0.01, (10, 32)).astype(np.float32)  # close logits: a few top-1s flip (3 of 24)
    inits = [numpy_helper.from_array(a, n) for a, n in ((w1, "w1"), (w2, "w2"), (w3, "w3"),
                                                          (np.zeros(16, np.float32), "b1"),
                                                          (np.zeros(32, np.float32), "b2"),
                                                          (np.zeros(10, np.float32), "b3"))]
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
             helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1], strides=[2, 2], name="conv2"),
             helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
             helper.make_node("GlobalAveragePool", ["r2"], ["p"], name="pool"),
             helper.make_node("Flatten", ["p"], ["f"], name="flatten"),
             helper.make_node("Gemm", ["f", "w3", "b3"], ["g"], transB=1, name="fc"),
             helper.make_node("Softmax", ["g"], ["probabilities"], name="softmax")]
    graph = helper.make_graph(nodes, "small", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                            ["n", 3, SIZE, SIZE])],
                              [helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, ["n", 10])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    model = repo / "small"
    (model / "1").mkdir(parents=True)
    small_classifier(str(model / "1" / "model.onnx"))
    (model / "labels.txt").write_text("\n".join(f"class{i}" for i in range(10)) + "\n")
    (model / "config.pbtxt").write_text(f"""# a small classifier
name: "small"
backend: "onnxruntime"
max_batch_size: 4
input [ {{ name: "x" data_type: TYPE_FP32 dims: [ 3, {SIZE}, {SIZE} ] }} ]
output [ {{ name: "probabilities" data_type: TYPE_FP32 dims: [ 10 ] label_filename: "labels.txt" }} ]
parameters {{ key: "quern.task" value {{ string_value: "classification" }} }}
parameters {{ key: "quern.image.resize" value {{ string_value: "stretch" }} }}
""")
    # Through the binary: `quern quantize` runs quern-quantize (this script, beside it) with QUERN_PYTHON.
    run = subprocess.run([os.environ["QUERN_BIN"], "quantize", str(model), "--calibration"] +
                         [os.path.join(PHOTOS, f) for f in CALIBRATION] + ["--check"] +
                         [os.path.join(PHOTOS, f) for f in CHECK] + ["--check-views"], capture_output=True,
                         text=True, timeout=300, env=dict(os.environ, QUERN_PYTHON=sys.executable))
    assert run.returncode == 0, run.stdout + run.stderr
    return repo


def test_the_configuration_is_read_in_either_spelling():
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import quantize
    text = """# a comment: name: "not this"
name: "m"
input [ { name: "images" data_type: TYPE_FP32 dims: [ 3, 640, 640 ] } ]
parameters { key: "quern.task" value: { string_value: "detection" } }
parameters: { key: "quern.image.pad_value" value { string_value: "0" } }
model_warmup [ { name: "w" batch_size: 1 } ]
"""
    cfg = quantize.parse_config(text)
    assert cfg == {"name": "m", "parameters": {"quern.task": "detection", "quern.image.pad_value": "0"}}, cfg
    assert quantize.parse_config('input [ { name: "x" } ]')["name"] is None


def top(session, x, k):
    return list(np.argsort(-session.run(None, {"x": x})[0][0])[:k])


def views(img):
    """--check-views, written here: the photograph, mirrored, and the middle 60 % of it."""
    w, h = img.size
    return {"": img, " (mirrored)": img.transpose(Image.FLIP_LEFT_RIGHT),
            " (middle)": img.crop((int(w * 0.2), int(h * 0.2), int(w * 0.8), int(h * 0.8)))}


def test_the_report_states_the_agreement_computed_here(quantized):
    import onnx
    import onnxruntime
    twin = quantized / "small_int8"
    report = json.loads((twin / "agreement.json").read_text())
    ops = {n.op_type for n in onnx.load(str(twin / "1" / "model.onnx")).graph.node}
    assert {"QuantizeLinear", "DequantizeLinear"} <= ops, ops
    fp32 = onnxruntime.InferenceSession(str(quantized / "small" / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    int8 = onnxruntime.InferenceSession(str(twin / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    top1 = top5 = 0
    differ = {}
    for f in CHECK:
        for suffix, view in views(Image.open(os.path.join(PHOTOS, f)).convert("RGB")).items():
            img = view.resize((SIZE, SIZE), Image.BILINEAR)
            x = np.ascontiguousarray((np.asarray(img, np.float32) / 255).transpose(2, 0, 1)[None])
            a, b = top(fp32, x, 2), top(int8, x, 5)
            first = int(np.argmax(int8.run(None, {"x": x})[0][0]))  # the first of equal scores, as argmax
            top1 += a[0] == first
            top5 += a[0] in b
            if a[0] != first:
                p = fp32.run(None, {"x": x})[0][0]
                differ[f + suffix] = (a[0], a[1], first, p[a[0]] - p[a[1]])
    got = report["classification"]
    n = 3 * len(CHECK)
    assert got["images"] == n, got
    assert got["top1_agreement"] == pytest.approx(top1 / n), (got, top1)
    assert got["top5_agreement"] == pytest.approx(top5 / n), (got, top5)
    # Each input whose top-1 differs, named, with the FP32 model's two best and its margin.
    assert {d["image"]: (d["fp32_top1"], d["fp32_second"], d["int8_top1"]) for d in got["top1_differs"]} == \
        {k: v[:3] for k, v in differ.items()}, (got["top1_differs"], differ)
    for d in got["top1_differs"]:
        assert d["fp32_margin"] == pytest.approx(differ[d["image"]][3], abs=1e-5), (d, differ)
    assert report["calibration_images"] == sorted(CALIBRATION), report
    config = (twin / "config.pbtxt").read_text()
    assert 'name: "small_int8"' in config and 'name: "small"' not in config, config
    assert (twin / "labels.txt").read_text() == (quantized / "small" / "labels.txt").read_text()


def int8_weight_range(model_path):
    """The smallest and largest value of the INT8 weight initializers of a QDQ model (read with onnx)."""
    import onnx
    from onnx import numpy_helper
    weights = [numpy_helper.to_array(t) for t in onnx.load(model_path).graph.initializer
               if t.data_type == onnx.TensorProto.INT8 and len(t.dims) >= 2]
    assert weights, model_path
    return min(int(w.min()) for w in weights), max(int(w.max()) for w in weights)


def cpu_has_vnni():
    from quern_testing import cpu_flags
    return bool({"avx512_vnni", "avx_vnni", "amx_int8"} & cpu_flags())


@pytest.mark.parametrize("reduce_range", ["on", "off", "auto"])
def test_the_weights_take_7_bits_where_the_cpu_would_saturate_8(quantized, tmp_path, reduce_range):
    """--reduce-range on: every INT8 weight within [-64, 64] (7 bits, symmetric: a pair of products with
    UINT8 activations is at most 2 x 255 x 64 = 32,640, which ONNX Runtime's 16-bit sums hold on a CPU
    without VNNI); off: the full 8 bits (the largest weight of each channel
    at -127 or 127, symmetric); auto: 8 bits where this CPU has VNNI, else both made and measured on
    the check images, the report naming both scores and the one kept."""
    out = tmp_path / "twin"
    run = subprocess.run([sys.executable, QUANTIZE, str(quantized / "small"), "--out", str(out), "--reduce-range",
                          reduce_range, "--count", "8", "--calibration"] +
                         [os.path.join(PHOTOS, f) for f in CALIBRATION] + ["--check"] +
                         [os.path.join(PHOTOS, f) for f in CHECK[:3]], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads((out / "agreement.json").read_text())
    low, high = int8_weight_range(str(out / "1" / "model.onnx"))
    if reduce_range == "auto" and not cpu_has_vnni():
        measured = report["weight_bits_measured"]
        assert set(measured) == {"7", "8"}, report
        best = max((tuple(v), int(b)) for b, v in measured.items())[1]
        assert report["weight_bits"] == best, report
    bits = {"on": 7, "off": 8}.get(reduce_range, report["weight_bits"])
    if reduce_range == "auto" and cpu_has_vnni():
        assert bits == 8 and "weight_bits_measured" not in report, report
    assert report["weight_bits"] == bits, report
    if bits == 7:
        assert -64 <= low and high <= 64, (low, high)
    else:
        assert low == -127 or high == 127, (low, high)


def test_check_images_may_not_be_calibration_images(quantized, tmp_path):
    run = subprocess.run([sys.executable, QUANTIZE, str(quantized / "small"), "--out", str(tmp_path / "again"),
                          "--calibration", os.path.join(PHOTOS, "kite.jpg"), "--check", os.path.join(PHOTOS, "kite.jpg")],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "must not be calibration images" in run.stderr and "kite.jpg" in run.stderr, run
    assert not (tmp_path / "again").exists()


def test_the_twin_is_served_beside_its_model(quantized, tmp_path):
    import tritonclient.http as httpclient
    repo = tmp_path / "repo"
    shutil.copytree(quantized, repo)
    proc, ports = start_quern(os.environ["QUERN_BIN"], str(repo))
    try:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{ports['HTTP']}")
        x = np.random.default_rng(0).random((1, 3, SIZE, SIZE), dtype=np.float32)
        outs = {}
        for m in ("small", "small_int8"):
            inp = httpclient.InferInput("x", list(x.shape), "FP32")
            inp.set_data_from_numpy(x)
            outs[m] = client.infer(m, [inp]).as_numpy("probabilities")[0]
        assert abs(outs["small"].sum() - 1) < 1e-4 and abs(outs["small_int8"].sum() - 1) < 1e-2, outs
        assert np.abs(outs["small"] - outs["small_int8"]).max() < 0.1, outs
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_twin_for_openvino_is_measured_and_served_there(quantized, tmp_path):
    """--runtime openvino: the same QDQ file, its config naming the openvino backend; the agreement
    that decides is OpenVINO's running the twin, ONNX Runtime's beside it, both as computed here (the
    FP32 reference from onnxruntime, the twin run by each runtime's own Python package); and Quern
    serves it on OpenVINO with the answers OpenVINO gives here."""
    import onnxruntime
    import openvino as ov
    import tritonclient.http as httpclient
    repo = tmp_path / "repo"
    shutil.copytree(quantized / "small", repo / "small")
    out = repo / "small_ov"
    run = subprocess.run([sys.executable, QUANTIZE, str(repo / "small"), "--out", str(out), "--runtime", "openvino",
                          "--reduce-range", "off", "--count", "8", "--calibration"] +
                         [os.path.join(PHOTOS, f) for f in CALIBRATION] + ["--check"] +
                         [os.path.join(PHOTOS, f) for f in CHECK] + ["--check-views"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads((out / "agreement.json").read_text())
    config = (out / "config.pbtxt").read_text()
    assert re.findall(r'(?m)^\s*backend\s*:\s*"([^"]*)"', config) == ["openvino"], config
    assert 'name: "small_ov"' in config, config
    fp32 = onnxruntime.InferenceSession(str(repo / "small" / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    twin = {"onnxruntime": onnxruntime.InferenceSession(str(out / "1" / "model.onnx"),
                                                        providers=["CPUExecutionProvider"]).run,
            "openvino": ov.Core().compile_model(str(out / "1" / "model.onnx"), "CPU")}
    answer = {"onnxruntime": lambda x: twin["onnxruntime"](None, {"x": x})[0][0],
              "openvino": lambda x: np.array(twin["openvino"]({0: x})[0])[0]}
    agree = {r: [0, 0] for r in answer}
    inputs = []
    for f in CHECK:
        for view in views(Image.open(os.path.join(PHOTOS, f)).convert("RGB")).values():
            img = view.resize((SIZE, SIZE), Image.BILINEAR)
            x = np.ascontiguousarray((np.asarray(img, np.float32) / 255).transpose(2, 0, 1)[None])
            inputs.append(x)
            want = int(np.argmax(fp32.run(None, {"x": x})[0][0]))
            for r, f_ in answer.items():
                p = f_(x)
                agree[r][0] += want == int(np.argmax(p))
                agree[r][1] += want in list(np.argsort(-p)[:5])
    n = len(inputs)
    assert report["runtime"] == "openvino" and report["weight_bits"] == 8, report
    assert set(report["by_runtime"]) == {"openvino", "onnxruntime"}, report
    assert report["classification"] == report["by_runtime"]["openvino"]["classification"], report
    for r, (top1, top5) in agree.items():
        got = report["by_runtime"][r]["classification"]
        assert got["images"] == n, got
        assert got["top1_agreement"] == pytest.approx(top1 / n), (r, got, top1)
        assert got["top5_agreement"] == pytest.approx(top5 / n), (r, got, top5)
    # Served: backend openvino, the answers OpenVINO gives the same file here.
    proc, ports = start_quern(os.environ["QUERN_BIN"], str(repo))
    try:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{ports['HTTP']}")
        assert client.get_model_metadata("small_ov")["platform"].startswith("openvino"), \
            client.get_model_metadata("small_ov")
        for x in inputs[:6]:
            inp = httpclient.InferInput("x", list(x.shape), "FP32")
            inp.set_data_from_numpy(x)
            got = client.infer("small_ov", [inp]).as_numpy("probabilities")[0]
            np.testing.assert_allclose(got, answer["openvino"](x), atol=2e-3)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def small_detector(path):
    """A YOLOv8-layout detector whose nodes have no names: Conv(3->8, 3x3, stride 4) -> Relu ->
    Conv(8->7, 1x1) -> Reshape [n, 7, 256] -> Sigmoid; box centres and sizes (the first four rows)
    scaled to a 640 px input, three class probabilities after them, concatenated: output0 [n, 7, 256]
    as YOLOv8's head answers (coordinates in pixels beside probabilities in one tensor)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    rng = np.random.default_rng(5)
    inits = [numpy_helper.from_array(a, n) for a, n in (
        (rng.normal(0, 0.5, (8, 3, 3, 3)).astype(np.float32), "w1"), (np.zeros(8, np.float32), "b1"),
        (rng.normal(0, 0.6, (7, 8, 1, 1)).astype(np.float32), "w2"), (np.zeros(7, np.float32), "b2"),
        (np.array([0, 7, 256], np.int64), "shape"), (np.array([640, 640, 160, 160], np.float32).reshape(1, 4, 1), "scale"),
        (np.array([0], np.int64), "s0"), (np.array([4], np.int64), "s4"), (np.array([7], np.int64), "s7"),
        (np.array([1], np.int64), "axis"))]
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1], strides=[4, 4]),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"]),
             helper.make_node("Reshape", ["c2", "shape"], ["flat"]),
             helper.make_node("Sigmoid", ["flat"], ["s"]),
             helper.make_node("Slice", ["s", "s0", "s4", "axis"], ["box01"]),
             helper.make_node("Mul", ["box01", "scale"], ["box"]),
             helper.make_node("Slice", ["s", "s4", "s7", "axis"], ["cls"]),
             helper.make_node("Concat", ["box", "cls"], ["output0"], axis=1)]
    graph = helper.make_graph(nodes, "detector", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                               ["n", 3, 64, 64])],
                              [helper.make_tensor_value_info("output0", TensorProto.FLOAT, ["n", 7, 256])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)


def test_a_detectors_head_stays_fp32_by_default(tmp_path):
    """Quantized whole, the head's one UINT8 scale spans 0-640 px (a step of 2.5): every probability
    reads 0 and no box is left. By default the head stays FP32, named though its nodes had no names,
    and the probabilities stay within a few hundredths of the FP32 model's (computed here)."""
    import onnx
    import onnxruntime
    model = tmp_path / "det"
    (model / "1").mkdir(parents=True)
    small_detector(str(model / "1" / "model.onnx"))
    (model / "labels.txt").write_text("a\nb\nc\n")
    (model / "config.pbtxt").write_text("""name: "det"
max_batch_size: 4
input [ { name: "x" data_type: TYPE_FP32 dims: [ 3, 64, 64 ] } ]
output [ { name: "output0" data_type: TYPE_FP32 dims: [ 7, 256 ] label_filename: "labels.txt" } ]
parameters { key: "quern.task" value { string_value: "detection" } }
parameters { key: "quern.detection.format" value { string_value: "yolov8" } }
parameters { key: "quern.image.resize" value { string_value: "stretch" } }
""")
    twins = {}
    for label, extra in (("default", []), ("nothing kept", ["--keep-fp32", ""])):
        out = tmp_path / label.replace(" ", "_")
        run = subprocess.run([sys.executable, QUANTIZE, str(model), "--out", str(out), "--calibration"] +
                             [os.path.join(PHOTOS, f) for f in CALIBRATION] + ["--check"] +
                             [os.path.join(PHOTOS, f) for f in CHECK] + extra, capture_output=True, text=True,
                             timeout=300)
        assert run.returncode == 0, run.stdout + run.stderr
        twins[label] = out
    report = json.loads((twins["default"] / "agreement.json").read_text())
    assert report["nodes_named_here"] == 9, report
    kept = report["nodes_kept_fp32"]
    ops = {n.name: n.op_type for n in onnx.load(str(model / "1" / "model.onnx")).graph.node}
    assert sorted(kept) == sorted(["Reshape_3", "Sigmoid_4", "Slice_5", "Mul_6", "Slice_7", "Concat_8"]), (kept, ops)
    assert json.loads((twins["nothing kept"] / "agreement.json").read_text())["nodes_kept_fp32"] == []
    fp32 = onnxruntime.InferenceSession(str(model / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    sessions = {k: onnxruntime.InferenceSession(str(v / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
                for k, v in twins.items()}
    boxes = 0
    for f in CHECK:
        img = Image.open(os.path.join(PHOTOS, f)).convert("RGB").resize((64, 64), Image.BILINEAR)
        x = np.ascontiguousarray((np.asarray(img, np.float32) / 255).transpose(2, 0, 1)[None])
        want = fp32.run(None, {"x": x})[0][0]
        boxes += int((want[4:].max(axis=0) >= 0.25).sum())
        whole = sessions["nothing kept"].run(None, {"x": x})[0][0]
        assert whole[4:].max() < 0.25, (f, whole[4:].max())  # no box: every probability reads 0
        head = sessions["default"].run(None, {"x": x})[0][0]
        assert np.abs(head[4:] - want[4:]).max() < 0.08, (f, np.abs(head[4:] - want[4:]).max())
    assert boxes > 100  # the FP32 detector finds boxes in the photographs to keep
    assert report["detection"]["agreement_iou_0.5"] > 0.5, report["detection"]


def test_quern_quantize_says_what_python_lacks(tmp_path):
    # A Python without site packages (-S): none of numpy, Pillow, onnx, onnxruntime.
    bare = tmp_path / "bare-python"
    bare.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} -I -S \"$@\"\n")  # -I: no PYTHONPATH either
    bare.chmod(0o755)
    env = dict(os.environ, QUERN_PYTHON=str(bare))
    run = subprocess.run([os.environ["QUERN_BIN"], "quantize", str(tmp_path), "--calibration", PHOTOS],
                         capture_output=True, text=True, timeout=60, env=env)
    assert run.returncode != 0, run
    assert "lacks numpy, Pillow, onnx, onnxruntime" in run.stderr and "QUERN_PYTHON" in run.stderr, run.stderr
    # --help needs none of them, and names the command as it was typed.
    run = subprocess.run([os.environ["QUERN_BIN"], "quantize", "--help"], capture_output=True, text=True,
                         timeout=60, env=env)
    assert run.returncode == 0 and run.stdout.startswith("usage: quern quantize") and "--calibration" in run.stdout, run
    # Without QUERN_PYTHON: quern-quantize's own first line (the python3 on PATH).
    plain = {k: v for k, v in os.environ.items() if k != "QUERN_PYTHON"}
    run = subprocess.run([os.environ["QUERN_BIN"], "quantize", "--help"], capture_output=True, text=True,
                         timeout=60, env=plain)
    assert run.returncode == 0 and run.stdout.startswith("usage: quern quantize"), run
    run = subprocess.run([os.environ["QUERN_BIN"], "quantize", "--help"], capture_output=True, text=True,
                         timeout=60, env=dict(os.environ, QUERN_PYTHON=str(tmp_path / "no-such-python")))
    assert run.returncode == 127 and "QUERN_PYTHON" in run.stderr and "no-such-python" in run.stderr, run
