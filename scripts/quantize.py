#!/usr/bin/env python3
"""quern quantize: an INT8 twin of an ONNX image model, calibrated on your own images, with a report of
how far its answers agree with the FP32 model's.

    quern quantize MODEL_DIR --calibration IMAGES [--check IMAGES] [--out OUT_DIR] [--name NAME]
                        [--keep-fp32 REGEX] [--count N] [--threshold T] [--runtime onnxruntime|openvino]
    (or scripts/quantize.py ..., the same program: `quern quantize` runs it with $QUERN_PYTHON or python3)

MODEL_DIR is a model of a Quern repository (MODEL_DIR/config.pbtxt with its `quern.image.*` parameters,
MODEL_DIR/1/model.onnx). Each calibration image goes through the model's own pre-processing (the
`quern.image.*` parameters: resize stretch/letterbox/center_crop, pad value, RGB/BGR, scale, mean,
std, NCHW/NHWC) and through the FP32 model; onnxruntime's static quantization then writes a QDQ
model: weights INT8 per output channel, activations UINT8 with ranges from the calibration (min/max).
A detector's head (quern.task detection: the nodes between its last learned layers and its outputs,
where box coordinates in pixels and probabilities share tensors) stays in FP32; --keep-fp32 REGEX names
the nodes to keep instead (nodes without a name are named <op>_<index> first; '' keeps none).

The INT8 model goes to OUT_DIR (default: MODEL_DIR's name + "_int8" beside it) as a model of its own:
OUT_DIR/1/model.onnx, OUT_DIR/config.pbtxt (MODEL_DIR's, renamed), the label files, and
OUT_DIR/agreement.json: on the --check images (which should not be calibration images) the FP32 and the
INT8 model are run on the same tensors and compared:
  - detection (quern.detection.format yolov8 or yolov5): the fraction of the FP32 model's boxes at
    confidence >= --threshold matched by an INT8 box of the same label with IoU >= 0.9 (and >= 0.5),
    the INT8 boxes matching none, and the confidence differences of the matched boxes;
  - classification: top-1 and top-5 agreement (the FP32 top-1 within the INT8 top-5).
--runtime openvino: the twin is for Quern's OpenVINO backend (its config.pbtxt says backend "openvino"):
the same QDQ file, which OpenVINO runs with its own INT8 kernels; the agreement that decides (and the
weight width, see --reduce-range) is measured on OpenVINO, and ONNX Runtime's is reported beside it.
Needs numpy, Pillow, onnx and onnxruntime (the Python packages), and openvino for --runtime openvino.
"""
import argparse
import importlib
import json
import os
import re
import shutil
import sys
import tempfile
import time

try:  # main() says which are missing
    import numpy as np
    from PIL import Image, ImageOps
except ImportError:
    np = Image = ImageOps = None

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp")


# ----------------------------------------------------------------- the model's configuration

def parse_config(text):
    """What this tool needs of a config.pbtxt: the model's name (a top-level `name:` line, if any)
    and its string parameters (`parameters { key: "K" value { string_value: "V" } }`, with or
    without the colons). The image input's name and shape come from the ONNX model itself."""
    body = re.sub(r"#[^\n]*", "", text)
    m = re.search(r'^name\s*:\s*"([^"]*)"', body, re.M)
    params = {p.group(1): p.group(2) for p in re.finditer(
        r'key\s*:\s*"([^"]+)"\s*value\s*:?\s*\{\s*string_value\s*:\s*"([^"]*)"\s*\}', body)}
    return {"name": m.group(1) if m else None, "parameters": params}


def onnx_inputs(model):
    """[(name, dims with -1 for a dimension the file leaves open, element type)] of the graph's inputs
    that are not initializers."""
    inits = {i.name for i in model.graph.initializer}
    out = []
    for i in model.graph.input:
        if i.name in inits:
            continue
        t = i.type.tensor_type
        out.append((i.name, [d.dim_value if d.HasField("dim_value") else -1 for d in t.shape.dim], t.elem_type))
    return out


