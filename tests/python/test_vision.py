"""The CodeProject.AI / DeepStack detection API and /predict against a real `quern serve`.

The detection models are synthetic (scripts/gen_models.py): a 64x64 letterboxed input cut into a 4x4 grid of
16-pixel cells, class c's score for a cell = mean of colour channel c over it. The tests paint coloured squares
on cells of images of several sizes and formats, and compute the expected boxes in the original image's pixels
with their own letterbox arithmetic. /predict is checked with the real PP-OCR text-direction classifier."""
import base64
import http.client
import io
import json
import math
import os
import re
import shutil
import socket
import threading
import time
import uuid

import numpy as np
import pytest
from PIL import Image, ImageDraw, ImageFont

from quern_testing import start_quern, wait_until

QUERN = os.environ["QUERN_BIN"]
MODELS = os.environ["QUERN_TEST_MODELS"]
EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "models")
SIZE, CELL = 64, 16
CPAI_FIELDS = {"success", "message", "error", "predictions", "count", "command", "moduleId", "moduleName",
               "executionProvider", "canUseGPU", "inferenceMs", "processMs", "analysisRoundTripMs", "processedBy",
               "timestampUTC", "requestId"}


def start(repo, *extra):
    proc, ports = start_quern(QUERN, repo, *extra)
    return proc, ports["HTTP"], ports["metrics"]


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    d = tmp_path_factory.mktemp("repo")
    for m in ("detect_yolov5", "detect_yolov8", "detect_detr", "detect_slow", "add_sub", "detect_yolov5_slices"):
        shutil.copytree(os.path.join(MODELS, m), d / m)
    shutil.copytree(os.path.join(EXAMPLES, "text_direction"), d / "text_direction")
    return str(d)


@pytest.fixture(scope="module")
def server(repo):
    proc, port, metrics = start(repo, "--detection-model", "detect_yolov8", "--vision-max-image-pixels", "3000000")
    yield port
    proc.terminate()
    proc.wait(timeout=30)


def request(port, method, path, body=b"", headers=None):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    c.request(method, path, body=body, headers=headers or {})
    r = c.getresponse()
    data = r.read()
    out = (r.status, dict((k.lower(), v) for k, v in r.getheaders()), data)
    c.close()
    return out


def multipart(fields):
    """fields: list of (name, value bytes, filename or None)."""
    boundary = uuid.uuid4().hex
    body = b""
    for name, value, filename in fields:
        disp = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        body += f"--{boundary}\r\nContent-Disposition: {disp}\r\n".encode()
        if filename:
            body += b"Content-Type: application/octet-stream\r\n"
        body += b"\r\n" + value + b"\r\n"
    body += f"--{boundary}--\r\n".encode()
    return body, {"Content-Type": f"multipart/form-data; boundary={boundary}"}


def detect(port, image_bytes, path="/v1/vision/detection", min_confidence=None, extra=()):
    fields = [("image", image_bytes, "frame.jpg")] + list(extra)
    if min_confidence is not None:
        fields.append(("min_confidence", str(min_confidence).encode(), None))
    body, headers = multipart(fields)
    status, h, data = request(port, "POST", path, body, headers)
    assert status == 200, data
    assert "content-length" in h and "chunked" not in h.get("transfer-encoding", "")
    return json.loads(data)


# ---------------------------------------------------------------- expected values, computed here

def letterbox(w, h):
    s = min(SIZE / w, SIZE / h)
    return s, math.floor((SIZE - round(w * s)) / 2), math.floor((SIZE - round(h * s)) / 2)


def cell_in_source(w, h, gx, gy, grow=0):
    """The source-pixel box of grid cell (gx, gy) (grown by `grow` model pixels per side), clipped."""
    s, ox, oy = letterbox(w, h)
    x0, y0 = gx * CELL - grow, gy * CELL - grow
    x1, y1 = x0 + CELL + 2 * grow, y0 + CELL + 2 * grow
    return (max(0, (x0 - ox) / s), max(0, (y0 - oy) / s), min(w, (x1 - ox) / s), min(h, (y1 - oy) / s))


