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


def identity(name, n):
    return graph_model([helper.make_node("Identity", ["x"], ["y"])], name,
                       [vi("x", TensorProto.FLOAT, ["N", n])], [vi("y", TensorProto.FLOAT, ["N", n])])


def gen_bench(d, quiet):
    save(identity("identity", 4), f"{d}/identity/1/model.onnx", quiet)
    save(small_cnn(np.random.default_rng(7)), f"{d}/small_cnn/1/model.onnx", quiet)
    if not os.path.exists(f"{d}/resnet50/1/model.onnx"):
        save(resnet50(np.random.default_rng(50)), f"{d}/resnet50/1/model.onnx", quiet)


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