class Preprocess:
    """The model's image pre-processing as its quern.image.* parameters state it (as Quern's vision
    pipeline applies it; resizing here is PIL's bilinear, close to but not bit-equal with Quern's)."""

    def __init__(self, cfg, inputs):
        p = cfg["parameters"]
        name = p.get("quern.image.input", inputs[0][0] if len(inputs) == 1 else None)
        if name is None:
            sys.exit(f"model '{cfg['name']}' has {len(inputs)} inputs; name the image input with parameter "
                     f"quern.image.input")
        found = next((i for i in inputs if i[0] == name), None)
        if found is None:
            sys.exit(f"model '{cfg['name']}': quern.image.input names '{name}', which the ONNX model does not take")
        dims, elem = list(found[1]), found[2]
        if len(dims) == 4 and dims[0] in (1, -1):
            dims = dims[1:]
        if len(dims) != 3 or not (dims[0] == 3 or dims[2] == 3):
            sys.exit(f"model '{cfg['name']}': image input '{name}' has dims {found[1]}; expected [N, 3, H, W] or "
                     f"[N, H, W, 3]")
        # onnx.TensorProto: FLOAT 1, UINT8 2, FLOAT16 10.
        if elem not in (1, 2, 10):
            sys.exit(f"model '{cfg['name']}': image input '{name}' has element type {elem}; images feed FP32, "
                     f"FP16 or UINT8 inputs")
        self.dtype = {1: np.float32, 2: np.uint8, 10: np.float16}[elem]
        self.name = name
        self.nchw = p.get("quern.image.layout", "NCHW" if dims[0] == 3 else "NHWC") == "NCHW"
        h, w = (dims[1], dims[2]) if self.nchw else (dims[0], dims[1])
        if "quern.image.size" in p:
            w, h = (int(v) for v in p["quern.image.size"].split("x"))
        if w < 1 or h < 1:
            sys.exit(f"model '{cfg['name']}': the image input has no fixed size; set quern.image.size")
        self.width, self.height = w, h
        detection = p.get("quern.task") == "detection"
        self.resize = p.get("quern.image.resize", "letterbox" if detection else "stretch")
        self.pad = int(p.get("quern.image.pad_value", "114"))
        self.bgr = p.get("quern.image.channels", "RGB") == "BGR"
        self.scale = float(p.get("quern.image.scale", "0.00392156862745098"))
        self.mean = np.array([float(v) for v in p.get("quern.image.mean", "0,0,0").split(",")], np.float32)
        self.std = np.array([float(v) for v in p.get("quern.image.std", "1,1,1").split(",")], np.float32)
        self.resize_shortest = int(p["quern.image.resize_shortest"]) if "quern.image.resize_shortest" in p else None

    def __call__(self, image):
        """(tensor [1, ...], (scale_x, scale_y, offset_x, offset_y)): input = photo * scale + offset."""
        img = ImageOps.exif_transpose(image).convert("RGB")
        w, h = img.size
        if self.resize == "letterbox":
            s = min(self.width / w, self.height / h)
            nw, nh = max(1, round(w * s)), max(1, round(h * s))
            canvas = Image.new("RGB", (self.width, self.height), (self.pad,) * 3)
            ox, oy = (self.width - nw) // 2, (self.height - nh) // 2
            canvas.paste(img.resize((nw, nh), Image.BILINEAR), (ox, oy))
            img, geometry = canvas, (nw / w, nh / h, ox, oy)
        elif self.resize == "center_crop":
            s = self.resize_shortest / min(w, h) if self.resize_shortest else max(self.width / w, self.height / h)
            nw, nh = max(self.width, round(w * s)), max(self.height, round(h * s))
            img = img.resize((nw, nh), Image.BILINEAR)
            ox, oy = (nw - self.width) // 2, (nh - self.height) // 2
            img, geometry = img.crop((ox, oy, ox + self.width, oy + self.height)), (nw / w, nh / h, -ox, -oy)
        else:
            img, geometry = img.resize((self.width, self.height), Image.BILINEAR), (self.width / w, self.height / h, 0, 0)
        x = np.asarray(img, np.float32)
        if self.bgr:
            x = x[:, :, ::-1]
        if self.dtype != np.uint8:  # a UINT8 input takes the pixels as they are
            x = (x * self.scale - self.mean) / self.std
        if self.nchw:
            x = x.transpose(2, 0, 1)
        return np.ascontiguousarray(x[None]).astype(self.dtype), geometry


