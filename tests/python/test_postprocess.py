"""Detection post-processing against a numpy reference written here.

Each model ignores its image and returns one fixed output (a constant in the graph): a YOLOv5 export's
[1, boxes, 5 + 80] or a YOLOv8 export's [1, 4 + 80, boxes], as probabilities or as raw logits
(quern.detection.activation sigmoid), with boxes in overlapping clusters so that NMS has work. A 640x640
image maps model pixels to image pixels one to one, so /v1/vision/custom/<model> must answer exactly the
boxes the reference computes from the same tensor: YOLOv5's candidates (objectness >= threshold),
confidence = best class score (x objectness), class-wise greedy NMS at IoU 0.45, at most 100, clipped
to the image. A DETR export's boxes [1, queries, 4] and class logits [1, queries, classes + 1] likewise
(softmax, "no object" dropped, no NMS)."""
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

from quern_testing import iou, start_quern

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


# DETR: boxes [Q, 4] (cx, cy, w, h in [0, 1] of the input) and class logits [Q, C + 1] whose last
# class is "no object": softmax per query, the last class dropped, the best of the rest, no NMS,
# the highest confidences first, at most 100.
QUERIES, DETR_CLASSES = 300, 91


def generate_detr(seed):
    rng = np.random.default_rng(seed)
    cxcy = rng.uniform(0.1, 0.9, (QUERIES, 2))
    wh = rng.uniform(0.05, 0.3, (QUERIES, 2))
    boxes = np.concatenate([cxcy, wh], axis=1).astype(np.float32)
    logits = rng.normal(0, 1, (QUERIES, DETR_CLASSES + 1))
    logits[:, -1] += 3  # most queries: "no object"
    objects = rng.random(QUERIES) < 0.15
    owner = rng.integers(0, DETR_CLASSES, QUERIES)
    logits[objects, owner[objects]] += rng.uniform(2, 9, objects.sum())
    return boxes, logits.astype(np.float32)


def detr_softmax(logits):
    """Softmax per row in float32, as the server computes it (max subtracted first)."""
    x = logits - logits.max(axis=1, keepdims=True)
    e = np.exp(x).astype(np.float32)
    return (e / e.sum(axis=1, keepdims=True, dtype=np.float32)).astype(np.float32)


def detr_reference(boxes, logits, thr):
    p = detr_softmax(logits)[:, :-1]
    best = np.argmax(p, axis=1)
    conf = p[np.arange(QUERIES), best]
    keep = np.nonzero(conf >= np.float32(thr))[0]
    keep = keep[np.argsort(-conf[keep], kind="stable")][:MAX_DET]
    s = np.float32(SIZE)
    out = []
    for i in keep:
        cx, cy, w, h = boxes[i, 0] * s, boxes[i, 1] * s, boxes[i, 2] * s, boxes[i, 3] * s
        xyxy = (cx - w / np.float32(2), cy - h / np.float32(2), cx + w / np.float32(2), cy + h / np.float32(2))
        out.append((int(best[i]), float(conf[i]), tuple(int(np.floor(np.clip(v, 0, SIZE) + 0.5)) for v in xyxy)))
    return out


def detr_well_separated(boxes, logits):
    p = detr_softmax(logits)[:, :-1]
    conf = p.max(axis=1)
    if any(np.any(np.abs(conf.astype(np.float64) - thr) < 1e-4) for thr in THRESHOLDS):
        return False
    s = np.sort(conf[conf >= min(THRESHOLDS)])
    if len(s) > 1 and np.min(np.diff(s)) < 1e-6:
        return False
    # No corner within rounding of a half pixel.
    px = boxes.astype(np.float64) * SIZE
    corners = np.concatenate([px[:, :2] - px[:, 2:] / 2, px[:, :2] + px[:, 2:] / 2], axis=1)
    return not np.any(np.abs(corners - np.floor(corners) - 0.5) < 1e-3)


# CenterFace: heatmap [1, h, w], log size [2, h, w] (height, width), offset [2, h, w] (y, x) and
# landmarks [10, h, w] at stride 4; one class; class-agnostic NMS at IoU 0.3.
CF_CELLS, CF_STRIDE, CF_IOU = SIZE // 4, 4, 0.3