def painted(w, h, squares):
    """A black w x h image with each (gx, gy, rgb) cell painted."""
    img = Image.new("RGB", (w, h), (0, 0, 0))
    draw = ImageDraw.Draw(img)
    for gx, gy, rgb in squares:
        x0, y0, x1, y1 = cell_in_source(w, h, gx, gy)
        draw.rectangle([x0, y0, x1 - 1, y1 - 1], fill=rgb)
    return img


def encode(img, fmt, **kw):
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def expected(w, h, squares, layout, min_confidence=0.4):
    """(label, confidence, box) for every painted square, best first; NMS leaves only the cell's own box."""
    labels = ["red", "green", "blue"]
    out = []
    for gx, gy, rgb in squares:
        for c in range(3):
            mean = rgb[c] / 255.0
            conf = 1 / (1 + math.exp(-10 * (mean - 0.5))) if layout == "detr" else mean
            if conf >= min_confidence:
                out.append((labels[c], conf, tuple(round(v) for v in cell_in_source(w, h, gx, gy))))
    return sorted(out, key=lambda e: -e[1])


def check(result, want, tol=0.03):
    assert result["success"] is True, result
    got = [(p["label"], p["confidence"], (p["x_min"], p["y_min"], p["x_max"], p["y_max"])) for p in result["predictions"]]
    assert result["count"] == len(got)
    assert len(got) == len(want), (got, want)
    got_sorted = sorted(got, key=lambda e: (e[0], e[2]))
    want_sorted = sorted(want, key=lambda e: (e[0], e[2]))
    for g, e in zip(got_sorted, want_sorted):
        assert g[0] == e[0] and g[2] == e[2], (got, want)
        assert abs(g[1] - e[1]) < tol, (got, want)


SQUARES = [(2, 1, (255, 0, 0)), (1, 2, (0, 0, 255))]  # cells inside the image at every tested size


# ---------------------------------------------------------------- tests

@pytest.mark.parametrize("layout", ["yolov5", "yolov8", "detr"])
@pytest.mark.parametrize("w,h", [(128, 96), (96, 128), (640, 480), (64, 64)])
def test_detection_layouts_sizes_and_coordinates(server, layout, w, h):
    img = painted(w, h, SQUARES)
    r = detect(server, encode(img, "PNG"), path=f"/v1/vision/custom/detect_{layout}")
    check(r, expected(w, h, SQUARES, layout))
    assert r["command"] == "custom"


def test_yolov5_head_exported_with_slice_ops(server):
    """A YOLOv5 Detect head whose export cuts xy, wh and scores apart with Slice ops per level: ONNX
    Runtime 1.21 refused to load it (duplicate /GatherSliceToSplitFusion/ node names); it loads and
    answers the same boxes as the plain head."""
    img = painted(128, 96, SQUARES)
    r = detect(server, encode(img, "PNG"), path="/v1/vision/custom/detect_yolov5_slices")
    check(r, expected(128, 96, SQUARES, "yolov5"))


@pytest.mark.parametrize("fmt,kw,tol", [("JPEG", {"quality": 95, "subsampling": 0}, 0.05), ("PNG", {}, 0.01), ("BMP", {}, 0.01),
                                        ("WEBP", {"lossless": True}, 0.01)])
def test_every_image_format(server, fmt, kw, tol):
    img = painted(640, 480, SQUARES)
    r = detect(server, encode(img, fmt, **kw))  # /v1/vision/detection: --detection-model detect_yolov8
    check(r, expected(640, 480, SQUARES, "yolov8"), tol)
    assert r["command"] == "detect"


def test_large_jpeg_decoded_with_dct_scaling_keeps_coordinates(server):
    img = painted(1920, 1080, [(1, 2, (255, 0, 0))])  # 1920x1080 letterboxes to 64x36 (offset 14)
    r = detect(server, encode(img, "JPEG", quality=95, subsampling=0))
    check(r, expected(1920, 1080, [(1, 2, (255, 0, 0))], "yolov8"), 0.05)


def test_exif_orientation_is_applied(server):
    shown = painted(128, 96, SQUARES)
    stored = shown.transpose(Image.Transpose.ROTATE_90)  # counter-clockwise; orientation 6 turns it back
    exif = Image.Exif()
    exif[0x0112] = 6
    r = detect(server, encode(stored, "JPEG", quality=95, subsampling=0, exif=exif.tobytes()))
    check(r, expected(128, 96, SQUARES, "yolov8"), 0.05)