def images_in(paths):
    """The images among `paths` (files, or folders whose images are taken), sorted by path."""
    files = []
    for p in paths:
        if os.path.isdir(p):
            files += [os.path.join(p, f) for f in os.listdir(p) if f.lower().endswith(IMAGE_SUFFIXES)]
        elif os.path.isfile(p):
            files.append(p)
        else:
            sys.exit(f"no such file or folder: {p}")
    if not files:
        sys.exit(f"no images ({', '.join(IMAGE_SUFFIXES)}) in {' '.join(paths)}")
    return sorted(files)


def views_of(img):
    """[(suffix, image)]: the image as it is, mirrored, and its middle 60 % (objects nearer)."""
    w, h = img.size
    return [("", img), (" (mirrored)", img.transpose(Image.FLIP_LEFT_RIGHT)),
            (" (middle)", img.crop((int(w * 0.2), int(h * 0.2), int(w * 0.8), int(h * 0.8))))]


def calibration_tensors(files, pre, count):
    """Each image as it is, mirrored, and its middle 60 % (objects nearer), until `count` tensors."""
    views = []
    for f in files:
        views += [v for _, v in views_of(Image.open(f).convert("RGB"))]
    order = list(range(0, len(views), 3)) + list(range(1, len(views), 3)) + list(range(2, len(views), 3))
    return [pre(views[i])[0] for i in order[:count]]


# ----------------------------------------------------------------- agreement

def iou(a, b):
    ix = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    iy = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = ix * iy
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def decode(out, fmt, threshold, nms_iou=0.45):
    """[(confidence, class, (x1, y1, x2, y2) in input pixels)] after class-wise NMS, best first."""
    out = np.asarray(out, np.float32)
    while out.ndim > 2 and out.shape[0] == 1:
        out = out[0]
    if fmt == "yolov8":  # [4 + classes, cells]
        cls = out[4:]
        best = np.argmax(cls, axis=0)
        conf = cls[best, np.arange(out.shape[1])]
        xywh = out[:4].T
    elif fmt == "yolov5":  # [cells, 5 + classes]
        scores = out[:, 5:] * out[:, 4:5]
        best = np.argmax(scores, axis=1)
        conf = scores[np.arange(out.shape[0]), best]
        xywh = out[:, :4]
    else:
        return None
    boxes = []
    for i in np.nonzero(conf >= threshold)[0]:
        cx, cy, w, h = (float(v) for v in xywh[i])
        boxes.append((float(conf[i]), int(best[i]), (cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2)))
    boxes.sort(key=lambda b: -b[0])
    kept = []
    for b in boxes:
        if all(k[1] != b[1] or iou(k[2], b[2]) <= nms_iou for k in kept):
            kept.append(b)
    return kept


def detection_agreement(pairs, fmt, threshold):
    reference = matched_09 = matched_05 = extra = 0
    deltas = []
    per_image = []
    for name, ref_out, q_out in pairs:
        ref, q = decode(ref_out, fmt, threshold), decode(q_out, fmt, threshold)
        if ref is None:
            return {"computed": False, "why": f"box agreement is computed for the yolov8 and yolov5 formats, "
                                              f"not {fmt!r}"}
        used = set()
        here = 0
        for conf, cls, box in ref:
            best, best_iou = None, 0.0
            for j, (qc, qcls, qbox) in enumerate(q):
                if qcls == cls and j not in used and iou(box, qbox) > best_iou:
                    best, best_iou = j, iou(box, qbox)
            reference += 1
            if best is not None and best_iou >= 0.5:
                matched_05 += 1
            if best is not None and best_iou >= 0.9:
                matched_09 += 1
                here += 1
                used.add(best)
                deltas.append(q[best][0] - conf)
        extra += sum(1 for j, (qc, qcls, qbox) in enumerate(q)
                     if j not in used and not any(c == qcls and iou(b, qbox) >= 0.5 for _, c, b in ref))
        per_image.append({"image": name, "fp32_boxes": len(ref), "int8_boxes": len(q), "matched_iou_0.9": here})
    d = np.array(deltas or [0.0])
    return {"computed": True, "threshold": threshold, "fp32_boxes": reference,
            "matched_iou_0.9": matched_09, "matched_iou_0.5": matched_05,
            "agreement_iou_0.9": matched_09 / reference if reference else None,
            "agreement_iou_0.5": matched_05 / reference if reference else None,
            "int8_boxes_matching_none": extra,
            "confidence_delta_mean": float(d.mean()), "confidence_delta_max_abs": float(np.abs(d).max()),
            "images": per_image}