def generate_centerface(seed):
    rng = np.random.default_rng(seed)
    heat = (rng.random((1, CF_CELLS, CF_CELLS)) * 0.2).astype(np.float32)
    centres = rng.integers(10, CF_CELLS - 10, (14, 2))
    for cy, cx in centres:  # a face scores in a small cluster of cells
        for dy, dx in ((0, 0), (0, 1), (1, 0), (-1, -1)):
            heat[0, cy + dy, cx + dx] = rng.uniform(0.22, 1.0)
    size = np.log(rng.uniform(16, 120, (2, CF_CELLS, CF_CELLS)) / CF_STRIDE).astype(np.float32)
    offset = rng.uniform(0, 1, (2, CF_CELLS, CF_CELLS)).astype(np.float32)
    landmarks = rng.normal(0, 1, (10, CF_CELLS, CF_CELLS)).astype(np.float32)
    return heat, size, offset, landmarks


def centerface_candidates(heat, size, offset, thr):
    ys, xs = np.nonzero(heat[0] >= np.float32(thr))  # row-major: the server's cell order
    s = np.float32(CF_STRIDE)
    bh = np.exp(size[0, ys, xs]).astype(np.float32) * s
    bw = np.exp(size[1, ys, xs]).astype(np.float32) * s
    cy = (ys.astype(np.float32) + offset[0, ys, xs] + np.float32(0.5)) * s
    cx = (xs.astype(np.float32) + offset[1, ys, xs] + np.float32(0.5)) * s
    xyxy = np.stack([cx - bw / 2, cy - bh / 2, cx + bw / 2, cy + bh / 2], axis=1).astype(np.float32)
    return xyxy, heat[0, ys, xs]


def centerface_reference(heat, size, offset, thr):
    xyxy, conf = centerface_candidates(heat, size, offset, thr)
    kept = []
    for i in np.argsort(-conf, kind="stable"):
        if len(kept) >= MAX_DET:
            break
        if all(iou(xyxy[j], xyxy[i]) <= CF_IOU for j in kept):
            kept.append(i)
    return [(0, float(conf[i]), tuple(int(np.floor(np.clip(v, 0, SIZE) + 0.5)) for v in xyxy[i])) for i in kept]


def centerface_well_separated(heat, size, offset):
    for thr in THRESHOLDS:
        if np.any(np.abs(heat.astype(np.float64) - thr) < 1e-4):
            return False
        xyxy, conf = centerface_candidates(heat, size, offset, thr)
        s = np.sort(conf)
        if len(s) > 1 and np.min(np.diff(s)) < 1e-6:
            return False
        for i in range(len(conf)):
            for j in range(i):
                if abs(iou(xyxy[i].astype(np.float64), xyxy[j].astype(np.float64)) - CF_IOU) < 1e-3:
                    return False
    return True


def constant_detector(name, out):
    """images [N, 3, 640, 640] -> output0 = the constant `out`, once per item."""
    return constant_model(name, {"output0": out})


