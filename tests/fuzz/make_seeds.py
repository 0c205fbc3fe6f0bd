#!/usr/bin/env python3
"""Writes the hand-made seed inputs of the fuzz targets: tests/fuzz/corpus/<target>/seed-*.

Seeds are valid requests, edge cases and the inputs that once took Quern
down (deep JSON nesting, element counts that overflow, BYTES tensors with
huge shapes and tiny bodies, truncated images, configured numbers far out of
range). Inputs the fuzzer finds are merged beside them by scripts/fuzz.sh.
Every file stays under 64 KiB. Run with the venv of scripts/setup.sh
(Pillow, tritonclient):

  build/venv/bin/python tests/fuzz/make_seeds.py [--out tests/fuzz/corpus]
"""
import argparse
import base64
import io
import json
import os
import struct

from PIL import Image

MAX_FILE = 64 * 1024 - 1
# Deep enough to overflow a recursive JSON parser on the 1 MiB stack the fuzz
# targets run inputs on (fuzz_util.h), short enough for the size limit.
DEEP = 60000


def j(obj):
    return json.dumps(obj, separators=(",", ":")).encode()


class Out:
    def __init__(self, root):
        self.root = root

    def put(self, target, name, data):
        if isinstance(data, str):
            data = data.encode()
        assert len(data) <= MAX_FILE, (target, name, len(data))
        d = os.path.join(self.root, target)
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "seed-" + name), "wb") as f:
            f.write(data)


