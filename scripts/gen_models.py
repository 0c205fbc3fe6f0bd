#!/usr/bin/env python3
"""Generates the ONNX models Quern's examples, tests and benchmarks use.

Models are built node by node with the `onnx` package (no framework, no
download). Weights come from a seeded generator, and where a test needs the
expected output it is written beside the model as .npy so the test computes
the answer itself, independently of ONNX Runtime.

  gen_models.py --examples DIR   example repository (generated part)
  gen_models.py --tests DIR      small models for the test suite
  gen_models.py --bench DIR      ResNet-50 and a small CNN, dynamic batch
"""
import argparse
import os
import sys

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = [helper.make_opsetid("", 17)]


def save(model, path, quiet):
    onnx.checker.check_model(model)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    onnx.save(model, tmp)
    os.replace(tmp, path)
    if not quiet:
        print("wrote", path)


def graph_model(nodes, name, inputs, outputs, inits=()):
    g = helper.make_graph(nodes, name, inputs, outputs, initializer=list(inits))
    m = helper.make_model(g, opset_imports=OPSET, producer_name="quern-gen")
    m.ir_version = 8
    return m


def vi(name, elem, shape):
    return helper.make_tensor_value_info(name, elem, shape)


def add_sub():
    return graph_model(
        [helper.make_node("Add", ["INPUT0", "INPUT1"], ["OUTPUT0"]),
         helper.make_node("Sub", ["INPUT0", "INPUT1"], ["OUTPUT1"])],
        "add_sub",
        [vi("INPUT0", TensorProto.FLOAT, ["N", 4]), vi("INPUT1", TensorProto.FLOAT, ["N", 4])],
        [vi("OUTPUT0", TensorProto.FLOAT, ["N", 4]), vi("OUTPUT1", TensorProto.FLOAT, ["N", 4])])


def linear(rng):
    w = rng.standard_normal((8, 3)).astype(np.float32)
    b = rng.standard_normal((3,)).astype(np.float32)
    m = graph_model(
        [helper.make_node("MatMul", ["x", "W"], ["xw"]), helper.make_node("Add", ["xw", "b"], ["y"])],
        "linear", [vi("x", TensorProto.FLOAT, ["N", 8])], [vi("y", TensorProto.FLOAT, ["N", 3])],
        [numpy_helper.from_array(w, "W"), numpy_helper.from_array(b, "b")])
    return m, w, b


DTYPES = [("bool", TensorProto.BOOL), ("uint8", TensorProto.UINT8), ("int8", TensorProto.INT8),
          ("int32", TensorProto.INT32), ("int64", TensorProto.INT64), ("fp16", TensorProto.FLOAT16),
          ("fp32", TensorProto.FLOAT), ("fp64", TensorProto.DOUBLE), ("string", TensorProto.STRING)]


def dtypes():
    nodes, ins, outs = [], [], []
    for n, t in DTYPES:
        nodes.append(helper.make_node("Identity", ["in_" + n], ["out_" + n]))
        ins.append(vi("in_" + n, t, ["N", 2]))
        outs.append(vi("out_" + n, t, ["N", 2]))
    return graph_model(nodes, "dtypes", ins, outs)


def fail_on_3():
    """y = reshape(x, [N, 4]): fine when x is [N, 4], a runtime error when x is [N, 3]."""
    four = numpy_helper.from_array(np.array([4], dtype=np.int64), "four")
    return graph_model(
        [helper.make_node("Shape", ["x"], ["shape"], start=0, end=1),
         helper.make_node("Concat", ["shape", "four"], ["target"], axis=0),
         helper.make_node("Reshape", ["x", "target"], ["y"])],
        "fail_on_3", [vi("x", TensorProto.FLOAT, ["N", "M"])], [vi("y", TensorProto.FLOAT, ["N", 4])], [four])


def scale(name, batch, dims, factor=2.0):
    f = numpy_helper.from_array(np.array(factor, dtype=np.float32), "factor")
    return graph_model([helper.make_node("Mul", ["x", "factor"], ["y"])], name,
                       [vi("x", TensorProto.FLOAT, [batch] + dims)], [vi("y", TensorProto.FLOAT, [batch] + dims)], [f])


