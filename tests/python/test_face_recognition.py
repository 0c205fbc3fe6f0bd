"""Face recognition with the real models of the example repository: CenterFace finds the faces
(examples/models/faces) and the FaceRes descriptor describes them (examples/models/face_descriptor),
through DeepStack's and CodeProject.AI's routes: /v1/vision/face/register, recognize, match, list
and delete.

The portraits come from PyPI face_recognition 1.3.0's test images (examples/data, fetched by
scripts/setup.sh). What a person sees in them: obama.jpg (an official portrait), obama2.jpg (a
speech) and obama3.jpg (standing in a room, arms crossed) are three different photographs of the
same man, Barack Obama; biden.jpg is another man, Joe Biden, standing in a room; grace_hopper.jpg
(matplotlib's sample) is a woman, Grace Hopper. dog.jpg has no human face.

Beside those readings, an independent reference for the descriptor: onnxruntime (PyPI) runs the
descriptor file on the square around each face, cut and resized with PIL, normalised with numpy,
and the similarities it gives must agree with Quern's."""
import io
import json
import os
import shutil
import signal
import struct
import subprocess

import numpy as np
import pytest
from PIL import Image

from quern_testing import RedisServer, http_request, start_quern
from quern_testing import post_form as form

QUERN = os.environ["QUERN_BIN"]
ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
MODELS = os.path.join(ROOT, "examples", "models")
PHOTOS = os.path.join(ROOT, "examples", "data")
SAME, DIFFERENT = 0.67, 0.6  # cosine similarity: the route's default threshold; different people stay below


def photo(name):
    with open(os.path.join(PHOTOS, name), "rb") as f:
        return f.read()


def png(image):
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


def ok(r):
    assert r["success"] is True, r
    return r


def failed(r, words):
    assert r["success"] is False and words in r["error"], r
    return r


def serve(repo, data_dir, *models, log=None):
    for m in models or ("faces", "face_descriptor"):
        if not os.path.exists(repo / m):
            shutil.copytree(os.path.join(MODELS, m), repo / m)
    proc, ports = start_quern(QUERN, str(repo), "--data-dir", str(data_dir), log=log)
    return proc, ports["HTTP"]


def stop(proc):
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0


@pytest.fixture
def server(tmp_path):
    proc, port = serve(tmp_path / "repo", tmp_path / "data")
    yield port
    stop(proc)


def users(port):
    return ok(form(port, "/v1/vision/face/list"))["faces"]


def recognize(port, name):
    r = ok(form(port, "/v1/vision/face/recognize", [("image", photo(name))]))
    assert r["count"] == len(r["predictions"])
    return r["predictions"]


def test_a_registered_person_is_recognised_in_other_photographs(server):
    ok(form(server, "/v1/vision/face/register", [("image", photo("obama.jpg"))], userid="Barack Obama"))
    assert users(server) == ["Barack Obama"]
    for name in ("obama2.jpg", "obama3.jpg"):
        found = recognize(server, name)
        assert len(found) == 1 and found[0]["userid"] == "Barack Obama", (name, found)
        assert SAME <= found[0]["confidence"] < 1, found
    for name in ("biden.jpg", "grace_hopper.jpg"):
        found = recognize(server, name)
        assert [f["userid"] for f in found] == ["unknown"] and found[0]["confidence"] == 0, (name, found)
    # The face is where the portrait's face is (read from grace_hopper.jpg: brow to chin y 130-340,
    # cheek to cheek x 160-375).
    f = recognize(server, "grace_hopper.jpg")[0]
    assert 130 <= f["x_min"] <= 220 and 310 <= f["x_max"] <= 410 and 70 <= f["y_min"] <= 170, f
    # A PNG four times as large (not shrunk while decoding: the crop's source is kept at most 2048 px):
    # the same person, the box four times as large.
    ok(form(server, "/v1/vision/face/register", [("image", photo("grace_hopper.jpg"))], userid="hopper"))
    big = Image.open(os.path.join(PHOTOS, "grace_hopper.jpg")).resize((2048, 2400), Image.BILINEAR)
    g = ok(form(server, "/v1/vision/face/recognize", [("image", png(big))]))["predictions"]
    assert [p["userid"] for p in g] == ["hopper"] and g[0]["confidence"] > 0.9, g
    assert abs(g[0]["x_min"] - 4 * f["x_min"]) <= 12 and abs(g[0]["y_max"] - 4 * f["y_max"]) <= 12, (g, f)
    # A stricter threshold turns the same face away.
    r = ok(form(server, "/v1/vision/face/recognize", [("image", photo("obama2.jpg"))], min_confidence="0.95"))
    assert [f["userid"] for f in r["predictions"]] == ["unknown"], r
    assert recognize(server, "dog.jpg") == []