def constant_model(name, outputs):
    """images [N, 3, 640, 640] -> each named constant of `outputs`, once per item."""
    nodes = [helper.make_node("Shape", ["images"], ["in_shape"]),
             helper.make_node("Slice", ["in_shape", "zero", "one"], ["n"])]
    inits = [numpy_helper.from_array(np.array([0], np.int64), "zero"),
             numpy_helper.from_array(np.array([1], np.int64), "one")]
    infos = []
    for out_name, out in outputs.items():
        nodes += [helper.make_node("Concat", ["n", f"{out_name}_tail"], [f"{out_name}_shape"], axis=0),
                  helper.make_node("Expand", [f"{out_name}_value", f"{out_name}_shape"], [out_name])]
        inits += [numpy_helper.from_array(out[None], f"{out_name}_value"),
                  numpy_helper.from_array(np.array(out.shape, np.int64), f"{out_name}_tail")]
        infos.append(helper.make_tensor_value_info(out_name, TensorProto.FLOAT, ["N", *out.shape]))
    graph = helper.make_graph(nodes, name, [helper.make_tensor_value_info("images", TensorProto.FLOAT,
                                                                          ["N", 3, SIZE, SIZE])], infos, inits)
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
    seed = 0
    while not detr_well_separated(*generate_detr(seed)):
        seed += 1
    boxes, logits = generate_detr(seed)
    outputs["detr"] = (boxes, logits)
    (repo / "detr" / "1").mkdir(parents=True)
    onnx.save(constant_model("detr", {"pred_boxes": boxes, "pred_logits": logits}), str(repo / "detr" / "1" / "model.onnx"))
    (repo / "detr" / "config.pbtxt").write_text(f"""max_batch_size: 4
input [ {{ name: "images" data_type: TYPE_FP32 dims: [ 3, {SIZE}, {SIZE} ] }} ]
output [ {{ name: "pred_boxes" data_type: TYPE_FP32 dims: [ {QUERIES}, 4 ] }},
         {{ name: "pred_logits" data_type: TYPE_FP32 dims: [ {QUERIES}, {DETR_CLASSES + 1} ] label_filename: "labels.txt" }} ]
parameters {{ key: "quern.task" value {{ string_value: "detection" }} }}
parameters {{ key: "quern.detection.format" value {{ string_value: "detr" }} }}
""")
    (repo / "detr" / "labels.txt").write_text("".join(f"class{c}\n" for c in range(DETR_CLASSES + 1)))
    seed = 0
    while not centerface_well_separated(*generate_centerface(seed)[:3]):
        seed += 1
    heat, size, offset, landmarks = generate_centerface(seed)
    outputs["centerface"] = (heat, size, offset)
    (repo / "centerface" / "1").mkdir(parents=True)
    onnx.save(constant_model("centerface", {"heatmap": heat, "size": size, "offset": offset, "landmarks": landmarks}),
              str(repo / "centerface" / "1" / "model.onnx"))
    c = CF_CELLS
    (repo / "centerface" / "config.pbtxt").write_text(f"""max_batch_size: 4
input [ {{ name: "images" data_type: TYPE_FP32 dims: [ 3, {SIZE}, {SIZE} ] }} ]
output [ {{ name: "heatmap" data_type: TYPE_FP32 dims: [ 1, {c}, {c} ] label_filename: "labels.txt" }},
         {{ name: "size" data_type: TYPE_FP32 dims: [ 2, {c}, {c} ] }},
         {{ name: "offset" data_type: TYPE_FP32 dims: [ 2, {c}, {c} ] }},
         {{ name: "landmarks" data_type: TYPE_FP32 dims: [ 10, {c}, {c} ] }} ]
parameters {{ key: "quern.task" value {{ string_value: "detection" }} }}
parameters {{ key: "quern.detection.format" value {{ string_value: "centerface" }} }}
""")
    (repo / "centerface" / "labels.txt").write_text("face\n")
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


def check_answer(port, model, thr, want, label):
    """/v1/vision/custom/<model> at `thr` answers exactly `want` [(class, confidence, box)], best first:
    labels as label(class), confidences within 1e-5, box corners within 1 pixel."""
    assert 5 <= len(want), f"the generated output leaves too little to compare at {thr}: {len(want)}"
    data = detect(port, model, thr)
    got = [(p["label"], p["confidence"], (p["x_min"], p["y_min"], p["x_max"], p["y_max"])) for p in data["predictions"]]
    assert data["count"] == len(got) == len(want), (len(got), len(want))
    for g, (c, conf, box) in zip(got, want):  # both best first
        assert g[0] == label(c), (g, c, conf, box)
        assert abs(g[1] - conf) < 1e-5, (g, conf)
        assert all(abs(a - b) <= 1 for a, b in zip(g[2], box)), (g, box)


@pytest.mark.parametrize("layout,activation", CASES)
@pytest.mark.parametrize("thr", THRESHOLDS)
def test_detections_match_the_numpy_reference(served, layout, activation, thr):
    port, outputs = served
    out, _, _ = outputs[f"{layout}_{activation}"]
    want = reference(out, layout, activation, thr)
    check_answer(port, f"{layout}_{activation}", thr, want, lambda c: f"class{c}")


@pytest.mark.parametrize("thr", THRESHOLDS)
def test_detr_detections_match_the_numpy_reference(served, thr):
    port, outputs = served
    boxes, logits = outputs["detr"]
    want = detr_reference(boxes, logits, thr)
    check_answer(port, "detr", thr, want, lambda c: f"class{c}")


@pytest.mark.parametrize("thr", THRESHOLDS)
def test_centerface_detections_match_the_numpy_reference(served, thr):
    port, outputs = served
    heat, size, offset = outputs["centerface"]
    want = centerface_reference(heat, size, offset, thr)
    check_answer(port, "centerface", thr, want, lambda c: "face")