def tile4():
    """y = x repeated four times along the last axis: a response four times the size of its request."""
    reps = numpy_helper.from_array(np.array([1, 4], dtype=np.int64), "reps")
    return graph_model([helper.make_node("Tile", ["x", "reps"], ["y"])], "tile4",
                       [vi("x", TensorProto.FLOAT, ["N", "K"])], [vi("y", TensorProto.FLOAT, ["N", "K4"])], [reps])


# ---------------------------------------------------------------- synthetic detectors
# A 64x64 RGB input (scaled to [0, 1]) is cut into a 4x4 grid of 16-pixel
# cells. Class c's score for a cell is the mean of channel c over the cell
# (red, green, blue). Each cell proposes its own box (16x16) and a larger
# box around it (20x20, IoU 0.64 with the first) at 0.9 of the score, which
# NMS must suppress. Tests paint coloured squares on grid cells and compute
# the expected boxes themselves.
DET_SIZE, DET_CELL = 64, 16


def detector(name, layout, size=DET_SIZE, cell=DET_CELL, backbone=False, slices=False):
    """backbone=True adds a strided CNN (~1 GFLOP at 640x640, the order of a small YOLO) whose result is
    multiplied by zero and added to the scores: real compute, outputs unchanged."""
    g = size // cell
    cells = g * g
    centres = [((k % g) * cell + cell / 2, (k // g) * cell + cell / 2) for k in range(cells)]
    boxes = np.array([[cx, cy, cell, cell] for cx, cy in centres] +
                     [[cx, cy, cell + 4, cell + 4] for cx, cy in centres], np.float32).T  # [4, 2*cells]
    nodes = [helper.make_node("AveragePool", ["images"], ["pooled"], kernel_shape=[cell, cell], strides=[cell, cell])]
    inits = []
    if backbone:
        bld = Builder(np.random.default_rng(640))
        x, cin = "images", 3
        for cout in (16, 32, 64, 128, 256):
            x, cin = bld.conv(x, cin, cout, 3, stride=2), cout
        nodes += bld.nodes
        inits += bld.inits
        nodes += [helper.make_node("ReduceMean", [x], ["feat"], axes=[1, 2, 3], keepdims=1),
                  helper.make_node("Mul", ["feat", "zero_f"], ["feat0"]),
                  helper.make_node("Add", ["pooled", "feat0"], ["pooled_all"])]
        inits.append(numpy_helper.from_array(np.array(0.0, np.float32), "zero_f"))
    else:
        nodes.append(helper.make_node("Identity", ["pooled"], ["pooled_all"]))
    nodes += [
        helper.make_node("Reshape", ["pooled_all", "score_shape"], ["s"]),  # [N, 3, cells]
        helper.make_node("Mul", ["s", "ninety"], ["s9"]),
        helper.make_node("Concat", ["s", "s9"], ["scores"], axis=2),  # [N, 3, 2*cells]
        helper.make_node("Shape", ["images"], ["in_shape"]),
        helper.make_node("Slice", ["in_shape", "zero", "one"], ["n"]),
    ]
    inits += [numpy_helper.from_array(np.array([0, 3, cells], np.int64), "score_shape"),
             numpy_helper.from_array(np.array(0.9, np.float32), "ninety"),
             numpy_helper.from_array(np.array([0], np.int64), "zero"),
             numpy_helper.from_array(np.array([1], np.int64), "one")]
    n = 2 * cells
    if layout == "detr":  # normalised boxes [N, cells, 4] and logits [N, cells, 3]; only the cell boxes
        inits += [numpy_helper.from_array((boxes[:, :cells].T / size)[None].astype(np.float32), "boxes_c"),
                  numpy_helper.from_array(np.array([cells, 4], np.int64), "btail"),
                  numpy_helper.from_array(np.array(10.0, np.float32), "ten"),
                  numpy_helper.from_array(np.array(0.5, np.float32), "half")]
        nodes += [helper.make_node("Concat", ["n", "btail"], ["bshape"], axis=0),
                  helper.make_node("Expand", ["boxes_c", "bshape"], ["pred_boxes"]),
                  helper.make_node("Transpose", ["s"], ["st"], perm=[0, 2, 1]),
                  helper.make_node("Sub", ["st", "half"], ["centred"]),
                  helper.make_node("Mul", ["centred", "ten"], ["pred_logits"])]  # sigmoid(10 (s - 0.5))
        outputs = [vi("pred_logits", TensorProto.FLOAT, ["N", cells, 3]),
                   vi("pred_boxes", TensorProto.FLOAT, ["N", cells, 4])]
    else:
        inits += [numpy_helper.from_array(boxes[None], "boxes_c"),
                  numpy_helper.from_array(np.ones((1, 1, n), np.float32), "ones_c"),
                  numpy_helper.from_array(np.array([4, n], np.int64), "btail"),
                  numpy_helper.from_array(np.array([1, n], np.int64), "otail")]
        nodes += [helper.make_node("Concat", ["n", "btail"], ["bshape"], axis=0),
                  helper.make_node("Expand", ["boxes_c", "bshape"], ["b"]),
                  helper.make_node("Concat", ["n", "otail"], ["oshape"], axis=0),
                  helper.make_node("Expand", ["ones_c", "oshape"], ["obj"])]
        if layout == "yolov8":  # [N, 4 + 3, boxes]
            nodes.append(helper.make_node("Concat", ["b", "scores"], ["output0"], axis=1))
            outputs = [vi("output0", TensorProto.FLOAT, ["N", 7, n])]
        else:  # yolov5: [N, boxes, 5 + 3]
            nodes += [helper.make_node("Concat", ["b", "obj", "scores"], ["v5t"], axis=1),
                      helper.make_node("Transpose", ["v5t"], ["v5" if slices else "output0"], perm=[0, 2, 1])]
            outputs = [vi("output0", TensorProto.FLOAT, ["N", n, 8])]
            if slices:
                # The YOLOv5 Detect head as older exports write it: per level, Slice ops cut xy, wh and
                # the scores apart along the last axis and Concat puts them back (here unchanged). ONNX
                # Runtime 1.21 refuses such a graph ("two nodes with same node name
                # (/GatherSliceToSplitFusion/)"); later releases load it.
                inits.append(numpy_helper.from_array(np.array([-1, n, 8], np.int64), "v5_shape"))
                nodes.append(helper.make_node("Reshape", ["v5", "v5_shape"], ["v5s"]))  # static [., n, 8]
                levels = []
                for k, (r0, r1) in enumerate(((0, n // 3), (n // 3, 2 * n // 3), (2 * n // 3, n))):
                    rows = f"rows{k}"
                    inits += [numpy_helper.from_array(np.array([r0], np.int64), f"r0_{k}"),
                              numpy_helper.from_array(np.array([r1], np.int64), f"r1_{k}"),
                              numpy_helper.from_array(np.array([1], np.int64), f"ax1_{k}")]
                    nodes.append(helper.make_node("Slice", ["v5s", f"r0_{k}", f"r1_{k}", f"ax1_{k}"], [rows]))
                    parts = []
                    for j, (c0, c1) in enumerate(((0, 2), (2, 4), (4, 8))):
                        inits += [numpy_helper.from_array(np.array([c0], np.int64), f"c0_{k}{j}"),
                                  numpy_helper.from_array(np.array([c1], np.int64), f"c1_{k}{j}"),
                                  numpy_helper.from_array(np.array([2], np.int64), f"ax2_{k}{j}")]
                        nodes.append(helper.make_node("Slice", [rows, f"c0_{k}{j}", f"c1_{k}{j}", f"ax2_{k}{j}"],
                                                      [f"part{k}{j}"]))
                        parts.append(f"part{k}{j}")
                    nodes.append(helper.make_node("Concat", parts, [f"level{k}"], axis=2))
                    levels.append(f"level{k}")
                nodes.append(helper.make_node("Concat", levels, ["output0"], axis=1))
    return graph_model(nodes, name, [vi("images", TensorProto.FLOAT, ["N", 3, size, size])], outputs, inits)


def write_detector(d, layout, quiet, name=None, batching="dynamic_batching { }", size=DET_SIZE, cell=DET_CELL,
                   backbone=False, slices=False):
    name = name or f"detect_{layout}"
    save(detector(name, layout, size, cell, backbone, slices), f"{d}/{name}/1/model.onnx", quiet)
    cells = (size // cell) ** 2
    outputs = {"yolov5": f'{{ name: "output0" data_type: TYPE_FP32 dims: [ {2 * cells}, 8 ] label_filename: "labels.txt" }}',
               "yolov8": f'{{ name: "output0" data_type: TYPE_FP32 dims: [ 7, {2 * cells} ] label_filename: "labels.txt" }}',
               "detr": f'{{ name: "pred_logits" data_type: TYPE_FP32 dims: [ {cells}, 3 ] label_filename: "labels.txt" }}, '
                       f'{{ name: "pred_boxes" data_type: TYPE_FP32 dims: [ {cells}, 4 ] }}'}[layout]
    extra = 'parameters { key: "quern.detection.activation" value { string_value: "sigmoid" } }\n' \
        if layout == "detr" else ""
    write_config(f"{d}/{name}/config.pbtxt", f"""max_batch_size: 8
input [ {{ name: "images" data_type: TYPE_FP32 dims: [ 3, {size}, {size} ] }} ]
output [ {outputs} ]
{batching}
parameters {{ key: "quern.task" value {{ string_value: "detection" }} }}
parameters {{ key: "quern.detection.format" value {{ string_value: "{layout}" }} }}
{extra}""")
    with open(f"{d}/{name}/labels.txt", "w") as f:
        f.write("red\ngreen\nblue\n")


# ---------------------------------------------------------------- CNNs
class Builder:
    def __init__(self, rng):
        self.rng, self.nodes, self.inits, self.n = rng, [], [], 0

    def name(self, p):
        self.n += 1
        return f"{p}{self.n}"

    def conv(self, x, cin, cout, k, stride=1, relu=True, group=1):
        w = self.name("w")
        b = self.name("b")
        fan_in = cin // group * k * k
        self.inits.append(numpy_helper.from_array(
            (self.rng.standard_normal((cout, cin // group, k, k)) * np.sqrt(2.0 / fan_in) * 0.5).astype(np.float32), w))
        self.inits.append(numpy_helper.from_array(np.zeros(cout, np.float32), b))
        y = self.name("conv")
        self.nodes.append(helper.make_node("Conv", [x, w, b], [y], kernel_shape=[k, k], strides=[stride, stride],
                                           pads=[k // 2] * 4, group=group))
        if relu:
            r = self.name("relu")
            self.nodes.append(helper.make_node("Relu", [y], [r]))
            return r
        return y

    def add_relu(self, a, b):
        s = self.name("add")
        r = self.name("relu")
        self.nodes += [helper.make_node("Add", [a, b], [s]), helper.make_node("Relu", [s], [r])]
        return r

    def head(self, x, cin, classes):
        p = self.name("gap")
        f = self.name("flat")
        w = self.name("fcw")
        b = self.name("fcb")
        self.nodes += [helper.make_node("GlobalAveragePool", [x], [p]), helper.make_node("Flatten", [p], [f])]
        self.inits += [numpy_helper.from_array((self.rng.standard_normal((cin, classes)) * 0.01).astype(np.float32), w),
                       numpy_helper.from_array(np.zeros(classes, np.float32), b)]
        mm = self.name("mm")
        self.nodes += [helper.make_node("MatMul", [f, w], [mm]), helper.make_node("Add", [mm, b], ["logits"])]


def resnet50(rng):
    """ResNet-50 v1.5 (bottleneck blocks 3-4-6-3, batch norm folded into conv bias), 224x224, 1000 classes."""
    bld = Builder(rng)
    x = bld.conv("input", 3, 64, 7, stride=2)
    mp = bld.name("pool")
    bld.nodes.append(helper.make_node("MaxPool", [x], [mp], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]))
    x, cin = mp, 64
    for stage, (blocks, width) in enumerate([(3, 64), (4, 128), (6, 256), (3, 512)]):
        for i in range(blocks):
            stride = 2 if (i == 0 and stage > 0) else 1
            out = width * 4
            y = bld.conv(x, cin, width, 1)
            y = bld.conv(y, width, width, 3, stride=stride)
            y = bld.conv(y, width, out, 1, relu=False)
            short = bld.conv(x, cin, out, 1, stride=stride, relu=False) if (i == 0) else x
            x, cin = bld.add_relu(y, short), out
    bld.head(x, cin, 1000)
    return graph_model(bld.nodes, "resnet50", [vi("input", TensorProto.FLOAT, ["N", 3, 224, 224])],
                       [vi("logits", TensorProto.FLOAT, ["N", 1000])], bld.inits)


def yolov5n_like(rng):
    """A detector of YOLOv5n's cost (~4 GFLOPs at 640x640) with a YOLOv5 export's output: [N, 25200, 85]
    (3 anchors x (80x80 + 40x40 + 20x20) cells; cx, cy, w, h in pixels, objectness and 80 class scores
    as probabilities). Random weights; the objectness of 40 boxes is pushed over 0.5 and of the rest
    under 0.01, so that post-processing sees what a real frame gives it: a few dozen candidates."""
    bld = Builder(rng)
    x = bld.conv("images", 3, 16, 3, stride=2)  # 320
    x = bld.conv(x, 16, 32, 3, stride=2)  # 160
    x = bld.conv(x, 32, 32, 3)
    x = bld.conv(x, 32, 64, 3, stride=2)  # 80: P3
    x = bld.conv(x, 64, 64, 3)
    p3 = bld.conv(x, 64, 64, 3)
    x = bld.conv(p3, 64, 128, 3, stride=2)  # 40: P4
    x = bld.conv(x, 128, 128, 3)
    p4 = bld.conv(x, 128, 128, 3)
    x = bld.conv(p4, 128, 256, 3, stride=2)  # 20: P5
    p5 = bld.conv(x, 256, 256, 3)
    levels = []
    for feat, cin, g in ((p3, 64, 80), (p4, 128, 40), (p5, 256, 20)):
        y = bld.conv(feat, cin, 255, 1, relu=False)  # [N, 3 * 85, g, g]
        shape5, shape3 = bld.name("s5"), bld.name("s3")
        bld.inits += [numpy_helper.from_array(np.array([0, 3, 85, g, g], np.int64), shape5),
                      numpy_helper.from_array(np.array([0, 3 * g * g, 85], np.int64), shape3)]
        r, t, o = bld.name("r"), bld.name("t"), bld.name("o")
        bld.nodes += [helper.make_node("Reshape", [y, shape5], [r]),
                      helper.make_node("Transpose", [r], [t], perm=[0, 1, 3, 4, 2]),
                      helper.make_node("Reshape", [t, shape3], [o])]
        levels.append(o)
    offset = np.zeros((1, 25200, 85), np.float32)
    offset[0, :, 4] = -12.0
    offset[0, rng.choice(25200, 40, replace=False), 4] = 12.0
    scale = np.ones(85, np.float32)
    scale[:4] = 640.0
    bld.inits += [numpy_helper.from_array(offset, "objectness_offset"), numpy_helper.from_array(scale, "box_scale")]
    bld.nodes += [helper.make_node("Concat", levels, ["raw"], axis=1),
                  helper.make_node("Add", ["raw", "objectness_offset"], ["shifted"]),
                  helper.make_node("Sigmoid", ["shifted"], ["probs"]),
                  helper.make_node("Mul", ["probs", "box_scale"], ["output0"])]
    return graph_model(bld.nodes, "detect_v5n", [vi("images", TensorProto.FLOAT, ["N", 3, 640, 640])],
                       [vi("output0", TensorProto.FLOAT, ["N", 25200, 85])], bld.inits)


def small_cnn(rng):
    """Three strided 3x3 convolutions on 64x64 RGB, ~6 MFLOPs per image, 10 classes."""
    bld = Builder(rng)
    x = bld.conv("input", 3, 16, 3, stride=2)
    x = bld.conv(x, 16, 32, 3, stride=2)
    x = bld.conv(x, 32, 64, 3, stride=2)
    bld.head(x, 64, 10)
    return graph_model(bld.nodes, "small_cnn", [vi("input", TensorProto.FLOAT, ["N", 3, 64, 64])],
                       [vi("logits", TensorProto.FLOAT, ["N", 10])], bld.inits)


def write_config(path, text):
    with open(path, "w") as f:
        f.write(text)


def gen_tests(d, quiet):
    rng = np.random.default_rng(1234)
    save(add_sub(), f"{d}/add_sub/1/model.onnx", quiet)  # bare model: configuration derived
    m, w, b = linear(rng)
    save(m, f"{d}/linear/1/model.onnx", quiet)
    np.save(f"{d}/linear/W.npy", w)
    np.save(f"{d}/linear/b.npy", b)
    save(dtypes(), f"{d}/dtypes/1/model.onnx", quiet)
    save(fail_on_3(), f"{d}/fail_on_3/1/model.onnx", quiet)
    save(scale("fixed4", 4, [3]), f"{d}/fixed4/1/model.onnx", quiet)
    write_config(f"{d}/fixed4/config.pbtxt", """name: "fixed4"
backend: "onnxruntime"
max_batch_size: 4
input [ { name: "x" data_type: TYPE_FP32 dims: [ 3 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 3 ] } ]
dynamic_batching { max_queue_delay_microseconds: 20000 }
parameters { key: "quern.fixed_batch_sizes" value { string_value: "4" } }
""")
    save(scale("nobatch", 2, [3], factor=3.0), f"{d}/nobatch/1/model.onnx", quiet)
    save(tile4(), f"{d}/tile4/1/model.onnx", quiet)
    for layout in ("yolov5", "yolov8", "detr"):
        write_detector(d, layout, quiet)
    write_detector(d, "yolov5", quiet, name="detect_yolov5_slices", slices=True)
    # A request waits up to a second for company: time to test overload and timeouts.
    write_detector(d, "yolov8", quiet, name="detect_slow",
                   batching="dynamic_batching { max_queue_delay_microseconds: 1000000 }")
    # Requests wait up to a second for company: time for a client to go away.
    save(scale("slow_batch", "N", [3]), f"{d}/slow_batch/1/model.onnx", quiet)
    write_config(f"{d}/slow_batch/config.pbtxt", "max_batch_size: 4\ndynamic_batching { max_queue_delay_microseconds: 1000000 }\n")
    # Two versions with different factors, served under an "all" policy.
    save(scale("versions", "N", [3], factor=1.0), f"{d}/versions/1/model.onnx", quiet)
    save(scale("versions", "N", [3], factor=10.0), f"{d}/versions/2/model.onnx", quiet)
    write_config(f"{d}/versions/config.pbtxt", """max_batch_size: 8
version_policy { all {} }
dynamic_batching { }
""")


def text_line(text, flipped):
    """A text-line crop as the PP-OCR direction classifier expects it:
    height 48, width 192 (right-padded), CHW, scaled to [-1, 1]."""
    from PIL import Image, ImageDraw, ImageFont
    font = ImageFont.load_default(size=30)
    left, top, right, bottom = font.getbbox(text)
    img = Image.new("RGB", (right + 16, 48), "white")
    ImageDraw.Draw(img).text((8, (48 - bottom - top) // 2), text, fill="black", font=font)
    if flipped:
        img = img.rotate(180)
    w = min(192, int(round(img.width * 48 / img.height)))
    img = img.resize((w, 48), Image.BILINEAR)
    x = (np.asarray(img, dtype=np.float32) / 255.0 - 0.5) / 0.5
    out = np.zeros((1, 3, 48, 192), np.float32)
    out[0, :, :, :w] = x.transpose(2, 0, 1)
    return out


def gen_examples(d, quiet):
    save(add_sub(), f"{d}/add_sub/1/model.onnx", quiet)
    save(small_cnn(np.random.default_rng(7)), f"{d}/small_cnn/1/model.onnx", quiet)
    data = os.path.join(os.path.dirname(os.path.abspath(d)), "data")
    os.makedirs(data, exist_ok=True)
    np.save(f"{data}/text_upright.npy", text_line("Quern grinds", False))
    np.save(f"{data}/text_flipped.npy", text_line("Quern grinds", True))
    # The detector's warm-up sample, which backend "auto" also takes for its check input (boxes to
    # compare between runtimes): darknet's dog.jpg (scripts/setup.sh copies it here) letterboxed into
    # 640x640 as examples/models/objects/config.pbtxt says, FP32 CHW, raw.
    if not os.path.exists(f"{data}/dog.jpg"):
        sys.exit(f"gen_models: {data}/dog.jpg is missing (scripts/setup.sh copies it): objects' warm-up sample needs it")
    os.makedirs(f"{d}/objects/warmup", exist_ok=True)
    letterboxed(f"{data}/dog.jpg", 640).tofile(f"{d}/objects/warmup/dog.fp32")


def letterboxed(path, size):
    """The image scaled to fit size x size (bilinear), centred on grey 114, RGB / 255, CHW float32."""
    from PIL import Image
    img = Image.open(path).convert("RGB")
    scale = min(size / img.width, size / img.height)
    w, h = max(1, round(img.width * scale)), max(1, round(img.height * scale))
    canvas = Image.new("RGB", (size, size), (114, 114, 114))
    canvas.paste(img.resize((w, h), Image.BILINEAR), ((size - w) // 2, (size - h) // 2))
    return (np.asarray(canvas, dtype=np.float32) / 255.0).transpose(2, 0, 1).copy()


def identity(name, n):
    return graph_model([helper.make_node("Identity", ["x"], ["y"])], name,
                       [vi("x", TensorProto.FLOAT, ["N", n])], [vi("y", TensorProto.FLOAT, ["N", n])])


def gen_bench(d, quiet):
    save(identity("identity", 4), f"{d}/identity/1/model.onnx", quiet)
    # A 640x640 YOLOv8-layout detector with a small-YOLO-sized backbone (vision benchmark).
    write_detector(d, "yolov8", quiet, name="detect_640", size=640, cell=32, backbone=True)
    save(small_cnn(np.random.default_rng(7)), f"{d}/small_cnn/1/model.onnx", quiet)
    if not os.path.exists(f"{d}/resnet50/1/model.onnx"):
        save(resnet50(np.random.default_rng(50)), f"{d}/resnet50/1/model.onnx", quiet)
    # The camera's detector: YOLOv5n's cost and output layout, served as a vision model.
    if not os.path.exists(f"{d}/detect_v5n/1/model.onnx"):
        save(yolov5n_like(np.random.default_rng(5)), f"{d}/detect_v5n/1/model.onnx", quiet)
    write_config(f"{d}/detect_v5n/config.pbtxt", """max_batch_size: 8
input [ { name: "images" data_type: TYPE_FP32 dims: [ 3, 640, 640 ] } ]
output [ { name: "output0" data_type: TYPE_FP32 dims: [ 25200, 85 ] label_filename: "labels.txt" } ]
dynamic_batching { }
parameters { key: "quern.task" value { string_value: "detection" } }
parameters { key: "quern.detection.format" value { string_value: "yolov5" } }
""")
    with open(f"{d}/detect_v5n/labels.txt", "w") as f:
        f.write("".join(f"class{c}\n" for c in range(80)))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--examples")
    ap.add_argument("--tests")
    ap.add_argument("--bench")
    ap.add_argument("--quiet", action="store_true")
    a = ap.parse_args()
    if not (a.examples or a.tests or a.bench):
        ap.error("give --examples, --tests or --bench")
    if a.examples:
        gen_examples(a.examples, a.quiet)
    if a.tests:
        gen_tests(a.tests, a.quiet)
    if a.bench:
        gen_bench(a.bench, a.quiet)
    return 0


if __name__ == "__main__":
    sys.exit(main())
