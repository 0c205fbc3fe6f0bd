"""Detection post-processing against a numpy reference written here.

Each model ignores its image and returns one fixed output (a constant in the graph): a YOLOv5 export's
[1, boxes, 5 + 80] or a YOLOv8 export's [1, 4 + 80, boxes], as probabilities or as raw logits
(quern.detection.activation sigmoid), with boxes in overlapping clusters so that NMS has work. A 640x640
image maps model pixels to image pixels one to one, so /v1/vision/custom/<model> must answer exactly the
boxes the reference computes from the same tensor: YOLOv5's candidates (objectness >= threshold),
confidence = best class score (x objectness), class-wise greedy NMS at IoU 0.45, at most 100, clipped
to the image."""
import io
import json
import os
import uuid
import http.client

import numpy as np
import pytest
from PIL import Image

import onnx
from onnx import TensorProto, helper, numpy_helper

from quern_testing import start_quern

QUERN = os.environ["QUERN_BIN"]
SIZE, CLASSES = 640, 80
IOU, MAX_DET = 0.45, 100
THRESHOLDS = (0.25, 0.4, 0.6)


def sigmoid(x):
    x = np.asarray(x, np.float32)
    return (np.float32(1) / (np.float32(1) + np.exp(-x))).astype(np.float32)


def generate(layout, activation, boxes, seed):
    """A detector output [boxes, 5 + C] (yolov5) or [4 + C, boxes] (yolov8), float32."""
    rng = np.random.default_rng(seed)
    centres = rng.uniform(80, 560, (12, 2))
    k = rng.integers(0, len(centres), boxes)
    xy = centres[k] + rng.normal(0, 12, (boxes, 2))
    wh = rng.uniform(40, 140, (boxes, 2))
    objects = rng.random(boxes) < 0.06  # ~6 % of the boxes hold something
    cls = rng.random((boxes, CLASSES)) ** 2 * 0.2  # background: under every threshold
    owner = rng.integers(0, 6, boxes)  # few classes, so that NMS compares boxes of one class
    cls[objects, owner[objects]] = rng.uniform(0.2, 1.0, objects.sum())
    if layout == "yolov5":
        obj = np.where(objects, rng.uniform(0.2, 1.0, boxes), rng.uniform(0, 0.3, boxes))
        cols = [xy, wh, obj[:, None], cls]
    else:
        cols = [xy, wh, cls]
    out = np.concatenate(cols, axis=1).astype(np.float32)
    if activation == "sigmoid":  # raw logits: the model leaves the sigmoid to the server
        first = 4
        probs = np.clip(out[:, first:], 1e-6, 1 - 1e-6)
        out[:, first:] = np.log(probs / (1 - probs))
    return out if layout == "yolov5" else np.ascontiguousarray(out.T)


def candidates(out, layout, activation, thr):
    """(boxes xyxy, confidence, class) of the boxes over the threshold, in tensor order, float32."""
    rows = out if layout == "yolov5" else out.T
    act = sigmoid if activation == "sigmoid" else (lambda v: np.asarray(v, np.float32))
    if layout == "yolov5":
        obj = act(rows[:, 4])
        keep = obj >= np.float32(thr)
        rows, obj = rows[keep], obj[keep]
        cls = rows[:, 5:]
    else:
        cls = rows[:, 4:]
    best = np.argmax(cls, axis=1)  # the first of equal maxima
    conf = act(cls[np.arange(len(rows)), best])
    if layout == "yolov5":
        conf = (conf * obj).astype(np.float32)
    keep = conf >= np.float32(thr)
    cx, cy, w, h = (rows[keep, i] for i in range(4))
    xyxy = np.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], axis=1).astype(np.float32)
    return xyxy, conf[keep], best[keep]