# ---------------------------------------------------------------- KServe bodies
def add_sub_body(**extra):
    body = {"inputs": [
        {"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]},
        {"name": "INPUT1", "shape": [1, 4], "datatype": "FP32", "data": [10, 20, 30, 40]}]}
    body.update(extra)
    return body


def binary_body(inputs, outputs=None, params=None):
    """JSON header + binary tensors; returns (header_length, body)."""
    meta, blobs = [], b""
    for name, dtype, shape, raw in inputs:
        meta.append({"name": name, "shape": shape, "datatype": dtype,
                     "parameters": {"binary_data_size": len(raw)}})
        blobs += raw
    doc = {"inputs": meta}
    if outputs is not None:
        doc["outputs"] = outputs
    if params is not None:
        doc["parameters"] = params
    header = j(doc)
    return len(header), header + blobs


def bytes_elems(*items):
    return b"".join(struct.pack("<I", len(s)) + s for s in items)


DEEP_JSON = b"[" * DEEP
HUGE_SHAPES = [
    {"inputs": [{"name": "INPUT0", "shape": [4611686018427387904, 4], "datatype": "FP32", "data": []}]},
    {"inputs": [{"name": "INPUT0", "shape": [16, 1152921504606846976], "datatype": "FP32", "data": []}]},
    {"inputs": [{"name": "x", "shape": [9223372036854775807], "datatype": "INT8", "data": []}]},
    {"inputs": [{"name": "x", "shape": [-1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]},
    {"inputs": [{"name": "x", "shape": [1] * 70, "datatype": "FP32", "data": [1]}]},
]


def kserve_bodies():
    """(name, header_length or None, body) for an infer request to add_sub-like models."""
    out = [
        ("add_sub", None, j(add_sub_body())),
        ("nested_data", None, j({"inputs": [{"name": "INPUT0", "shape": [2, 2], "datatype": "FP32",
                                            "data": [[1, 2], [3, 4]]}]})),
        ("all_types", None, j({"inputs": [
            {"name": "b", "shape": [2], "datatype": "BOOL", "data": [True, False]},
            {"name": "u8", "shape": [2], "datatype": "UINT8", "data": [0, 255]},
            {"name": "u16", "shape": [1], "datatype": "UINT16", "data": [65535]},
            {"name": "u32", "shape": [1], "datatype": "UINT32", "data": [4294967295]},
            {"name": "u64", "shape": [1], "datatype": "UINT64", "data": [18446744073709551615]},
            {"name": "i8", "shape": [2], "datatype": "INT8", "data": [-128, 127]},
            {"name": "i16", "shape": [1], "datatype": "INT16", "data": [-32768]},
            {"name": "i32", "shape": [1], "datatype": "INT32", "data": [-2147483648]},
            {"name": "i64", "shape": [1], "datatype": "INT64", "data": [-9223372036854775808]},
            {"name": "f16", "shape": [1], "datatype": "FP16", "data": [1.5]},
            {"name": "bf16", "shape": [1], "datatype": "BF16", "data": [1.5]},
            {"name": "f64", "shape": [1], "datatype": "FP64", "data": [1e308]},
            {"name": "s", "shape": [2], "datatype": "BYTES", "data": ["abc", ""]}]})),
        ("params_outputs", None, j(add_sub_body(
            id="req-1", parameters={"priority": 1, "timeout": 1000, "binary_data_output": True},
            outputs=[{"name": "OUTPUT0", "parameters": {"binary_data": False}}, {"name": "OUTPUT1"}]))),
        ("bad_priority", None, j(add_sub_body(parameters={"priority": -1, "timeout": "x"}))),
        ("no_inputs", None, b'{"outputs":[{"name":"OUTPUT0"}]}'),
        ("not_object", None, b'[1,2,3]'),
        ("truncated", None, j(add_sub_body())[:40]),
        ("wrong_count", None, j({"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32",
                                            "data": [1, 2, 3]}]})),
        ("unknown_type", None, j({"inputs": [{"name": "x", "shape": [1], "datatype": "FP8", "data": [1]}]})),
        ("deep_nesting", None, DEEP_JSON),
        ("deep_data", None, b'{"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":' + b"[" * 2000 + b"1"
         + b"]" * 2000 + b"}]}"),
    ]
    for i, body in enumerate(HUGE_SHAPES):
        out.append(("huge_shape_%d" % i, None, j(body)))
    hl, body = binary_body([("INPUT0", "FP32", [1, 4], struct.pack("<4f", 1, 2, 3, 4)),
                            ("INPUT1", "FP32", [1, 4], struct.pack("<4f", 5, 6, 7, 8))],
                           outputs=[{"name": "OUTPUT0", "parameters": {"binary_data": True}}])
    out.append(("binary", hl, body))
    hl, body = binary_body([("s", "BYTES", [2], bytes_elems(b"hello", b"")),
                            ("h", "FP16", [2], b"\x00\x3c\x00\xc0")], params={"binary_data_output": True})
    out.append(("binary_bytes", hl, body))
    # BYTES with a huge shape and a 4-byte body.
    hl, body = binary_body([("s", "BYTES", [1152921504606846976], b"\x00\x00\x00\x00")])
    out.append(("bytes_huge_shape", hl, body))
    hl, body = binary_body([("s", "BYTES", [4611686018427387904, 4], b"\x01\x00\x00\x00")])
    out.append(("bytes_overflow_shape", hl, body))
    hl, body = binary_body([("s", "BYTES", [2], b"\xff\xff\xff\xff" + b"ab")])
    out.append(("bytes_bad_length", hl, body))
    hl, body = binary_body([("x", "FP32", [1, 4], b"\x00" * 16)])
    out.append(("binary_short", hl, body[:-5]))
    out.append(("binary_extra", hl, body + b"junk"))
    out.append(("header_past_body", len(body) + 10, body))
    return out


def kserve_infer(o):
    for name, hl, body in kserve_bodies():
        if hl is None:
            o.put("kserve_infer", name, b"\x00" + body)
        else:
            o.put("kserve_infer", name, b"\x01" + struct.pack("<H", hl) + body)
    hl, body = binary_body([("x", "FP32", [1], b"\x00" * 4)])
    for i, value in enumerate([b"-1", b"+5", b" 12", b"99999999999999999999999", b"0x10", b""]):
        o.put("kserve_infer", "header_text_%d" % i, b"\x02" + value + b"\n" + body)
    o.put("kserve_infer", "header_zero", b"\x03" + body)
    o.put("kserve_infer", "version1", b"\x04" + j(add_sub_body()))


# ---------------------------------------------------------------- images
def image(fmt, size=(8, 6), mode="RGB", **kw):
    img = Image.new(mode, size)
    px = img.load()
    for y in range(size[1]):
        for x in range(size[0]):
            v = (x * 37 + y * 91) % 256
            if mode == "RGB":
                px[x, y] = (v, 255 - v, (x * y) % 256)
            elif mode == "RGBA":
                px[x, y] = (v, 255 - v, 7, (x * 40) % 256)
            elif mode in ("L", "P"):
                px[x, y] = v % (16 if mode == "P" else 256)
            elif mode == "I;16":
                px[x, y] = v * 200
            elif mode == "CMYK":
                px[x, y] = (v, 0, 255 - v, 9)
            elif mode == "1":
                px[x, y] = v & 1
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def exif_orientation(o):
    ex = Image.Exif()
    ex[0x0112] = o
    return ex.tobytes()


def images():
    out = {"jpeg": [], "png": [], "bmp": [], "webp": []}
    out["jpeg"] += [("baseline", image("JPEG", quality=90)),
                    ("progressive", image("JPEG", (17, 9), progressive=True)),
                    ("gray", image("JPEG", mode="L")),
                    ("cmyk", image("JPEG", mode="CMYK")),
                    ("subsampling444", image("JPEG", (16, 16), subsampling=0)),
                    ("large_for_scaling", image("JPEG", (200, 120), quality=30))]
    for orient in (3, 6, 8, 9):
        out["jpeg"].append(("exif_%d" % orient, image("JPEG", (9, 5), exif=exif_orientation(orient))))
    out["png"] += [("rgb", image("PNG")), ("rgba", image("PNG", mode="RGBA")), ("gray", image("PNG", mode="L")),
                   ("palette", image("PNG", mode="P")), ("gray16", image("PNG", mode="I;16")),
                   ("bilevel", image("PNG", mode="1")), ("interlaced", image("PNG", (11, 7), interlace=1))]
    out["bmp"] += [("rgb24", image("BMP")), ("rgb24_odd", image("BMP", (5, 3))), ("rgba32", image("BMP", mode="RGBA")),
                   ("palette8", image("BMP", mode="P")), ("gray", image("BMP", mode="L")),
                   ("bilevel", image("BMP", mode="1"))]
    # A top-down BMP (negative height) and one that claims a huge size.
    bmp = bytearray(image("BMP", (4, 4)))
    struct.pack_into("<i", bmp, 22, -4)
    out["bmp"].append(("top_down", bytes(bmp)))
    bmp = bytearray(image("BMP", (4, 4)))
    struct.pack_into("<ii", bmp, 18, 1 << 30, 1 << 30)
    out["bmp"].append(("huge_dims", bytes(bmp)))
    # An OS/2 BMP (12-byte BITMAPCOREHEADER) of 26 bytes that claims 1000 x 1000
    # pixels: its file is far too short for them, and decoding it must not cost them.
    core = b"BM" + struct.pack("<IHHI", 26, 0, 0, 26) + struct.pack("<IHHHH", 12, 1000, 1000, 1, 24)
    out["bmp"].append(("core_header_bomb", core))
    out["webp"] += [("lossy", image("WEBP", quality=80)), ("lossless", image("WEBP", lossless=True)),
                    ("alpha", image("WEBP", mode="RGBA")), ("lossy_alpha", image("WEBP", mode="RGBA", quality=50))]
    for fmt in list(out):
        for name, data in list(out[fmt]):
            if name in ("baseline", "rgb", "rgb24", "lossy"):
                out[fmt].append((name + "_truncated", data[: len(data) // 2]))
                out[fmt].append((name + "_header_only", data[:30]))
    # A JPEG that claims 65500 x 65500 (only the size check may answer).
    jpeg = bytearray(image("JPEG", (8, 8)))
    sof = jpeg.find(b"\xff\xc0")
    struct.pack_into(">HH", jpeg, sof + 5, 65500, 65500)
    out["jpeg"].append(("huge_dims", bytes(jpeg)))
    return out


def image_targets(o, imgs):
    for fmt, items in imgs.items():
        for name, data in items:
            o.put("image_decode_" + fmt, name, data)
            if not name.endswith("_header_only"):
                o.put("image_decode", fmt + "_" + name, data)
    o.put("image_decode", "unknown_format", b"GIF89a\x01\x00\x01\x00")
    o.put("image_decode", "empty", b"")


# ---------------------------------------------------------------- multipart
def form(boundary, parts, crlf=True, close=True):
    nl = b"\r\n" if crlf else b"\n"
    out = b""
    for headers, data in parts:
        out += b"--" + boundary + nl + nl.join(headers) + nl + nl + data + nl
    if close:
        out += b"--" + boundary + b"--" + nl
    return out


def multipart(o, imgs):
    png = imgs["png"][0][1]
    b = b"----quernboundary7MA4YWxkTrZu0gW"
    ct = b"multipart/form-data; boundary=" + b
    image_part = ([b'Content-Disposition: form-data; name="image"; filename="a.png"', b"Content-Type: image/png"], png)
    conf = ([b'Content-Disposition: form-data; name="min_confidence"'], b"0.5")
    o.put("multipart", "image_and_confidence", ct + b"\n" + form(b, [image_part, conf]))
    o.put("multipart", "lf_only", ct + b"\n" + form(b, [image_part], crlf=False))
    o.put("multipart", "quoted_boundary", b'multipart/form-data; boundary="a b:c"\n' + form(b"a b:c", [conf]))
    o.put("multipart", "no_close", ct + b"\n" + form(b, [conf], close=False))
    o.put("multipart", "no_blank_line", ct + b"\n--" + b + b'\r\nContent-Disposition: form-data; name="x"\r\n')
    o.put("multipart", "preamble_padding", ct + b"\npreamble\r\n--" + b + b"  \t\r\n"
          + b'Content-Disposition: form-data; name="api_key"\r\n\r\nkey\r\n--' + b + b"--\r\nepilogue")
    o.put("multipart", "empty_parts", ct + b"\n" + form(b, [([b"Content-Disposition: form-data"], b""), ([], b"")]))
    o.put("multipart", "filename_star", ct + b"\n" + form(b, [([b"Content-Disposition: form-data; name=image; "
                                                               b"filename*=UTF-8''%e2%82%ac.png"], b"x")]))
    o.put("multipart", "no_boundary", b"multipart/form-data\n" + form(b, [conf]))
    o.put("multipart", "long_boundary", b"multipart/form-data; boundary=" + b"x" * 300 + b"\n")
    o.put("multipart", "body_only", form(b"X", [conf]))


# ---------------------------------------------------------------- config.pbtxt
FULL_CONFIG = """name: "full"
platform: "onnxruntime_onnx"
backend: "onnxruntime"
max_batch_size: 8
version_policy { specific { versions: [ 1, 3 ] } }
default_model_filename: "model.onnx"
input [
  { name: "x" data_type: TYPE_FP32 dims: [ 3, -1 ] reshape { shape: [ 3, -1 ] } optional: false },
  { name: "s" data_type: TYPE_STRING dims: [ 1 ] optional: true }
]
output [ { name: "y" data_type: TYPE_FP16 dims: [ 3 ] label_filename: "labels.txt" } ]
instance_group [ { count: 2 kind: KIND_CPU } ]
dynamic_batching {
  preferred_batch_size: [ 2, 4 ]
  max_queue_delay_microseconds: 100
  preserve_ordering: true
  priority_levels: 3
  default_priority_level: 2
  default_queue_policy { timeout_action: REJECT default_timeout_microseconds: 1000 allow_timeout_override: true max_queue_size: 16 }
  priority_queue_policy { key: 1 value { timeout_action: DELAY default_timeout_microseconds: 5 } }
}
optimization { graph { level: 1 } }
model_warmup [ { name: "w" batch_size: 2 count: 1 inputs { key: "x" value { data_type: TYPE_FP32 dims: [ 3, 4 ] random_data: true } } } ]
parameters { key: "intra_op_thread_count" value { string_value: "1" } }
parameters { key: "inter_op_thread_count" value { string_value: "1" } }
parameters { key: "allow_spinning" value { string_value: "false" } }
parameters { key: "quern.fixed_batch_sizes" value { string_value: "2,4,8" } }
parameters { key: "quern.batch_size_tuning" value { string_value: "off" } }
"""

DETECTOR_CONFIG = """max_batch_size: 8
input [ { name: "images" data_type: TYPE_FP32 dims: [ 3, 64, 64 ] } ]
output [ { name: "output0" data_type: TYPE_FP32 dims: [ 7, 32 ] label_filename: "labels.txt" } ]
dynamic_batching { }
parameters { key: "quern.task" value { string_value: "detection" } }
parameters { key: "quern.detection.format" value { string_value: "yolov8" } }
parameters { key: "quern.detection.iou_threshold" value { string_value: "0.45" } }
parameters { key: "quern.detection.max_detections" value { string_value: "100" } }
parameters { key: "quern.image.resize" value { string_value: "letterbox" } }
parameters { key: "quern.image.pad_value" value { string_value: "114" } }
"""

CLASSIFIER_CONFIG = """name: "text_direction"
backend: "onnxruntime"
max_batch_size: 32
input [ { name: "x" data_type: TYPE_FP32 dims: [ 3, 48, 192 ] } ]
output [ { name: "softmax_0.tmp_0" data_type: TYPE_FP32 dims: [ 2 ] label_filename: "labels.txt" } ]
dynamic_batching { preferred_batch_size: [ 8, 16, 32 ] max_queue_delay_microseconds: 2000 }
parameters { key: "quern.task" value { string_value: "classification" } }
parameters { key: "quern.image.resize" value { string_value: "center_crop" } }
parameters { key: "quern.image.resize_shortest" value { string_value: "56" } }
parameters { key: "quern.image.mean" value { string_value: "0.5, 0.5, 0.5" } }
parameters { key: "quern.image.std" value { string_value: "0.5, 0.5, 0.5" } }
parameters { key: "quern.image.channels" value { string_value: "BGR" } }
parameters { key: "quern.image.layout" value { string_value: "NCHW" } }
parameters { key: "quern.classification.top_k" value { string_value: "2" } }
parameters { key: "quern.classification.softmax" value { string_value: "auto" } }
"""


def model_config(o):
    c = "model_config"
    o.put(c, "full", FULL_CONFIG)
    o.put(c, "detector", DETECTOR_CONFIG)
    o.put(c, "classifier", CLASSIFIER_CONFIG)
    o.put(c, "fixed4", 'name: "fixed4"\nbackend: "onnxruntime"\nmax_batch_size: 4\n'
          'input [ { name: "x" data_type: TYPE_FP32 dims: [ 3 ] } ]\n'
          'output [ { name: "y" data_type: TYPE_FP32 dims: [ 3 ] } ]\n'
          'dynamic_batching { max_queue_delay_microseconds: 20000 }\n'
          'parameters { key: "quern.fixed_batch_sizes" value { string_value: "4" } }\n')
    o.put(c, "versions_all", "max_batch_size: 8\nversion_policy { all {} }\ndynamic_batching { }\n"
          'input [ { name: "x" data_type: TYPE_FP32 dims: [ 3 ] } ]\noutput [ { name: "y" data_type: TYPE_FP32 dims: [ 3 ] } ]\n')
    o.put(c, "latest", 'version_policy { latest { num_versions: 2 } }\n'
          'input [ { name: "x" data_type: TYPE_INT64 dims: [ -1, 2 ] } ]\noutput [ { name: "y" data_type: TYPE_BOOL dims: [ 1 ] } ]\n')
    base = 'max_batch_size: 4\ninput [ { name: "x" data_type: TYPE_FP32 dims: [ 3 ] } ]\n' \
           'output [ { name: "y" data_type: TYPE_FP32 dims: [ 3 ] } ]\n'
    o.put(c, "instances_100000", base + "instance_group [ { count: 100000 } ]\n")
    o.put(c, "intra_op_100000", base + 'parameters { key: "intra_op_thread_count" value { string_value: "100000" } }\n')
    o.put(c, "huge_dims", 'input [ { name: "x" data_type: TYPE_FP32 dims: [ 4611686018427387904, 4 ] } ]\n'
          'output [ { name: "y" data_type: TYPE_FP32 dims: [ 16, 1152921504606846976 ] } ]\n')
    o.put(c, "huge_batch", 'max_batch_size: 2147483647\ninput [ { name: "x" data_type: TYPE_FP32 dims: [ 3 ] } ]\n'
          'output [ { name: "y" data_type: TYPE_FP32 dims: [ 3 ] } ]\n'
          'dynamic_batching { preferred_batch_size: [ 2147483647 ] max_queue_delay_microseconds: 18446744073709551615 '
          'priority_levels: 4294967295 default_queue_policy { max_queue_size: 4294967295 } }\n'
          'parameters { key: "quern.fixed_batch_sizes" value { string_value: "0,-1,99999999999" } }\n')
    o.put(c, "bad_params", base + 'parameters { key: "quern.batch_size_tuning" value { string_value: "maybe" } }\n'
          'parameters { key: "allow_spinning" value { string_value: "yes" } }\n'
          'parameters { key: "quern.image.mean" value { string_value: "1,2" } }\n'
          'parameters { key: "quern.task" value { string_value: "classification" } }\n')
    o.put(c, "syntax_error", "max_batch_size: 4\ninput [ { name: \"x\" data_type: TYPE_FP32 dims: [ 3 ] }\n")
    o.put(c, "unknown_field", "max_batch_size: 4\nnot_a_field: 1\n")
    o.put(c, "deep_nesting", "dynamic_batching " + "{ " * 200 + "}" * 200 + "\n")
    o.put(c, "empty", "")


# ---------------------------------------------------------------- RESP and Redis URLs
def resp_bulk(s):
    if isinstance(s, str):
        s = s.encode()
    return b"$%d\r\n%s\r\n" % (len(s), s)


def resp_array(items):
    return b"*%d\r\n" % len(items) + b"".join(items)


def xreadgroup_reply(entries, stream="quern:jobs:add_sub"):
    es = [resp_array([resp_bulk(eid), resp_array([resp_bulk(x) for x in fields])]) for eid, fields in entries]
    return resp_array([resp_array([resp_bulk(stream), resp_array(es)])])


def resp(o):
    c = "resp"
    o.put(c, "status", b"+OK\r\n")
    o.put(c, "error", b"-ERR unknown command 'FOO'\r\n-NOGROUP No such key\r\n")
    o.put(c, "integer", b":1234\r\n:-9223372036854775808\r\n")
    o.put(c, "bulk", resp_bulk("hello") + b"$0\r\n\r\n$-1\r\n")
    o.put(c, "array", resp_array([resp_bulk("a"), b":1\r\n", b"*-1\r\n", resp_array([])]))
    o.put(c, "nested", b"*1\r\n" * 40 + b":0\r\n")
    o.put(c, "deep_nesting", b"*1\r\n" * 10000)
    o.put(c, "partial", b"*3\r\n$5\r\nhel")
    o.put(c, "huge_lengths", b"$9223372036854775807\r\n*9223372036854775807\r\n$-2\r\n*4294967296\r\n")
    o.put(c, "xreadgroup", xreadgroup_reply([("1700000000000-0", ["id", "job-1", "body", j(add_sub_body())])]))
    o.put(c, "exec", resp_array([b"+OK\r\n", b":1\r\n", b"-EXECABORT x\r\n"]))
    o.put(c, "url", b"redis://user:secret@cache.example:6380/2")
    o.put(c, "url_tls", b"rediss://:pw@[::1]:6379/0")
    o.put(c, "url_bad_port", b"redis://host:99999/x")
    o.put(c, "url_empty_host", b"redis://:6379")
    o.put(c, "command_lines", b"XADD\nquern:jobs:m\n*\nbody\n{}")


# ---------------------------------------------------------------- stream entries and result records
def stream_entry(o):
    c = "stream_entry"
    for name, hl, body in kserve_bodies():
        fields = ["id", "job-" + name, "body", body]
        if hl is not None:
            fields += ["header_length", str(hl)]
        data = b"\x01" + b"\x00".join(x if isinstance(x, bytes) else x.encode() for x in fields)
        if len(data) <= MAX_FILE:
            o.put(c, "fields_" + name, data)
    o.put(c, "fields_deadline", b"\x01" + b"\x00".join([b"body", j(add_sub_body()), b"deadline_ms", b"-5"]))
    o.put(c, "fields_header_text", b"\x01" + b"\x00".join([b"body", j(add_sub_body()), b"header_length", b"12x"]))
    o.put(c, "fields_no_body", b"\x01id\x00x")
    o.put(c, "resp_entries", b"\x00" + xreadgroup_reply([
        ("1700000000000-0", ["id", "a", "body", j(add_sub_body())]),
        ("1700000000001-0", ["body"]),
        ("bad-id", []),
    ]))
    hl, body = binary_body([("x", "FP32", [1, 4], b"\x00" * 16)])
    o.put(c, "resp_binary", b"\x00" + xreadgroup_reply([("1-1", ["body", body, "header_length", str(hl)])]))
    o.put(c, "resp_deleted", b"\x00" + resp_array([resp_array([resp_bulk("s"), resp_array([
        resp_array([resp_bulk("1-0"), b"*-1\r\n"])])])]))
    o.put(c, "resp_deep", b"\x00" + xreadgroup_reply([("1-0", ["body", DEEP_JSON[:30000]])]))
    # results:{id} records as RedisResultStore writes them.
    head = {"job_id": "j1", "status": "done", "model_name": "add_sub", "model_version": "1",
            "submitted_ms": 1, "started_ms": 2, "finished_ms": 3, "binary_data_output": False,
            "binary_outputs": {"OUTPUT0": True}}
    done = dict(head, result={"model_name": "add_sub", "model_version": "1", "outputs": [
        {"name": "OUTPUT0", "datatype": "FP32", "shape": [1, 4], "data": [1.0, 2.0, 3.0, 4.0]},
        {"name": "OUTPUT1", "datatype": "FP32", "shape": [1, 4], "parameters": {"binary_data_size": 16}}]},
        binary_keys=["results:j1:bin:0"])
    o.put(c, "record_done", b"\x02" + j(done) + b"\x00" + struct.pack("<4f", 1, 2, 3, 4))
    strings = dict(head, result={"outputs": [{"name": "s", "datatype": "BYTES", "shape": [2],
                                              "parameters": {"binary_data_size": 9}}]}, binary_keys=["k"])
    o.put(c, "record_bytes", b"\x02" + j(strings) + b"\x00" + bytes_elems(b"abc", b""))
    o.put(c, "record_failed", b"\x02" + j(dict(head, status="failed", error={
        "code": "INVALID_ARGUMENT", "grpc_code": 3, "message": "bad"})))
    o.put(c, "record_cancelled", b"\x02" + j(dict(head, status="cancelled", error={"grpc_code": 99})))
    o.put(c, "record_queued", b"\x02" + j(dict(head, status="queued")))
    o.put(c, "record_huge_shape", b"\x02" + j(dict(head, result={"outputs": [
        {"name": "s", "datatype": "BYTES", "shape": [1152921504606846976], "parameters": {"binary_data_size": 4}}]}))
        + b"\x00\x00\x00\x00\x00")
    o.put(c, "record_nonfinite", b"\x02" + j(dict(head, result={"outputs": [
        {"name": "y", "datatype": "FP32", "shape": [3], "data": [0.0, 0.0, 0.0]}]})).replace(
        b"[0.0,0.0,0.0]", b"[NaN,Infinity,-Infinity]"))
    o.put(c, "record_deep", b"\x02" + b'{"status":"done","result":{"outputs":' + DEEP_JSON[:30000])


# ---------------------------------------------------------------- gRPC ModelInferRequest
def grpc_convert(o):
    from tritonclient.grpc import service_pb2 as pb

    def req(model="add_sub", version="", **kw):
        r = pb.ModelInferRequest(model_name=model, model_version=version, id=kw.pop("id", ""))
        return r

    c = "grpc_convert"
    r = req(id="r1")
    for name in ("INPUT0", "INPUT1"):
        t = r.inputs.add(name=name, datatype="FP32", shape=[1, 4])
        r.raw_input_contents.append(struct.pack("<4f", 1, 2, 3, 4))
    r.outputs.add(name="OUTPUT0")
    r.parameters["priority"].int64_param = 1
    r.parameters["timeout"].uint64_param = 1000
    o.put(c, "raw_add_sub", r.SerializeToString())

    r = req(version="1")
    typed = [("BOOL", "bool_contents", [True, False]), ("UINT8", "uint_contents", [1, 255]),
             ("UINT16", "uint_contents", [1, 65535]), ("UINT32", "uint_contents", [1, 7]),
             ("UINT64", "uint64_contents", [1, 2**64 - 1]), ("INT8", "int_contents", [-1, 127]),
             ("INT16", "int_contents", [-1, 300]), ("INT32", "int_contents", [-1, 2**31 - 1]),
             ("INT64", "int64_contents", [-1, -2**63]), ("FP32", "fp32_contents", [1.5, -0.0]),
             ("FP64", "fp64_contents", [1e300, 2]), ("BYTES", "bytes_contents", [b"ab", b""])]
    for dtype, field, values in typed:
        t = r.inputs.add(name="in_" + dtype.lower(), datatype=dtype, shape=[2])
        getattr(t.contents, field).extend(values)
    o.put(c, "typed_all", r.SerializeToString())

    r = req()
    r.inputs.add(name="h", datatype="FP16", shape=[2]).contents.fp32_contents.extend([1, 2])
    o.put(c, "typed_fp16", r.SerializeToString())
    for i, shape in enumerate([[4611686018427387904, 4], [16, 1152921504606846976], [-1], [1] * 70]):
        r = req()
        r.inputs.add(name="x", datatype="FP32", shape=shape)
        r.raw_input_contents.append(b"\x00" * 4)
        o.put(c, "huge_shape_%d" % i, r.SerializeToString())
    r = req()
    r.inputs.add(name="s", datatype="BYTES", shape=[1152921504606846976])
    r.raw_input_contents.append(b"\x00\x00\x00\x00")
    o.put(c, "bytes_huge_shape", r.SerializeToString())
    r = req()
    r.inputs.add(name="s", datatype="BYTES", shape=[1152921504606846976]).contents.bytes_contents.append(b"x")
    o.put(c, "bytes_typed_huge_shape", r.SerializeToString())
    r = req()
    r.inputs.add(name="s", datatype="BYTES", shape=[2])
    r.raw_input_contents.append(b"\xff\xff\xff\x7fab")
    o.put(c, "bytes_bad_length", r.SerializeToString())
    r = req()
    r.inputs.add(name="a", datatype="FP32", shape=[1])
    r.inputs.add(name="b", datatype="FP32", shape=[1])
    r.raw_input_contents.append(b"\x00" * 4)
    o.put(c, "raw_count_mismatch", r.SerializeToString())
    r = req(version="x")
    o.put(c, "bad_version", r.SerializeToString())
    r = req(model="")
    o.put(c, "no_model", r.SerializeToString())
    r = req()
    r.parameters["priority"].string_param = "high"
    r.parameters["timeout"].int64_param = -5
    o.put(c, "bad_params", r.SerializeToString())


# ---------------------------------------------------------------- HTTP handlers
def http(method, target, body=b"", headers=()):
    head = ("%s %s\n" % (method, target)).encode()
    for k, v in headers:
        head += ("%s: %s\n" % (k, v)).encode()
    return head + b"\n" + body


def http_handlers(o, imgs):
    c = "http_handlers"
    gets = ["/v2/health/live", "/v2/health/ready", "/v2", "/v2/models/add_sub", "/v2/models/add_sub/ready",
            "/v2/models/add_sub/config", "/v2/models/versions/versions/2", "/v2/models/versions/versions/x/ready",
            "/v2/models/stats", "/v2/models/add_sub/stats", "/v2/models/nope", "/v2/models/dtypes/config",
            "/v2/jobs/$JOB", "/v2/jobs/$JOB?binary_data_output=true", "/v2/jobs/00000000-x", "/v1/status/ping",
            "/v2/models/my%20model/ready", "/v2/models/add_sub/infer", "/", "/v2/models//ready?x=1"]
    for i, t in enumerate(gets):
        o.put(c, "get_%02d" % i, http("GET", t))
    o.put(c, "index", http("POST", "/v2/repository/index", b"{}"))
    o.put(c, "unload", http("POST", "/v2/repository/models/add_sub/unload", b"{}"))
    o.put(c, "load", http("POST", "/v2/repository/models/tile4/load"))
    o.put(c, "load_config", http("POST", "/v2/repository/models/nobatch/load", j(
        {"parameters": {"config": json.dumps({"max_batch_size": 0})}})))
    o.put(c, "load_unknown", http("POST", "/v2/repository/models/nope/load"))
    o.put(c, "load_parent", http("POST", "/v2/repository/models/..%2F..%2Fetc/load"))
    o.put(c, "load_absolute", http("POST", "/v2/repository/models/%2Ftmp/load"))
    o.put(c, "delete_job", http("DELETE", "/v2/jobs/$JOB"))
    o.put(c, "unknown_method", http("BREW", "/v2/models/add_sub"))
    o.put(c, "head", http("HEAD", "/v2/health/live"))
    o.put(c, "infer", http("POST", "/v2/models/add_sub/infer", j(add_sub_body())))
    o.put(c, "infer_version", http("POST", "/v2/models/versions/versions/2/infer", j(
        {"inputs": [{"name": "x", "shape": [1, 3], "datatype": "FP32", "data": [1, 2, 3]}]})))
    o.put(c, "infer_nobatch", http("POST", "/v2/models/nobatch/infer", j(
        {"inputs": [{"name": "x", "shape": [2, 3], "datatype": "FP32", "data": [1, 2, 3, 4, 5, 6]}]})))
    o.put(c, "infer_fixed4", http("POST", "/v2/models/fixed4/infer", j(
        {"inputs": [{"name": "x", "shape": [1, 3], "datatype": "FP32", "data": [1, 2, 3]}]})))
    o.put(c, "infer_tile4", http("POST", "/v2/models/tile4/infer", j(
        {"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]}],
         "parameters": {"binary_data_output": True}})))
    o.put(c, "infer_fail_on_3", http("POST", "/v2/models/fail_on_3/infer", j(
        {"inputs": [{"name": "x", "shape": [1, 3], "datatype": "FP32", "data": [1, 2, 3]}]})))
    dt = [{"name": "in_" + n, "shape": [1, 2], "datatype": d, "data": v} for n, d, v in [
        ("bool", "BOOL", [True, False]), ("uint8", "UINT8", [1, 2]), ("int8", "INT8", [-1, 2]),
        ("int32", "INT32", [1, 2]), ("int64", "INT64", [1, 2]), ("fp16", "FP16", [1, 2]),
        ("fp32", "FP32", [1, 2]), ("fp64", "FP64", [1, 2]), ("string", "BYTES", ["a", "bc"])]]
    o.put(c, "infer_dtypes", http("POST", "/v2/models/dtypes/infer", j({"inputs": dt})))
    hl, body = binary_body([("in_string", "BYTES", [1, 2], bytes_elems(b"x", b"yz"))] +
                           [("in_" + n, d, [1, 2], b"\x00" * (2 * s)) for n, d, s in [
                               ("bool", "BOOL", 1), ("uint8", "UINT8", 1), ("int8", "INT8", 1), ("int32", "INT32", 4),
                               ("int64", "INT64", 8), ("fp16", "FP16", 2), ("fp32", "FP32", 4),
                               ("fp64", "FP64", 8)]], params={"binary_data_output": True})
    o.put(c, "infer_dtypes_binary", http("POST", "/v2/models/dtypes/infer", body,
                                         [("Inference-Header-Content-Length", hl),
                                          ("Content-Type", "application/octet-stream")]))
    hl, body = binary_body([("in_string", "BYTES", [1152921504606846976, 2], b"\x00\x00\x00\x00")])
    o.put(c, "infer_bytes_huge_shape", http("POST", "/v2/models/dtypes/infer", body,
                                            [("Inference-Header-Content-Length", hl)]))
    for i, b in enumerate(HUGE_SHAPES[:2]):
        o.put(c, "infer_huge_shape_%d" % i, http("POST", "/v2/models/add_sub/infer", j(b)))
    o.put(c, "infer_deep", http("POST", "/v2/models/add_sub/infer", DEEP_JSON))
    o.put(c, "jobs_deep", http("POST", "/v2/models/add_sub/jobs", DEEP_JSON))
    o.put(c, "predict_deep", http("POST", "/predict/classify", DEEP_JSON))
    o.put(c, "job_submit", http("POST", "/v2/models/add_sub/jobs", j(add_sub_body(
        parameters={"binary_data_output": True}))))
    o.put(c, "job_submit_version", http("POST", "/v2/models/versions/versions/1/jobs", j(
        {"inputs": [{"name": "x", "shape": [1, 3], "datatype": "FP32", "data": [1, 2, 3]}]})))
    png = image("PNG", (64, 64))
    jpeg = image("JPEG", (40, 30), quality=50)
    b = "quernfuzzboundary"
    parts = [([b'Content-Disposition: form-data; name="image"; filename="a.png"', b"Content-Type: image/png"], png),
             ([b'Content-Disposition: form-data; name="min_confidence"'], b"0.1")]
    ct = [("Content-Type", "multipart/form-data; boundary=" + b)]
    o.put(c, "vision_detection", http("POST", "/v1/vision/detection", form(b.encode(), parts), ct))
    parts[0] = ([b'Content-Disposition: form-data; name="image"; filename="a.jpg"'], jpeg)
    o.put(c, "vision_custom", http("POST", "/v1/vision/custom/detect_yolov8", form(b.encode(), parts), ct))
    o.put(c, "vision_custom_classifier", http("POST", "/v1/vision/custom/classify", form(b.encode(), parts), ct))
    o.put(c, "vision_list", http("POST", "/v1/vision/custom/list"))
    o.put(c, "vision_truncated", http("POST", "/v1/vision/detection", form(b.encode(), [
        ([b'Content-Disposition: form-data; name="image"'], imgs["jpeg"][0][1][:100])]), ct))
    o.put(c, "vision_bad_confidence", http("POST", "/v1/vision/custom/detect_detr", form(b.encode(), [
        parts[0], ([b'Content-Disposition: form-data; name="min_confidence"'], b"1e9")]), ct))
    o.put(c, "predict", http("POST", "/predict/classify", j({"image": base64.b64encode(png).decode()})))
    o.put(c, "predict_data_url", http("POST", "/predict/classify", j(
        {"image": "data:image/jpeg;base64," + base64.b64encode(jpeg).decode()})))
    o.put(c, "predict_detector", http("POST", "/predict/detect_yolov8", j({"image": "!!!"})))
    o.put(c, "predict_bmp", http("POST", "/predict/classify", j({"image": base64.b64encode(imgs["bmp"][0][1]).decode()})))
    o.put(c, "bare_target", b"/v2/health/ready")


def job_record(o):
    """Stored job records (the JSON, then binary parts each after "\\n--part--\\n")."""
    c = "job_record"
    sep = b"\n--part--\n"
    base = {"job_id": "019000000000-" + "0" * 32, "model_name": "m", "model_version": "1", "submitted_ms": 1,
            "started_ms": 2, "finished_ms": 3, "binary_data_output": False, "binary_outputs": {}}
    small = {"name": "y", "datatype": "FP32", "shape": [1, 3], "data": [1.5, -2.25, 3.0]}
    binary = {"name": "z", "datatype": "INT32", "shape": [2], "parameters": {"binary_data_size": 8}}
    o.put(c, "done", j(dict(base, status="done", result={"model_name": "m", "model_version": "1",
                                                          "outputs": [small, binary]}, binary_keys=["k0"]))
          + sep + struct.pack("<ii", 7, -7))
    o.put(c, "decoupled", j(dict(base, status="done", responses=[
        {"model_name": "m", "model_version": "1", "outputs": [small]},
        {"model_name": "m", "model_version": "1", "outputs": [binary]},
        {"model_name": "m", "model_version": "1", "outputs": []}], binary_keys=["k0"]))
          + sep + struct.pack("<ii", 1, 2))
    o.put(c, "decoupled_strings", j(dict(base, status="done", responses=[
        {"outputs": [{"name": "t", "datatype": "BYTES", "shape": [2], "data": ["a", "\u00e9"]}]}])))
    o.put(c, "failed", j(dict(base, status="failed", error={"code": "INVALID_ARGUMENT", "grpc_code": 3,
                                                            "message": "bad"})))
    o.put(c, "queued", j(dict(base, status="queued")))
    o.put(c, "parts_left_over", j(dict(base, status="done", result={"outputs": []})) + sep + b"x" + sep + b"y")
    o.put(c, "nan", b'{"job_id":"x","status":"done","model_name":"m","result":{"outputs":[{"name":"y",'
                    b'"datatype":"FP64","shape":[2],"data":[NaN,Infinity]}]}}')


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus"))
    args = ap.parse_args()
    o = Out(args.out)
    imgs = images()
    kserve_infer(o)
    image_targets(o, imgs)
    multipart(o, imgs)
    model_config(o)
    resp(o)
    stream_entry(o)
    job_record(o)
    grpc_convert(o)
    http_handlers(o, imgs)


if __name__ == "__main__":
    main()