def test_match_tells_one_person_from_another(server):
    def similarity(a, b):
        return ok(form(server, "/v1/vision/face/match", [("image1", photo(a)), ("image2", photo(b))]))["similarity"]
    same = similarity("obama2.jpg", "obama3.jpg")
    assert same >= SAME, same
    assert abs(similarity("obama3.jpg", "obama2.jpg") - same) < 1e-5
    for a, b in (("obama2.jpg", "biden.jpg"), ("grace_hopper.jpg", "biden.jpg"), ("obama.jpg", "grace_hopper.jpg")):
        assert similarity(a, b) < DIFFERENT, (a, b)
    mirrored = png(Image.open(os.path.join(PHOTOS, "biden.jpg")).transpose(Image.Transpose.FLIP_LEFT_RIGHT))
    r = ok(form(server, "/v1/vision/face/match", [("image1", photo("biden.jpg")), ("image2", mirrored)]))
    assert r["similarity"] >= 0.85, r


def test_several_images_per_person_list_and_delete(server):
    mirrored = png(Image.open(os.path.join(PHOTOS, "biden.jpg")).transpose(Image.Transpose.FLIP_LEFT_RIGHT))
    ok(form(server, "/v1/vision/face/register", [("image1", photo("biden.jpg")), ("image2", mirrored)],
            userid="biden"))
    ok(form(server, "/v1/vision/face/register", [("image", photo("obama.jpg"))], userid="obama"))
    assert users(server) == ["biden", "obama"]
    status, _, data = http_request(server, "GET", "/v1/vision/face/list")  # GET as well
    assert status == 200 and json.loads(data)["faces"] == ["biden", "obama"], data
    ok(form(server, "/v1/vision/face/delete", userid="obama"))
    assert users(server) == ["biden"]
    assert [f["userid"] for f in recognize(server, "obama2.jpg")] == ["unknown"]
    failed(form(server, "/v1/vision/face/delete", userid="obama"), "no face is registered as 'obama'")