def classification_agreement(pairs):
    """Top-1 and top-5 agreement, and each image whose top-1 differs with the FP32 model's margin (its
    top-1 score less its second, in the model's output units): a near tie flips on the smallest change."""
    top1 = top5 = 0
    differ = []
    for name, ref_out, q_out in pairs:
        r, q = np.asarray(ref_out).reshape(-1), np.asarray(q_out).reshape(-1)
        order = np.argsort(-r)
        top1 += int(order[0] == np.argmax(q))
        top5 += int(order[0] in np.argsort(-q)[:5])
        if order[0] != np.argmax(q):
            differ.append({"image": name, "fp32_top1": int(order[0]), "fp32_second": int(order[1]),
                           "int8_top1": int(np.argmax(q)), "fp32_margin": float(r[order[0]] - r[order[1]])})
    n = len(pairs)
    return {"computed": True, "images": n, "top1_agreement": top1 / n if n else None,
            "top5_agreement": top5 / n if n else None,
            "max_abs_output_change": float(max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32)).max()
                                               for _, a, b in pairs)) if n else None,
            "top1_differs": sorted(differ, key=lambda d: d["fp32_margin"])}


# ----------------------------------------------------------------- main

def named(model):
    """The model with every node named (a node without a name gets "<op>_<index>"), so that nodes can
    be kept in FP32 by name. Returns how many were named."""
    names = {n.name for n in model.graph.node if n.name}
    count = 0
    for i, n in enumerate(model.graph.node):
        if not n.name:
            name = f"{n.op_type}_{i}"
            while name in names:
                name += "_"
            n.name = name
            names.add(name)
            count += 1
    return count


def detection_head(graph):
    """The nodes between a detector's last learned layers and its outputs: walked back from each output
    until a Conv, ConvTranspose, MatMul or Gemm (not taken). Their tensors mix box coordinates in the
    input's pixels with probabilities (YOLO heads concatenate both), which one UINT8 scale cannot hold:
    quantized, every probability reads 0. A Conv of one output channel and a 1x1 kernel is a weighted
    sum over channels, the distribution focal loss' expectation in a YOLOv8 head: part of the decoding,
    walked through."""
    producer = {o: n for n in graph.node for o in n.output}
    weights = {i.name: i for i in graph.initializer}
    learned = {"Conv", "ConvTranspose", "MatMul", "Gemm"}
    head, seen, stack = [], set(), [o.name for o in graph.output]
    while stack:
        n = producer.get(stack.pop())
        if n is None or id(n) in seen:
            continue
        seen.add(id(n))
        if n.op_type in learned:
            w = weights.get(n.input[1]) if len(n.input) > 1 else None
            if not (n.op_type == "Conv" and w is not None and len(w.dims) == 4 and w.dims[0] == 1
                    and list(w.dims[2:]) == [1, 1]):
                continue
        head.append(n.name)
        stack.extend(i for i in n.input if i and i not in weights)
    return head


def session(path, threads):
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])


RUNTIMES = ("onnxruntime", "openvino")


def runner(path, runtime, threads=1):
    """A function that runs the model at `path` on `runtime` (one thread) and returns its first output.
    OpenVINO compiles it as Quern's backend does by default: its own choice of precision for this CPU
    (bf16 where the CPU has it) around the INT8 layers."""
    if runtime == "openvino":
        import openvino as ov
        compiled = ov.Core().compile_model(path, "CPU", {"INFERENCE_NUM_THREADS": threads, "NUM_STREAMS": 1})
        request = compiled.create_infer_request()
        return lambda x: np.array(request.infer({0: x})[0])
    sess = session(path, threads)
    name = sess.get_inputs()[0].name
    return lambda x: sess.run(None, {name: x})[0]


def seconds_per_run(run, x, budget=2.0):
    run(x)
    t, n = time.perf_counter(), 0
    while time.perf_counter() - t < budget:
        run(x)
        n += 1
    return (time.perf_counter() - t) / n


