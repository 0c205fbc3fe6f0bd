"""The real CenterFace face detector (examples/models/faces, fetched and converted by
scripts/setup.sh) on a real photograph: matplotlib's sample portrait of Grace Hopper (512x600,
examples/data/grace_hopper.jpg), through POST /v1/vision/custom/faces.

What the photograph shows, read by a person looking at it: one face, seen from the front, under a
naval cap; from the brow to the chin it spans about y 130-340, from cheek to cheek (ears included)
about x 160-375; the nose tip is near (262, 245). Nothing else in the picture is a face (a flag,
a uniform, ribbons, a name tag).

Beside that reading, an independent reference: onnxruntime (PyPI) runs the same model file on the
same pixels, letterboxed into 640x480 by numpy (the documented bilinear arithmetic) and decoded by
numpy (CenterFace's heatmap, sizes and offsets at stride 4; NMS at IoU 0.3); Quern must agree within
1 px and 1e-3 (PNG inputs, which decode to the same pixels everywhere)."""
import http.client
import io
import json
import os
import shutil
import uuid

import numpy as np
import pytest
from PIL import Image

from quern_testing import iou, resample, start_quern
from test_postprocess import centerface_candidates

QUERN = os.environ["QUERN_BIN"]
ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
MODEL = os.path.join(ROOT, "examples", "models", "faces")
PHOTO = os.path.join(ROOT, "examples", "data", "grace_hopper.jpg")