def iou(a, b):
    iw = min(a[2], b[2]) - max(a[0], b[0])
    ih = min(a[3], b[3]) - max(a[1], b[1])
    if iw <= 0 or ih <= 0:
        return 0.0
    inter = iw * ih
    return inter / ((a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter)


def reference(out, layout, activation, thr):
    xyxy, conf, cls = candidates(out, layout, activation, thr)
    order = np.argsort(-conf, kind="stable")
    kept = []
    for i in order:
        if len(kept) >= MAX_DET:
            break
        if all(cls[j] != cls[i] or iou(xyxy[j], xyxy[i]) <= IOU for j in kept):
            kept.append(i)
    return [(int(cls[i]), float(conf[i]), tuple(int(np.floor(np.clip(v, 0, SIZE) + 0.5)) for v in xyxy[i]))
            for i in kept]


def well_separated(out, layout, activation):
    """No decision of the reference sits within rounding of its threshold: confidences clear of every
    threshold and of each other, same-class IoUs clear of 0.45 (float32 and float64 must agree)."""
    for thr in THRESHOLDS:
        xyxy, conf, cls = candidates(out, layout, activation, thr)
        rows = out if layout == "yolov5" else out.T
        act = sigmoid if activation == "sigmoid" else (lambda v: v)
        near = [act(rows[:, 4])] if layout == "yolov5" else []
        for v in near + [conf]:
            if np.any(np.abs(np.asarray(v, np.float64) - thr) < 1e-4):
                return False
        s = np.sort(conf)
        if len(s) > 1 and np.min(np.diff(s)) < 1e-6:
            return False
        for i in range(len(conf)):
            for j in range(i):
                if cls[i] == cls[j] and abs(iou(xyxy[i].astype(np.float64), xyxy[j].astype(np.float64)) - IOU) < 1e-3:
                    return False
    return True


def constant_detector(name, out):
    """images [N, 3, 640, 640] -> output0 = the constant `out`, once per item."""
    tail = np.array(out.shape, np.int64)
    nodes = [helper.make_node("Shape", ["images"], ["in_shape"]),
             helper.make_node("Slice", ["in_shape", "zero", "one"], ["n"]),
             helper.make_node("Concat", ["n", "tail"], ["shape"], axis=0),
             helper.make_node("Expand", ["value", "shape"], ["output0"])]
    inits = [numpy_helper.from_array(out[None], "value"), numpy_helper.from_array(tail, "tail"),
             numpy_helper.from_array(np.array([0], np.int64), "zero"),
             numpy_helper.from_array(np.array([1], np.int64), "one")]
    graph = helper.make_graph(nodes, name, [helper.make_tensor_value_info("images", TensorProto.FLOAT,
                                                                          ["N", 3, SIZE, SIZE])],
                              [helper.make_tensor_value_info("output0", TensorProto.FLOAT, ["N", *out.shape])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model


CASES = [("yolov5", "none"), ("yolov5", "sigmoid"), ("yolov8", "none"), ("yolov8", "sigmoid")]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    outputs = {}
    for layout, activation in CASES:
        name = f"{layout}_{activation}"
        seed = 0
        while True:
            out = generate(layout, activation, 2000, seed)
            if well_separated(out, layout, activation):
                break
            seed += 1
        outputs[name] = (out, layout, activation)
        (repo / name / "1").mkdir(parents=True)
        onnx.save(constant_detector(name, out), str(repo / name / "1" / "model.onnx"))
        dims = ", ".join(str(d) for d in out.shape)
        act = f'parameters {{ key: "quern.detection.activation" value {{ string_value: "{activation}" }} }}' \
            if activation != "none" else ""
        (repo / name / "config.pbtxt").write_text(f"""max_batch_size: 4
input [ {{ name: "images" data_type: TYPE_FP32 dims: [ 3, {SIZE}, {SIZE} ] }} ]
output [ {{ name: "output0" data_type: TYPE_FP32 dims: [ {dims} ] label_filename: "labels.txt" }} ]
parameters {{ key: "quern.task" value {{ string_value: "detection" }} }}
parameters {{ key: "quern.detection.format" value {{ string_value: "{layout}" }} }}
{act}
""")
        (repo / name / "labels.txt").write_text("".join(f"class{c}\n" for c in range(CLASSES)))
    proc, ports = start_quern(QUERN, str(repo))
    yield ports["HTTP"], outputs
    proc.terminate()
    proc.wait(timeout=30)


def detect(port, model, thr):
    buf = io.BytesIO()
    Image.new("RGB", (SIZE, SIZE), (90, 90, 90)).save(buf, "PNG")
    boundary = uuid.uuid4().hex
    body = (f'--{boundary}\r\nContent-Disposition: form-data; name="image"; filename="f.png"\r\n\r\n'.encode() +
            buf.getvalue() + f'\r\n--{boundary}\r\nContent-Disposition: form-data; name="min_confidence"\r\n\r\n'
            f'{thr}\r\n--{boundary}--\r\n'.encode())
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    c.request("POST", f"/v1/vision/custom/{model}", body,
              {"Content-Type": f"multipart/form-data; boundary={boundary}"})
    r = c.getresponse()
    data = json.loads(r.read())
    c.close()
    assert r.status == 200 and data["success"] is True, data
    return data


@pytest.mark.parametrize("layout,activation", CASES)
@pytest.mark.parametrize("thr", THRESHOLDS)
def test_detections_match_the_numpy_reference(served, layout, activation, thr):
    port, outputs = served
    out, _, _ = outputs[f"{layout}_{activation}"]
    want = reference(out, layout, activation, thr)
    assert 5 <= len(want), f"the generated output leaves too little to compare at {thr}: {len(want)}"
    data = detect(port, f"{layout}_{activation}", thr)
    got = [(p["label"], p["confidence"], (p["x_min"], p["y_min"], p["x_max"], p["y_max"])) for p in data["predictions"]]
    assert data["count"] == len(got) == len(want), (len(got), len(want))
    for g, (c, conf, box) in zip(got, want):  # both best first
        assert g[0] == f"class{c}", (g, c, conf, box)
        assert abs(g[1] - conf) < 1e-5, (g, conf)
        assert all(abs(a - b) <= 1 for a, b in zip(g[2], box)), (g, box)