def test_registered_faces_survive_a_restart(tmp_path):
    proc, port = serve(tmp_path / "repo", tmp_path / "data")
    ok(form(port, "/v1/vision/face/register", [("image", photo("obama.jpg"))], userid="obama"))
    ok(form(port, "/v1/vision/face/register", [("image", photo("grace_hopper.jpg"))], userid="Grace Hopper"))
    before = recognize(port, "obama2.jpg")
    stop(proc)
    proc, port = serve(tmp_path / "repo", tmp_path / "data")
    try:
        assert users(port) == ["Grace Hopper", "obama"]
        after = recognize(port, "obama2.jpg")
        assert after[0]["userid"] == "obama" and abs(after[0]["confidence"] - before[0]["confidence"]) < 1e-5
    finally:
        stop(proc)
    # The gallery is a log, one record per registration (Grace Hopper's last). Its last record cut
    # short (the server stopped while writing it, before answering): that registration is dropped,
    # with a warning, and the rest served.
    gallery = tmp_path / "data" / "faces.bin"
    data = gallery.read_bytes()
    gallery.write_bytes(data[:-100])
    log = []
    proc, port = serve(tmp_path / "repo", tmp_path / "data", log=log)
    try:
        assert users(port) == ["obama"]
        assert any("faces.bin" in line and "cut short" in line for line in log), log
    finally:
        stop(proc)
    # Damage before the last record is refused at start with the file's name, and left as it is.
    damaged = bytearray(data)
    damaged[40] ^= 0x55  # inside the first record (obama's)
    gallery.write_bytes(bytes(damaged))
    out = subprocess.run([QUERN, "serve", "--model-repository", str(tmp_path / "repo"), "--data-dir",
                          str(tmp_path / "data"), "--http-port", "0", "--grpc-port", "-1", "--metrics-port", "0"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "faces.bin" in out.stderr and "damaged" in out.stderr, out.stderr
    assert gallery.read_bytes() == bytes(damaged)


def test_bad_requests_get_clear_errors_and_lose_nothing(server):
    ok(form(server, "/v1/vision/face/register", [("image", photo("obama.jpg"))], userid="obama"))
    blank = png(Image.new("RGB", (320, 240), (128, 128, 128)))
    jpeg = photo("biden.jpg")
    cases = [
        ("/v1/vision/face/register", [("image", jpeg)], {}, "userid"),
        ("/v1/vision/face/register", [("image", jpeg)], {"userid": ""}, "userid is empty"),
        ("/v1/vision/face/register", [("image", jpeg)], {"userid": "a\x01b"}, "control character"),
        ("/v1/vision/face/register", [("image", jpeg)], {"userid": "x" * 300}, "at most 256"),
        ("/v1/vision/face/register", [], {"userid": "biden"}, "no image"),
        ("/v1/vision/face/register", [("image", blank)], {"userid": "biden"}, "no face was found in 'image'"),
        # One good image and one without a face: nothing is registered.
        ("/v1/vision/face/register", [("image1", jpeg), ("image2", blank)], {"userid": "biden"},
         "no face was found in 'image2'"),
        ("/v1/vision/face/register", [("image", b"not an image")], {"userid": "biden"}, "image"),
        ("/v1/vision/face/register", [("image", jpeg[: len(jpeg) // 2])], {"userid": "biden"}, "image"),
        ("/v1/vision/face/register", [("image", b"")], {"userid": "biden"}, "empty"),
        ("/v1/vision/face/recognize", [], {}, "no image"),
        ("/v1/vision/face/match", [("image1", jpeg)], {}, "image2"),
        ("/v1/vision/face/match", [("image1", jpeg), ("image2", blank)], {}, "no face was found in 'image2'"),
        ("/v1/vision/face/delete", [], {}, "userid"),
        ("/v1/vision/face/delete", [], {"userid": "nobody"}, "no face is registered as 'nobody'"),
        ("/v1/vision/face/enrol", [("image", jpeg)], {"userid": "biden"}, "no vision route"),
    ]
    huge = io.BytesIO()  # 7100 x 7100 = 50.4 M pixels, over the 50 M limit: refused before decoding
    Image.new("1", (7100, 7100)).save(huge, "PNG")
    cases.append(("/v1/vision/face/register", [("image", huge.getvalue())], {"userid": "biden"}, "pixels"))
    for path, files, fields, words in cases:
        failed(form(server, path, files, **fields), words)
    assert users(server) == ["obama"]
    assert recognize(server, "obama2.jpg")[0]["userid"] == "obama"


def test_face_routes_need_the_key_when_one_is_set(tmp_path):
    repo = tmp_path / "repo"
    for m in ("faces", "face_descriptor"):
        shutil.copytree(os.path.join(MODELS, m), repo / m)
    proc, ports = start_quern(QUERN, str(repo), "--vision-api-key", "s3cret")
    port = ports["HTTP"]
    try:
        failed(form(port, "/v1/vision/face/register", [("image", photo("obama.jpg"))], userid="obama"), "api_key")
        failed(form(port, "/v1/vision/face/register", [("image", photo("obama.jpg"))], userid="obama",
                    api_key="wrong"), "not valid")
        ok(form(port, "/v1/vision/face/register", [("image", photo("obama.jpg"))], userid="obama", api_key="s3cret"))
        for path in ("/v1/vision/face/list", "/v1/vision/face/list?api_key=wrong"):
            status, _, data = http_request(port, "POST", path)  # no form at all
            assert json.loads(data)["success"] is False, data
        status, _, data = http_request(port, "POST", "/v1/vision/face/list?api_key=s3cret")
        assert json.loads(data)["faces"] == ["obama"], data
        failed(form(port, "/v1/vision/face/delete", userid="obama"), "api_key")
        assert ok(form(port, "/v1/vision/face/list", api_key="s3cret"))["faces"] == ["obama"]
    finally:
        stop(proc)


def test_without_a_descriptor_model_the_routes_say_what_is_missing(tmp_path):
    proc, port = serve(tmp_path / "repo", tmp_path / "data", "faces")
    try:
        failed(form(port, "/v1/vision/face/register", [("image", photo("obama.jpg"))], userid="obama"),
               "no face descriptor model")
        failed(form(port, "/v1/vision/face/recognize", [("image", photo("obama.jpg"))]), "no face descriptor model")
        assert users(port) == []
        ok(form(port, "/v1/vision/face", [("image", photo("obama.jpg"))]))  # detection still works
    finally:
        stop(proc)


# ---- the independent reference

def reference_descriptor(name, box):
    """FaceRes on the square around `box` (its longer side, same centre, moved inside the image), cut
    and resized to 224x224 with PIL, BGR minus the ImageNet means, by onnxruntime; unit length."""
    import onnxruntime
    img = Image.open(os.path.join(PHOTOS, name)).convert("RGB")
    w, h = img.size
    side = min(max(box["x_max"] - box["x_min"], box["y_max"] - box["y_min"]), w, h)
    x0 = min(max(round((box["x_min"] + box["x_max"]) / 2 - side / 2), 0), w - side)
    y0 = min(max(round((box["y_min"] + box["y_max"]) / 2 - side / 2), 0), h - side)
    crop = np.asarray(img.crop((x0, y0, x0 + side, y0 + side)).resize((224, 224), Image.BILINEAR), np.float32)
    x = (crop[:, :, ::-1] - np.array([103.939, 116.779, 123.68], np.float32)).transpose(2, 0, 1)[None]
    session = onnxruntime.InferenceSession(os.path.join(MODELS, "face_descriptor", "1", "model.onnx"),
                                           providers=["CPUExecutionProvider"])
    e = session.run(["embedding"], {"image": np.ascontiguousarray(x)})[0][0].astype(np.float64)
    return e / np.linalg.norm(e)


def test_similarities_agree_with_onnxruntime_and_numpy(server):
    names = ("obama2.jpg", "obama3.jpg", "biden.jpg", "grace_hopper.jpg")
    boxes = {n: ok(form(server, "/v1/vision/face", [("image", photo(n))]))["predictions"][0] for n in names}
    ref = {n: reference_descriptor(n, boxes[n]) for n in names}
    for a, b in (("obama2.jpg", "obama3.jpg"), ("obama2.jpg", "biden.jpg"), ("grace_hopper.jpg", "obama3.jpg")):
        quern = ok(form(server, "/v1/vision/face/match", [("image1", photo(a)), ("image2", photo(b))]))["similarity"]
        expected = float(ref[a] @ ref[b])
        # PIL's resampling and JPEG decoder are not Quern's: the crops differ in the last bits.
        assert abs(quern - expected) < 0.015, (a, b, quern, expected)


def test_instances_sharing_redis_share_their_faces(tmp_path):
    """With --redis-url the faces live in Redis: what one instance registers, another recognises;
    registrations racing on two instances are all kept; a restart of every instance loses nothing."""
    import threading
    (tmp_path / "redis").mkdir()
    redis = RedisServer(tmp_path / "redis")
    repo = tmp_path / "repo"
    for m in ("faces", "face_descriptor"):
        shutil.copytree(os.path.join(MODELS, m), repo / m)
    url = ["--redis-url", redis.url()]
    # A gallery an earlier release left (one string, "QUERNFACES1\n", u32 dimension, u32 users, per user
    # u32 id length, id, u32 faces, the faces): moved into the per-user hash when first read.
    import onnxruntime
    dim = onnxruntime.InferenceSession(os.path.join(MODELS, "face_descriptor", "1", "model.onnx"),
                                       providers=["CPUExecutionProvider"]).get_outputs()[0].shape[-1]
    old = (b"QUERNFACES1\n" + struct.pack("<II", dim, 1) + struct.pack("<I", 6) + b"legacy" + struct.pack("<I", 1) +
           np.eye(1, dim, dtype="<f4").tobytes())
    redis.client().set("quern:faces", old)
    redis.client().set("quern:faces:version", 3)
    (a, ports_a), (b, ports_b) = start_quern(QUERN, str(repo), *url), start_quern(QUERN, str(repo), *url)
    a_port, b_port = ports_a["HTTP"], ports_b["HTTP"]
    try:
        assert users(b_port) == ["legacy"]
        assert not redis.client().exists("quern:faces")
        assert users(a_port) == ["legacy"]
        ok(form(a_port, "/v1/vision/face/delete", userid="legacy"))
        ok(form(a_port, "/v1/vision/face/register", [("image", photo("obama.jpg"))], userid="obama"))
        found = recognize(b_port, "obama2.jpg")
        assert [f["userid"] for f in found] == ["obama"], found
        # Registrations on both instances at once: none is lost.
        jpeg, errors = photo("biden.jpg"), []

        def register(port, names):
            for n in names:
                r = form(port, "/v1/vision/face/register", [("image", jpeg)], userid=n)
                if not r["success"]:
                    errors.append(r)
        threads = [threading.Thread(target=register, args=(port, [f"{tag}{i}" for i in range(6)]))
                   for port, tag in ((a_port, "a"), (b_port, "b"))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        expected = sorted(["obama"] + [f"{t}{i}" for t in "ab" for i in range(6)])
        assert users(a_port) == expected and users(b_port) == expected
        ok(form(b_port, "/v1/vision/face/delete", userid="obama"))
        assert "obama" not in users(a_port)
        assert [f["userid"] for f in recognize(a_port, "obama2.jpg")] == ["unknown"]
        ok(form(a_port, "/v1/vision/face/register", [("image", photo("obama.jpg"))], userid="obama"))
    finally:
        stop(a)
        stop(b)
    proc, ports = start_quern(QUERN, str(repo), *url)
    try:
        assert users(ports["HTTP"]) == expected
        assert recognize(ports["HTTP"], "obama3.jpg")[0]["userid"] == "obama"
        # The gallery gone from Redis while its version stays (evicted, deleted): a registration is
        # refused rather than writing a gallery of one over everyone's faces.
        client = redis.client()
        assert client.type("quern:faces:users") == b"hash"  # a record per user
        saved = client.hgetall("quern:faces:users")
        client.delete("quern:faces:users")
        client.incr("quern:faces:version")
        failed(form(ports["HTTP"], "/v1/vision/face/register", [("image", jpeg)], userid="late"), "missing")
        assert not client.exists("quern:faces:users")
        client.hset("quern:faces:users", mapping=saved)
        client.incr("quern:faces:version")
        assert users(ports["HTTP"]) == expected
        # The hash gone while the version stays as this instance last read it: a registration is
        # refused too (it would start a gallery of one).
        client.delete("quern:faces:users")
        failed(form(ports["HTTP"], "/v1/vision/face/register", [("image", jpeg)], userid="late"), "missing")
        assert not client.exists("quern:faces:users")
        client.hset("quern:faces:users", mapping=saved)
        client.incr("quern:faces:version")
        assert users(ports["HTTP"]) == expected
        # Redis gone: recognition answers from the faces last read; a registration fails plainly.
        redis.stop()
        assert recognize(ports["HTTP"], "obama3.jpg")[0]["userid"] == "obama"
        failed(form(ports["HTTP"], "/v1/vision/face/register", [("image", jpeg)], userid="late"), "Redis")
    finally:
        stop(proc)