def cpu_has_vnni():
    """True when this CPU multiplies 8-bit integers with VNNI (AVX512_VNNI, AVX_VNNI or AMX): ONNX
    Runtime's UINT8 x INT8 kernels then sum in 32 bits. Without it they use VPMADDUBSW, whose pairs of
    products saturate at 16 bits when weights use all 8 bits (ONNX Runtime's documentation,
    "quantization on x86-64 with AVX2 and AVX512")."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return True  # not known: 8-bit weights, the precise choice where VNNI is the norm
    return bool({"avx512_vnni", "avx_vnni", "amx_int8"} & set(flags))


def check_inputs(paths, pre, with_views):
    """[(name, input tensor)] of the check images (each also mirrored and its middle, with_views)."""
    out = []
    for f in images_in(paths):
        img = ImageOps.exif_transpose(Image.open(f)).convert("RGB")
        for suffix, view in views_of(img) if with_views else [("", img)]:
            out.append((os.path.basename(f) + suffix, pre(view)[0]))
    return out


def reference_outputs(src, check):
    """The FP32 model's first output for each check input, in order (ONNX Runtime's: the reference
    for every runtime's twin)."""
    ref = runner(src, "onnxruntime")
    return [ref(x) for _, x in check]


def agreement(reference, dst, check, task, cfg, threshold, runtime="onnxruntime"):
    """How the INT8 model dst, run on `runtime`, answers the check inputs against the FP32 model's
    answers `reference`: {"detection": ...} or {"classification": ...} (nothing for another task)."""
    q = runner(dst, runtime)
    pairs = [(label, want, q(x)) for (label, x), want in zip(check, reference)]
    if task == "detection":
        return {"detection": detection_agreement(pairs, cfg["parameters"].get("quern.detection.format", ""),
                                                 threshold)}
    if task == "classification":
        return {"classification": classification_agreement(pairs)}
    return {}


def agreement_score(report):
    """What ranks two quantizations: boxes kept at IoU 0.9, then 0.5 (a detector); top-1, then top-5
    agreement (a classifier)."""
    if "detection" in report:
        return (report["detection"]["agreement_iou_0.9"], report["detection"]["agreement_iou_0.5"])
    if "classification" in report:
        return (report["classification"]["top1_agreement"], report["classification"]["top5_agreement"])
    return (0.0, 0.0)


def require_packages(runtime):
    missing = []
    needed = [("numpy", "numpy"), ("PIL.Image", "Pillow"), ("onnx", "onnx"), ("onnxruntime", "onnxruntime")]
    if runtime == "openvino":
        needed.append(("openvino", "openvino"))
    for module, package in needed:
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(package)
    if missing:
        names = ", ".join(p for _, p in needed[:-1]) + " and " + needed[-1][1]
        sys.exit(f"quern quantize: needs the Python packages {names}; {sys.executable} "
                 f"lacks {', '.join(missing)}: pip install {' '.join(missing)}, or name a Python that has them "
                 f"with QUERN_PYTHON=/path/to/python")