def test_min_confidence_threshold(server):
    squares = SQUARES + [(3, 2, (153, 0, 0))]  # a dark red square scores 0.6
    img = encode(painted(128, 96, squares), "PNG")
    check(detect(server, img, min_confidence=0.5), expected(128, 96, squares, "yolov8", 0.5))
    check(detect(server, img, min_confidence=0.7), expected(128, 96, squares, "yolov8", 0.7))
    assert len(detect(server, img, min_confidence=0.5)["predictions"]) == 3
    assert len(detect(server, img, min_confidence=0.7)["predictions"]) == 2


def test_response_field_set(server):
    ok = detect(server, encode(painted(128, 96, SQUARES), "PNG"))
    assert set(ok) == CPAI_FIELDS
    assert ok["error"] is None and ok["moduleId"] == "quern" and re.match(r"[0-9a-f-]{36}$", ok["requestId"])
    assert ok["analysisRoundTripMs"] >= ok["processMs"] >= ok["inferenceMs"] >= 0
    p = ok["predictions"][0]
    assert set(p) == {"label", "confidence", "x_min", "y_min", "x_max", "y_max"}
    assert all(isinstance(p[k], int) for k in ("x_min", "y_min", "x_max", "y_max"))
    bad = detect(server, b"not an image at all")
    assert set(bad) == CPAI_FIELDS
    assert bad["success"] is False and bad["predictions"] == [] and bad["count"] == 0