@pytest.fixture(scope="module")
def port(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    shutil.copytree(MODEL, repo / "faces")
    proc, ports = start_quern(QUERN, str(repo))
    yield ports["HTTP"]
    proc.terminate()
    proc.wait(timeout=30)


def post(port, path, image_bytes, name="a.jpg"):
    boundary = uuid.uuid4().hex
    body = (f'--{boundary}\r\nContent-Disposition: form-data; name="image"; filename="{name}"\r\n\r\n'.encode() +
            image_bytes + f"\r\n--{boundary}--\r\n".encode())
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    c.request("POST", path, body, {"Content-Type": f"multipart/form-data; boundary={boundary}"})
    r = c.getresponse()
    data = json.loads(r.read())
    c.close()
    assert r.status == 200, data
    return data


def faces(port, image_bytes, name="photo.jpg"):
    data = post(port, "/v1/vision/custom/faces", image_bytes, name)
    assert data["success"] is True, data
    return data["predictions"]


def photo():
    with open(PHOTO, "rb") as f:
        return f.read()


def test_the_one_face_in_the_portrait_is_found_where_it_is(port):
    found = faces(port, photo())
    assert len(found) == 1, found
    f = found[0]
    assert f["label"] == "face" and f["confidence"] > 0.6, f
    assert f["x_min"] < 262 < f["x_max"] and f["y_min"] < 245 < f["y_max"], f  # around the nose
    assert 130 <= f["x_min"] <= 220 and 310 <= f["x_max"] <= 410, f  # cheek to cheek, 160-375
    assert 70 <= f["y_min"] <= 170 and 300 <= f["y_max"] <= 400, f  # brow to chin, 130-340


def test_a_mirrored_portrait_gives_the_mirrored_face(port):
    img = Image.open(io.BytesIO(photo())).transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    buf = io.BytesIO()
    img.save(buf, "PNG")
    found = faces(port, buf.getvalue(), "mirrored.png")
    assert len(found) == 1, found
    f = found[0]
    assert f["x_min"] < 512 - 262 < f["x_max"] and f["y_min"] < 245 < f["y_max"], f
    assert 512 - 410 <= f["x_min"] <= 512 - 310 and 512 - 220 <= f["x_max"] <= 512 - 130, f


def test_no_face_in_a_picture_without_one(port):
    img = Image.open(io.BytesIO(photo())).crop((0, 420, 512, 600))  # the uniform and ribbons below the chin
    buf = io.BytesIO()
    img.save(buf, "PNG")
    assert faces(port, buf.getvalue(), "uniform.png") == []


def test_the_face_route_finds_faces_and_the_detection_route_leaves_the_face_model_alone(port, tmp_path):
    r = post(port, "/v1/vision/face", photo())
    assert r["success"] is True and r["command"] == "face" and len(r["predictions"]) == 1, r
    assert r["predictions"][0] == faces(port, photo())[0]  # the same as the model's own route
    # /v1/vision/detection's default is an object detector, never the face model.
    r = post(port, "/v1/vision/detection", photo())
    assert r["success"] is False and "no detection model" in r["error"], r
    # Beside an object detector: the detection route takes the detector, the face route the faces.
    repo = tmp_path / "repo"
    shutil.copytree(MODEL, repo / "faces")
    shutil.copytree(os.path.join(os.environ["QUERN_TEST_MODELS"], "detect_yolov8"), repo / "detect_yolov8")
    proc, ports = start_quern(QUERN, str(repo))
    try:
        detected = post(ports["HTTP"], "/v1/vision/detection", photo())
        assert detected["success"] is True and all(p["label"] != "face" for p in detected["predictions"]), detected
        found = post(ports["HTTP"], "/v1/vision/face", photo())
        assert found["success"] is True and [p["label"] for p in found["predictions"]] == ["face"], found
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_no_face_model_is_said_plainly(tmp_path):
    repo = tmp_path / "repo"
    shutil.copytree(os.path.join(os.environ["QUERN_TEST_MODELS"], "detect_yolov8"), repo / "detect_yolov8")
    proc, ports = start_quern(QUERN, str(repo))
    try:
        r = post(ports["HTTP"], "/v1/vision/face", photo())
        assert r["success"] is False and "no face model" in r["error"], r
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def reference_faces(rgb, threshold=0.4):
    """CenterFace by onnxruntime on `rgb` letterboxed into 640x480 (pad 114), boxes in rgb's pixels."""
    import onnxruntime
    h, w, _ = rgb.shape
    s = min(640 / w, 480 / h)
    ox, oy = np.floor((640 - round(w * s)) / 2 + 1e-9), np.floor((480 - round(h * s)) / 2 + 1e-9)
    x = resample(rgb, 640, 480, s, s, ox, oy).astype(np.float32).transpose(2, 0, 1)[None]
    session = onnxruntime.InferenceSession(os.path.join(MODEL, "1", "model.onnx"), providers=["CPUExecutionProvider"])
    heat, size, offset, _ = (o[0] for o in session.run(["537", "538", "539", "540"], {"input.1": x}))
    xyxy, conf = centerface_candidates(heat, size, offset, threshold)
    kept = []
    for i in np.argsort(-conf, kind="stable"):
        if all(iou(xyxy[j], xyxy[i]) <= 0.3 for j in kept):
            kept.append(i)
    out = []
    for i in kept:
        x0, y0, x1, y1 = (float(v) for v in xyxy[i])
        box = [(x0 - ox) / s, (y0 - oy) / s, (x1 - ox) / s, (y1 - oy) / s]
        box = [int(np.floor(min(max(v, 0.0), lim) + 0.5)) for v, lim in zip(box, (w, h, w, h))]
        out.append((float(conf[i]), box))
    return out


@pytest.mark.parametrize("name", ["grace_hopper.jpg", "obama2.jpg"])
def test_faces_agree_with_onnxruntime_and_numpy(port, name):
    img = Image.open(os.path.join(ROOT, "examples", "data", name)).convert("RGB")
    if img.width > 640 or img.height > 480:  # under twice the letterbox's size: bilinear, as the reference
        img = img.resize((img.width * 600 // img.height, 600), Image.LANCZOS)
    buf = io.BytesIO()
    img.save(buf, "PNG")
    expected = reference_faces(np.asarray(img))
    assert expected, "the reference found no face"
    found = faces(port, buf.getvalue(), "photo.png")
    assert len(found) == len(expected), (found, expected)
    for f, (conf, box) in zip(found, expected):
        assert abs(f["confidence"] - conf) <= 1e-3, (f, conf)
        assert all(abs(a - b) <= 1 for a, b in zip((f["x_min"], f["y_min"], f["x_max"], f["y_max"]), box)), (f, box)