def main():
    ap = argparse.ArgumentParser(prog="quern quantize", description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir")
    ap.add_argument("--calibration", required=True, nargs="+", help="images, or folders of them, to calibrate on")
    ap.add_argument("--check", nargs="+", help="images, or folders of them (not calibration ones), to measure "
                    "agreement on")
    ap.add_argument("--check-views", action="store_true", help="compare on each check image as it is, mirrored "
                    "and its middle 60 %% (three inputs per image)")
    ap.add_argument("--out", help="the INT8 model's folder (default: MODEL_DIR_int8 beside MODEL_DIR)")
    ap.add_argument("--name", help="the INT8 model's name (default: the folder's name)")
    ap.add_argument("--keep-fp32", default=None,
                    help="regular expression: nodes whose names match stay FP32 (nodes without a name are named "
                         "<op>_<index>); default: a detector's head, none for other models; '' keeps none")
    ap.add_argument("--count", type=int, default=48, help="calibration tensors (default 48)")
    ap.add_argument("--threshold", type=float, default=0.25, help="box confidence for agreement (default 0.25)")
    ap.add_argument("--method", choices=("minmax", "entropy", "percentile"), default="minmax",
                    help="how activation ranges are chosen from the calibration (default minmax)")
    ap.add_argument("--ops", default="", help="comma-separated operator types to quantize (default: all "
                    "onnxruntime can), e.g. Conv to leave attention's MatMuls in FP32")
    ap.add_argument("--moving-average", action="store_true",
                    help="minmax: each activation's range averaged over the calibration tensors, not their extremes")
    ap.add_argument("--reduce-range", choices=("auto", "on", "off"), default="auto",
                    help="weights in 7 bits instead of 8: on a CPU without VNNI ONNX Runtime's INT8 kernels sum "
                    "in 16 bits, which 8-bit weights can saturate; auto (the default): 8 bits where this CPU "
                    "has VNNI, else both measured on the --check images and the one that agrees better kept "
                    "(7 bits without --check)")
    ap.add_argument("--runtime", choices=RUNTIMES, default="onnxruntime",
                    help="the runtime the twin is for (default onnxruntime): its config names that backend, and "
                    "its agreement decides; with openvino, ONNX Runtime's agreement is reported beside it")
    ap.add_argument("--time", action="store_true", help="also time one run of each model on one thread")
    args = ap.parse_args()
    require_packages(args.runtime)

    import onnx
    from onnxruntime.quantization import (CalibrationDataReader, CalibrationMethod, QuantFormat, QuantType,
                                          quantize_static)

    model_dir = os.path.abspath(args.model_dir.rstrip("/"))
    with open(os.path.join(model_dir, "config.pbtxt")) as f:
        config_text = f.read()
    cfg = parse_config(config_text)
    cfg["name"] = cfg["name"] or os.path.basename(model_dir)  # Quern names a model without one by its folder
    src = os.path.join(model_dir, "1", "model.onnx")
    if not os.path.isfile(src):
        sys.exit(f"no ONNX model at {src}")
    pre = Preprocess(cfg, onnx_inputs(onnx.load(src, load_external_data=False)))
    out_dir = os.path.abspath(args.out or model_dir + "_int8")
    name = args.name or os.path.basename(out_dir)
    if out_dir == model_dir:
        sys.exit("--out must differ from the model's own folder")

    calibration = images_in(args.calibration)
    if args.check and set(calibration) & set(images_in(args.check)):
        sys.exit("the --check images must not be calibration images: " +
                 ", ".join(sorted(set(calibration) & set(images_in(args.check)))))
    tensors = calibration_tensors(calibration, pre, args.count)

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.it = iter(tensors)

        def get_next(self):
            x = next(self.it, None)
            return None if x is None else {pre.name: x}

    model = onnx.load(src)
    unnamed = named(model)
    graph = model.graph
    task = cfg["parameters"].get("quern.task", "classification")
    if args.keep_fp32 is not None:
        keep = [n.name for n in graph.node if args.keep_fp32 and re.search(args.keep_fp32, n.name)]
        kept_why = f"--keep-fp32 {args.keep_fp32!r}"
    elif task == "detection":
        keep = detection_head(graph)
        kept_why = "the detection head (the nodes between the last learned layers and the outputs)"
        if not keep:
            print("note: the detector's outputs come straight from a learned layer: no head kept in FP32 "
                  "(--keep-fp32 names nodes to keep)", file=sys.stderr)
        elif len(keep) > 0.2 * len(graph.node):
            print(f"note: the detection head found is {len(keep)} of {len(graph.node)} nodes, kept in FP32 "
                  "(--keep-fp32 names the nodes to keep instead)", file=sys.stderr)
    else:
        keep, kept_why = [], "none asked for"
    quant_options = dict(quant_format=QuantFormat.QDQ, per_channel=True, activation_type=QuantType.QUInt8,
                         weight_type=QuantType.QInt8,
                         calibrate_method={"minmax": CalibrationMethod.MinMax, "entropy": CalibrationMethod.Entropy,
                                           "percentile": CalibrationMethod.Percentile}[args.method],
                         nodes_to_exclude=keep, op_types_to_quantize=[o for o in args.ops.split(",") if o] or None,
                         extra_options={"ActivationSymmetric": False, "WeightSymmetric": True,
                                        "CalibMovingAverage": args.moving_average})
    check = check_inputs(args.check, pre, args.check_views) if args.check else None
    # Weights in 8 bits, or 7 (reduce_range): without VNNI ONNX Runtime's UINT8 x INT8 kernels sum
    # pairs of products in 16 bits, which 8-bit weights can saturate (a detector lost a box so), and 7
    # bits cost precision instead (a classifier's top-1 moved so). auto, on such a CPU: both, and the
    # one that agrees better with the FP32 model on the check images (7 bits without them).
    if args.reduce_range != "auto" or cpu_has_vnni():
        candidates = [7 if args.reduce_range == "on" else 8]
    else:
        candidates = [8, 7] if check else [7]
    os.makedirs(os.path.join(out_dir, "1"), exist_ok=True)
    dst = os.path.join(out_dir, "1", "model.onnx")
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("TMPDIR", tmp)
        if unnamed:  # quantize the named copy, so that the nodes kept are the ones named here
            src_named = os.path.join(tmp, "named.onnx")
            onnx.save(model, src_named)
        measured = {}
        reference = reference_outputs(src, check) if check else None
        for bits in candidates:
            out = os.path.join(tmp, f"int8_{bits}.onnx")
            reader = Reader()
            quantize_static(src_named if unnamed else src, out, reader, reduce_range=bits == 7, **quant_options)
            measured[bits] = (out, agreement(reference, out, check, task, cfg, args.threshold, args.runtime)
                              if check else {})
        weight_bits = max(candidates, key=lambda b: (agreement_score(measured[b][1]), b))
        shutil.copy(measured[weight_bits][0], dst)
        # The other runtime's agreement on the same file, beside the one that decided.
        beside = {r: agreement(reference, dst, check, task, cfg, args.threshold, r)
                  for r in RUNTIMES if r != args.runtime} if check and args.runtime != "onnxruntime" else {}

    header = (f"# INT8 twin of '{cfg['name']}' (scripts/quantize.py: QDQ, weights INT8 per channel"
              f"{' in 7 bits' if weight_bits == 7 else ''}, activations\n"
              f"# UINT8 calibrated on {len(tensors)} views of {len(calibration)} images;"
              f" {len(keep)} nodes kept in FP32).\n# agreement.json: how its answers compare with the FP32 model's.\n")
    text = re.sub(r'^(name\s*:\s*)"[^"]*"', lambda m: m.group(1) + f'"{name}"', config_text, count=1, flags=re.M)
    if args.runtime == "openvino":
        # The backend the twin was measured on (a platform line would name ONNX Runtime's).
        text = re.sub(r'(?m)^\s*(backend|platform)\s*:.*\n?', "", text)
        header += '# For OpenVINO (quern quantize --runtime openvino).\nbackend: "openvino"\n'
    with open(os.path.join(out_dir, "config.pbtxt"), "w") as f:
        f.write(header + text)
    for f in os.listdir(model_dir):
        if f.endswith((".txt", ".labels", ".names")) and f != "config.pbtxt":
            shutil.copy(os.path.join(model_dir, f), os.path.join(out_dir, f))
    # The configuration's model_warmup samples read their files from warmup/: the twin takes the same.
    if os.path.isdir(os.path.join(model_dir, "warmup")):
        shutil.copytree(os.path.join(model_dir, "warmup"), os.path.join(out_dir, "warmup"), dirs_exist_ok=True)

    report = {"model": cfg["name"], "int8_model": name, "calibration_images": [os.path.basename(f) for f in calibration],
              "calibration_tensors": len(tensors),
              "nodes_kept_fp32": keep, "nodes_kept_fp32_because": kept_why, "nodes_named_here": unnamed,
              "weight_bits": weight_bits, "runtime": args.runtime}
    report.update(measured[weight_bits][1])
    if beside:
        report["by_runtime"] = {args.runtime: measured[weight_bits][1], **beside}
    if len(measured) > 1:
        report["weight_bits_measured"] = {str(b): agreement_score(r) for b, (_, r) in measured.items()}
    if args.time and check:
        x = check[-1][1]
        report["ms_per_run_one_thread"] = {"fp32": 1e3 * seconds_per_run(runner(src, "onnxruntime"), x),
                                           "int8": 1e3 * seconds_per_run(runner(dst, args.runtime), x)}
        if args.runtime != "onnxruntime":
            report["ms_per_run_one_thread"][f"fp32 {args.runtime}"] = 1e3 * seconds_per_run(runner(src, args.runtime), x)
    with open(os.path.join(out_dir, "agreement.json"), "w") as f:
        json.dump(report, f, indent=1)
    def brief(r):  # the figures, without the lists of images
        return {k: {a: b for a, b in r[k].items() if not isinstance(b, list)} for k in r}

    summary = {k: v for k, v in report.items() if k != "nodes_kept_fp32"}
    for k in ("detection", "classification"):
        if k in summary:
            summary.update(brief({k: summary[k]}))
    if "by_runtime" in summary:
        summary["by_runtime"] = {r: brief(a) for r, a in summary["by_runtime"].items()}
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