def test_errors_come_back_the_codeproject_way(server):
    jpeg = encode(painted(128, 96, SQUARES), "JPEG")
    rng = np.random.default_rng(0)
    noise = Image.fromarray(rng.integers(0, 255, (480, 640, 3), dtype=np.uint8))
    noisy, png = encode(noise, "JPEG"), encode(noise, "PNG")
    bmp, webp = encode(noise, "BMP"), encode(noise, "WEBP", quality=80)
    cases = [
        (multipart([("min_confidence", b"0.5", None)]), "no image was sent"),
        (multipart([("image", b"", "empty.jpg")]), "empty"),
        (multipart([("image", b"GIF89a not a GIF at all", "x.gif")]), "GIF images (animated or not) are not supported"),
        (multipart([("image", jpeg[: len(jpeg) // 2], "cut.jpg")]), "corrupt or truncated JPEG"),
        (multipart([("image", noisy[: len(noisy) * 3 // 5], "cut.jpg")]), "corrupt or truncated JPEG"),
        (multipart([("image", png[: len(png) * 3 // 5], "cut.png")]), "corrupt or truncated PNG"),
        (multipart([("image", bmp[: len(bmp) * 3 // 5], "cut.bmp")]), "corrupt or truncated BMP"),
        (multipart([("image", bmp[:40], "cut.bmp")]), "corrupt or truncated BMP"),
        (multipart([("image", webp[: len(webp) * 3 // 5], "cut.webp")]), "corrupt or truncated WebP"),
        (multipart([("image", webp[:20], "cut.webp")]), "corrupt or truncated WebP"),
        (multipart([("image", encode(Image.new("RGB", (2000, 2000)), "PNG"), "big.png")]), "over the limit"),
        ((jpeg, {"Content-Type": "image/jpeg"}), "multipart/form-data"),
    ]
    for (body, headers), needle in cases:
        status, h, data = request(server, "POST", "/v1/vision/detection", body, headers)
        assert status == 200 and "content-length" in h
        r = json.loads(data)
        assert r["success"] is False and needle in r["error"], (needle, r)
    body, headers = multipart([("image", jpeg, "a.jpg")])
    r = json.loads(request(server, "POST", "/v1/vision/custom/no_such_model", body, headers)[2])
    assert r["success"] is False and "no_such_model" in r["error"]
    r = json.loads(request(server, "POST", "/v1/vision/custom/add_sub", body, headers)[2])
    assert r["success"] is False and "no image pipeline" in r["error"]
    # A multipart body cut short (no closing boundary).
    r = json.loads(request(server, "POST", "/v1/vision/detection", body[:-20], headers)[2])
    assert r["success"] is False and "closing boundary" in r["error"]


def test_min_confidence_is_read_the_codeproject_way(server):
    """Surrounding whitespace is ignored; empty or unparsable gives the default 0.4, not an error; a
    threshold above 1 keeps nothing (not even confidence 1.0)."""
    squares = SQUARES + [(3, 2, (153, 0, 0))]  # a dark red square scores 0.6
    img = encode(painted(128, 96, squares), "PNG")
    check(detect(server, img, min_confidence=" 0.7\t"), expected(128, 96, squares, "yolov8", 0.7))
    for v in ("", "  ", "abc", "0,5", "nan"):
        r = detect(server, img, min_confidence=v)
        assert r["success"] is True, (v, r)
        check(r, expected(128, 96, squares, "yolov8", 0.4))
    r = detect(server, img, min_confidence="1.5")
    assert r["success"] is True and r["predictions"] == [] and r["count"] == 0, r


def test_predictions_come_best_first_and_max_predictions_keeps_the_best(server, repo):
    squares = SQUARES + [(3, 2, (153, 0, 0))]  # two pure squares score 1.0, a dark red one 0.6
    img = encode(painted(128, 96, squares), "PNG")
    everything = detect(server, img)
    conf = [p["confidence"] for p in everything["predictions"]]
    assert len(conf) == 3 and conf == sorted(conf, reverse=True), conf
    proc, port, _ = start(repo, "--detection-model", "detect_yolov8", "--vision-max-predictions", "2")
    try:
        r = detect(port, img)
        assert r["count"] == 2 and len(r["predictions"]) == 2, r
        assert all(p["confidence"] > 0.9 for p in r["predictions"]), r  # the 0.6 one is left out
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_list_and_ping(server):
    for method in ("POST", "GET"):  # Blue Iris probes the list with both
        status, _, data = request(server, method, "/v1/vision/custom/list")
        r = json.loads(data)
        assert status == 200 and r["success"] is True, (method, r)
        assert sorted(r["models"]) == ["detect_detr", "detect_slow", "detect_yolov5", "detect_yolov5_slices",
                                       "detect_yolov8"]
    status, _, data = request(server, "GET", "/v1/status/ping")
    assert status == 200 and json.loads(data)["success"] is True


def text_image(flipped):
    font = ImageFont.load_default(size=30)
    text = "Quern 2026 hello"
    left, top, right, bottom = font.getbbox(text)
    img = Image.new("RGB", (right + 16, 48), "white")
    ImageDraw.Draw(img).text((8, (48 - bottom - top) // 2), text, fill="black", font=font)
    if flipped:
        img = img.rotate(180)
    w = min(192, round(img.width * 48 / img.height))
    canvas = Image.new("RGB", (192, 48), (128, 128, 128))
    canvas.paste(img.resize((w, 48), Image.BILINEAR), (0, 0))
    return encode(canvas, "PNG")


def predict(port, model, image_bytes):
    body = json.dumps({"image": base64.b64encode(image_bytes).decode()}).encode()
    return request(port, "POST", f"/predict/{model}", body, {"Content-Type": "application/json"})


def test_predict_real_text_direction_model(server):
    results = {}
    for flipped in (False, True):
        status, _, data = predict(server, "text_direction", text_image(flipped))
        assert status == 200, data
        r = json.loads(data)
        preds = r["predictions"]
        assert [p["label"] for p in preds] in (["0", "180"], ["180", "0"])
        assert {p["class_id"] for p in preds} == {0, 1}
        assert abs(sum(p["confidence"] for p in preds) - 1) < 1e-4  # already probabilities: no second softmax
        assert preds[0]["confidence"] >= preds[1]["confidence"]
        assert r["inference_time_ms"] > 0
        results[flipped] = preds[0]["label"]
    assert results == {False: "0", True: "180"}


def scene(port, image_bytes):
    body, headers = multipart([("image", image_bytes, "scene.png")])
    status, _, data = request(port, "POST", "/v1/vision/scene", body, headers)
    assert status == 200, data
    return json.loads(data)


def test_scene_runs_the_configured_classification_model(repo):
    proc, port, _ = start(repo, "--scene-model", "text_direction")
    try:
        for flipped, label in ((False, "0"), (True, "180")):
            r = scene(port, text_image(flipped))
            assert r["success"] is True and r["label"] == label and 0.5 < r["confidence"] <= 1, r
            assert r["error"] is None and r["command"] == "scene", r
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    proc, port, _ = start(repo, "--scene-model", "detect_yolov8")
    try:
        r = scene(port, text_image(False))
        assert r["success"] is False and "not a classification model" in r["error"], r
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_scene_without_a_scene_model_says_what_is_missing(server):
    r = scene(server, text_image(False))
    assert r["success"] is False and "--scene-model" in r["error"], r
    body, headers = multipart([("image", text_image(False), "a.png")])
    r = json.loads(request(server, "POST", "/v1/vision/face/enroll", body, headers)[2])
    assert r["success"] is False and "no vision route /v1/vision/face/enroll" in r["error"], r


def test_predict_errors(server):
    status, _, data = request(server, "POST", "/predict/text_direction", b"{not json", {})
    assert status == 400 and "JSON" in json.loads(data)["error"]
    status, _, data = request(server, "POST", "/predict/text_direction", b'{"image": "***"}', {})
    assert status == 400 and "base64" in json.loads(data)["error"]
    status, _, data = predict(server, "text_direction", b"garbage")
    assert status == 400 and "not an image" in json.loads(data)["error"]
    status, _, data = predict(server, "nope", text_image(False))
    assert status == 404 and "nope" in json.loads(data)["error"]
    status, _, data = predict(server, "detect_yolov8", text_image(False))
    assert status == 400 and "detection model" in json.loads(data)["error"]


def test_concurrent_clients_get_their_own_boxes(server):
    errors = []

    def client(i):
        gx, gy = i % 4, 1 + i % 2
        squares = [(gx, gy, (255, 0, 0))]
        try:
            for _ in range(5):
                check(detect(server, encode(painted(128, 96, squares), "PNG")), expected(128, 96, squares, "yolov8"))
        except AssertionError as e:
            errors.append(e)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


def metric(port, name):
    data = request(port, "GET", "/metrics")[2].decode()
    m = re.search(rf"^{name} (\S+)$", data, re.M)
    return float(m.group(1)) if m else None


def test_overload_refuses_at_once_and_timeouts_drop_before_inference(tmp_path):
    # detect_slow here waits up to 60 s for a batch: its image is in flight until the 4 s timeout
    # drops it, time enough for the steps below on a loaded machine (with 400 ms it expired before
    # them now and then, and the head sent last was then admitted).
    repo = tmp_path / "repo"
    for m in ("detect_yolov8", "detect_slow"):
        shutil.copytree(os.path.join(MODELS, m), repo / m)
    config = repo / "detect_slow" / "config.pbtxt"
    text = config.read_text()
    assert "max_queue_delay_microseconds: 1000000" in text
    config.write_text(text.replace("max_queue_delay_microseconds: 1000000", "max_queue_delay_microseconds: 60000000"))
    proc, port, metrics = start(str(repo), "--vision-queue-capacity", "1", "--vision-timeout-ms", "4000")
    try:
        img = encode(painted(128, 96, SQUARES), "PNG")
        results = {}

        def slow():  # detect_slow waits up to 60 s for a batch: past the 4 s timeout
            results["slow"] = detect(port, img, path="/v1/vision/custom/detect_slow")

        t = threading.Thread(target=slow)
        t.start()
        wait_for = time.time() + 10
        while metric(metrics, "quern_vision_in_flight") != 1 and time.time() < wait_for:
            time.sleep(0.02)
        assert metric(metrics, "quern_vision_in_flight") == 1, "the first image never got in flight"
        busy = detect(port, img, path="/v1/vision/custom/detect_slow")
        # Refused at once: while the first is still in flight (it waits out its 4 s), not after it.
        assert t.is_alive() and "slow" not in results, "an over-capacity request must be refused at once"
        assert busy["success"] is False and "busy" in busy["error"]
        # The capacity is the model's own: another model's image is taken meanwhile.
        check(detect(port, img, path="/v1/vision/custom/detect_yolov8"), expected(128, 96, SQUARES, "yolov8"))
        # Refused from the request's head: the answer comes before any of the body is sent.
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(b"POST /v1/vision/custom/detect_slow HTTP/1.1\r\nHost: q\r\n"
                         b"Content-Type: multipart/form-data; boundary=b\r\nContent-Length: 5000000\r\n\r\n")
            head = read_http_response(sock)
        assert head.startswith(b"HTTP/1.1 200"), head
        early = json.loads(head.split(b"\r\n\r\n", 1)[1])
        assert early["success"] is False and "busy" in early["error"] and CPAI_FIELDS <= set(early)
        t.join()
        assert results["slow"]["success"] is False and "deadline" in results["slow"]["error"].lower()
        assert metric(metrics, "quern_vision_rejected_overload_total") == 2
        assert metric(metrics, "quern_vision_dropped_total") == 1
        # The refusals count as the model's own (the dashboard's Errors column reads this).
        text = request(metrics, "GET", "/metrics")[2].decode()
        rejected = re.search(r'^quern_request_failure_total\{[^}]*model="detect_slow"[^}]*reason="rejected"[^}]*\} (\S+)$',
                             text, re.M)
        assert rejected and float(rejected.group(1)) == 2, [l for l in text.splitlines() if "detect_slow" in l]
        stats = json.loads(request(port, "GET", "/v2/models/detect_slow/stats")[2])["model_stats"][0]
        assert stats["execution_count"] == 0, "the timed-out image was computed"
        # The pipeline is free again.
        check(detect(port, img, path="/v1/vision/custom/detect_yolov8"), expected(128, 96, SQUARES, "yolov8"))
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_ocr_is_admitted_like_every_image(tmp_path):
    """/v1/vision/ocr goes through the vision service's admission (it went to its model directly,
    queueing without bound): past --vision-queue-capacity an OCR request is refused at once, from
    its head too. The model here sleeps 1 s and answers the length of the image it got."""
    d = tmp_path / "repo" / "slow_ocr"
    os.makedirs(d / "1")
    (d / "config.pbtxt").write_text(
        'backend: "python"\nmax_batch_size: 0\n'
        'input [ { name: "image" data_type: TYPE_STRING dims: [ 1 ] } ]\n'
        'output [ { name: "text" data_type: TYPE_STRING dims: [ -1 ] },\n'
        '         { name: "confidence" data_type: TYPE_FP32 dims: [ -1 ] },\n'
        '         { name: "boxes" data_type: TYPE_FP32 dims: [ -1, 4, 2 ] } ]\n')
    (d / "1" / "model.py").write_text(
        "import time\nimport numpy as np\n\n"
        "def infer(inputs):\n"
        "    time.sleep(1)\n"
        "    n = len(inputs['image'].ravel()[0])\n"
        "    return {'text': np.array([f'len={n}'.encode()], dtype=np.object_),\n"
        "            'confidence': np.array([0.9], np.float32),\n"
        "            'boxes': np.array([[[1, 2], [30, 2], [30, 12], [1, 12]]], np.float32)}\n")
    proc, port, metrics = start(str(tmp_path / "repo"), "--ocr-model", "slow_ocr", "--vision-queue-capacity", "1")
    try:
        img = encode(painted(64, 48, SQUARES), "PNG")
        body, headers = multipart([("upload", img, "page.png")])
        results = {}

        def first():
            results["first"] = json.loads(request(port, "POST", "/v1/vision/ocr", body, headers)[2])

        t = threading.Thread(target=first)
        t.start()
        wait_for = time.time() + 10
        while metric(metrics, "quern_vision_in_flight") != 1 and time.time() < wait_for:
            time.sleep(0.02)
        assert metric(metrics, "quern_vision_in_flight") == 1, "the first page never got in flight"
        busy = json.loads(request(port, "POST", "/v1/vision/ocr", body, headers)[2])
        # Refused at once: while the first page is still read (its model takes 1 s), not after it.
        assert t.is_alive() and "first" not in results, "an over-capacity OCR request must be refused at once"
        assert busy["success"] is False and "busy" in busy["error"], busy
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(b"POST /v1/vision/ocr HTTP/1.1\r\nHost: q\r\n"
                         b"Content-Type: multipart/form-data; boundary=b\r\nContent-Length: 5000000\r\n\r\n")
            early = json.loads(read_http_response(sock).split(b"\r\n\r\n", 1)[1])
        assert early["success"] is False and "busy" in early["error"], early
        t.join()
        assert results["first"]["success"] is True, results["first"]
        assert [p["label"] for p in results["first"]["predictions"]] == [f"len={len(img)}"]
        assert metric(metrics, "quern_vision_rejected_overload_total") == 2
        # The page leaves the pipeline's count once its request has ended, which on a busy machine
        # may be a moment after its answer reached the client.
        wait_until(lambda: metric(metrics, "quern_vision_in_flight") == 0, timeout=30,
                   what="the answered page to leave quern_vision_in_flight")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def read_http_response(sock):
    """One HTTP response (headers and Content-Length bytes of body) from a socket."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    length = int(re.search(rb"Content-Length: (\d+)", head).group(1))
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


def test_admitted_images_are_bounded_by_memory(repo):
    """--vision-max-memory-mb bounds what admitted images hold (their bodies and model inputs): one
    image is always admitted; the next that would pass the bound is refused until memory is free."""
    proc, port, metrics = start(repo, "--vision-max-memory-mb", "1")
    try:
        img = encode(painted(128, 96, SQUARES), "PNG")
        padding = [("note", b"x" * 700_000, None)]  # a 700 KB body
        results = {}

        def slow():  # detect_slow holds its image up to 1 s, waiting for a batch
            results["slow"] = detect(port, img, path="/v1/vision/custom/detect_slow", extra=padding)

        t = threading.Thread(target=slow)
        t.start()
        deadline = time.time() + 10
        while metric(metrics, "quern_vision_in_flight") != 1 and time.time() < deadline:
            time.sleep(0.01)
        held = metric(metrics, "quern_vision_in_flight_bytes")
        assert held >= 700_000 + 3 * 64 * 64 * 4, held  # body + the FP32 model input
        busy = detect(port, img, path="/v1/vision/custom/detect_yolov8", extra=padding)
        assert busy["success"] is False and "MiB" in busy["error"] and "--vision-max-memory-mb" in busy["error"]
        small = detect(port, img, path="/v1/vision/custom/detect_yolov8")  # fits beside it
        check(small, expected(128, 96, SQUARES, "yolov8"))
        t.join()
        assert results["slow"]["success"] is True
        # The answer may reach the client a moment before its memory is counted free.
        deadline = time.time() + 30
        while metric(metrics, "quern_vision_in_flight_bytes") != 0 and time.time() < deadline:
            time.sleep(0.01)
        assert metric(metrics, "quern_vision_in_flight_bytes") == 0
        check(detect(port, img, path="/v1/vision/custom/detect_yolov8", extra=padding),
              expected(128, 96, SQUARES, "yolov8"))
        assert metric(metrics, "quern_vision_rejected_overload_total") == 1
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_vision_port_and_api_key(repo):
    """--vision-port serves the vision routes on a second port (and only those); --vision-api-key is required."""
    proc, ports = start_quern(QUERN, repo, "--vision-port", "0", "--vision-api-key", "s3cret")
    try:
        port = ports["vision"]
        assert json.loads(request(port, "GET", "/v1/status/ping")[2])["success"] is True
        img = encode(painted(128, 96, SQUARES), "PNG")
        # No --detection-model: the first detection model by name, detect_detr.
        check(detect(port, img, extra=[("api_key", b"s3cret", None)]), expected(128, 96, SQUARES, "detr"), 0.001)
        missing = detect(port, img)
        assert missing["success"] is False and "api_key" in missing["error"]
        # The key as a query parameter instead of a form field, as CodeProject.AI takes it.
        check(detect(port, img, path="/v1/vision/detection?api_key=s3cret"), expected(128, 96, SQUARES, "detr"), 0.001)
        wrong_query = detect(port, img, path="/v1/vision/detection?api_key=nope")
        assert wrong_query["success"] is False and "api_key is not valid" in wrong_query["error"], wrong_query
        wrong = detect(ports["HTTP"], img, extra=[("api_key", b"nope", None)])
        assert wrong["success"] is False and "api_key is not valid" in wrong["error"]
        status, _, data = request(port, "GET", "/v2/health/live")
        assert status == 404 and "vision routes" in json.loads(data)["error"]
        # Blue Iris probes GET / to see that the server is up: both ports answer, with no key.
        for p in (port, ports["HTTP"]):
            status, h, data = request(p, "GET", "/")
            assert status == 200 and h["content-type"].startswith("text/html") and b"Quern" in data, (p, status)
            assert b"detect_" not in data  # routes only, never model names
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_stage_timings_in_header_and_metrics(repo):
    proc, port, metrics = start(repo, "--detection-model", "detect_yolov8")
    try:
        sums = {}
        img = encode(painted(1920, 1080, SQUARES), "JPEG", quality=90)
        for _ in range(3):
            body, headers = multipart([("image", img, "frame.jpg")])
            status, h, data = request(port, "POST", "/v1/vision/detection", body, headers)
            assert status == 200 and json.loads(data)["success"] is True
            stages = dict(re.fullmatch(r"(\w+);dur=([0-9.]+)", part.strip()).groups()
                          for part in h["server-timing"].split(","))
            assert list(stages) == ["decode", "resize", "queue", "infer", "post"], h["server-timing"]
            assert float(stages["decode"]) > 0 and float(stages["infer"]) > 0
            for k, v in stages.items():
                sums[k] = sums.get(k, 0.0) + float(v)
        # A failed request is answered but not timed.
        body, headers = multipart([("image", b"not an image", "x.jpg")])
        assert "server-timing" not in request(port, "POST", "/v1/vision/detection", body, headers)[1]
        assert metric(metrics, "quern_vision_timed_images_total") == 3
        text = request(metrics, "GET", "/metrics")[2].decode()
        for k, total_ms in sums.items():
            m = re.search(rf'^quern_vision_stage_seconds_total{{stage="{k}"}} (\S+)$', text, re.M)
            assert m and abs(float(m.group(1)) * 1000 - total_ms) < 0.01, (k, total_ms, m and m.group(1))
        # The stage threads' CPU time: spent (a 1080p JPEG takes milliseconds to decode), and never more
        # than the stage's wall time (one thread each).
        for k in ("decode", "resize", "post"):
            m = re.search(rf'^quern_vision_stage_cpu_seconds_total{{stage="{k}"}} (\S+)$', text, re.M)
            assert m and 0 < float(m.group(1)) * 1000 <= sums[k] + 0.5, (k, sums[k], m and m.group(1))
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_cmyk_jpegs_gifs_and_animations_as_cameras_and_scanners_send_them(server):
    """A CMYK JPEG (scanners, print workflows) decodes to the picture it holds; an animated GIF or WebP
    is refused as such, not as corrupt."""
    img = painted(320, 240, SQUARES)
    want = expected(320, 240, SQUARES, "yolov8")
    cmyk = encode(img.convert("CMYK"), "JPEG", quality=95)
    assert Image.open(io.BytesIO(cmyk)).mode == "CMYK"
    check(detect(server, cmyk), want, 0.05)
    second = painted(320, 240, [(1, 1, (0, 255, 0))])
    gif = io.BytesIO()
    img.save(gif, "GIF", save_all=True, append_images=[second], duration=100, loop=0)
    r = detect(server, gif.getvalue())
    assert r["success"] is False and "GIF images (animated or not) are not supported" in r["error"], r
    webp = io.BytesIO()
    img.save(webp, "WEBP", save_all=True, append_images=[second], duration=100, loop=0)
    r = detect(server, webp.getvalue())
    assert r["success"] is False and "animated WebP images are not supported" in r["error"], r
    # A PNG header claiming 1700 x 1700 pixels (under this server's limit) in 69 bytes: refused for what it is.
    import struct
    import zlib

    def chunk(t, d):
        return struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d) & 0xffffffff)
    forged = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 1700, 1700, 8, 2, 0, 0, 0)) +
              chunk(b"IDAT", b"") + chunk(b"IEND", b""))
    r = detect(server, forged)
    assert r["success"] is False and "claims 1700x1700 pixels in" in r["error"], r
