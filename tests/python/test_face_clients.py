"""Face recognition through the client libraries people use, unchanged from PyPI: deepstack-sdk
(DeepStack's own SDK), deepstack-python (Home Assistant's DeepStack integration) and
codeproject-ai-api, each registering, listing, recognising and deleting a face on the example
repository's real models (CenterFace and the FaceRes descriptor), with and without a vision key.

The photographs are face_recognition 1.3.0's test images (examples/data). What a person sees in
them: obama.jpg and obama2.jpg are two different photographs of Barack Obama; biden.jpg is Joe
Biden. So after registering obama.jpg as "obama", obama2.jpg is recognised as obama and biden.jpg
as nobody registered ("unknown").

The clients report success from the HTTP status alone (deepstack-sdk's registerFace and
deleteFace return True on any 200), so every step is checked by what the server then holds."""
import json
import os
import shutil
import signal
import urllib.parse

import pytest

from quern_testing import http_request, start_quern

QUERN = os.environ["QUERN_BIN"]
ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
MODELS = os.path.join(ROOT, "examples", "models")
PHOTOS = os.path.join(ROOT, "examples", "data")
KEY = "s3cret-vision-key"


def photo(name):
    with open(os.path.join(PHOTOS, name), "rb") as f:
        return f.read()


@pytest.fixture(params=[None, KEY], ids=["no key", "vision key"])
def server(request, tmp_path):
    repo = tmp_path / "repo"
    for m in ("faces", "face_descriptor"):
        shutil.copytree(os.path.join(MODELS, m), repo / m)
    args = ["--data-dir", str(tmp_path / "data")]
    if request.param:
        args += ["--vision-api-key", request.param]
    proc, ports = start_quern(QUERN, str(repo), *args)
    yield ports["HTTP"], request.param
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0


def held_faces(port, key):
    """The users the server holds, asked without any client library."""
    path = "/v1/vision/face/list" + (f"?api_key={key}" if key else "")
    status, _, body = http_request(port, "POST", path)
    answer = json.loads(body)
    assert status == 200 and answer["success"] is True, answer
    return sorted(answer["faces"])


def recognised(predictions):
    return sorted(p["userid"] if isinstance(p, dict) else p.userid for p in predictions)


def test_deepstack_sdk(server):
    from deepstack_sdk import Face, ServerConfig
    port, key = server
    face = Face(ServerConfig(f"http://127.0.0.1:{port}", api_key=key))
    # registerFace names each file image<uuid4>: every file part is an image.
    assert face.registerFace([photo("obama.jpg")], "obama") is True
    assert held_faces(port, key) == ["obama"]
    assert list(face.listFaces()) == ["obama"]  # a url-encoded form carries its api_key
    assert recognised(face.recognizeFace(photo("obama2.jpg"), min_confidence=0.6)) == ["obama"]
    assert recognised(face.recognizeFace(photo("biden.jpg"), min_confidence=0.6)) == ["unknown"]
    assert face.deleteFace("obama") is True  # a url-encoded form
    assert held_faces(port, key) == []
    if key:
        # Without the key nothing changes, and the answer says why (as a 200, as the API does).
        intruder = Face(ServerConfig(f"http://127.0.0.1:{port}"))
        intruder.registerFace([photo("obama.jpg")], "mallory")
        assert held_faces(port, key) == []
        with pytest.raises(KeyError):
            intruder.listFaces()  # {"success": false, "error": ...}: no faces to read
        # Each refusal names its own command (the face list's is "list", not "detect").
        for route, command in (("list", "list"), ("delete", "delete"), ("register", "register")):
            status, _, body = http_request(port, "POST", "/v1/vision/face/" + route)
            answer = json.loads(body)
            assert status == 200 and answer["success"] is False and answer["command"] == command, answer


def test_deepstack_python(server):
    import deepstack.core as ds
    port, key = server
    # timeout: the client's own setting (10 s unless set; Home Assistant's integration lets the user
    # set it), here generous for the sanitizer build on a busy machine.
    face = ds.DeepstackFace(ip="127.0.0.1", port=port, api_key=key or "", timeout=60, min_confidence=0.6)
    assert "face" in face.register("obama", photo("obama.jpg")).lower()
    assert held_faces(port, key) == ["obama"]
    assert face.get_registered_faces() == ["obama"]  # its key in a url-encoded form
    assert recognised(face.recognize(photo("obama2.jpg"))) == ["obama"]
    assert recognised(face.recognize(photo("biden.jpg"))) == ["unknown"]
    if key:
        stranger = ds.DeepstackFace(ip="127.0.0.1", port=port, api_key="wrong", timeout=60, min_confidence=0.6)
        with pytest.raises(ds.DeepstackException, match="api_key"):
            stranger.register("mallory", photo("biden.jpg"))
        assert held_faces(port, key) == ["obama"]


def test_codeproject_ai_api(server):
    import codeprojectai.core as cpai
    port, key = server
    if key:
        pytest.skip("codeproject-ai-api sends no key")
    face = cpai.CodeProjectAIFace(ip="127.0.0.1", port=port, timeout=60, min_confidence=0.6)
    assert "face" in face.register("obama", photo("obama.jpg")).lower()
    assert face.get_registered_faces() == ["obama"]  # an empty POST
    assert recognised(face.recognize(photo("obama2.jpg"))) == ["obama"]
    assert recognised(face.recognize(photo("biden.jpg"))) == ["unknown"]
    # The library has no delete: the route it would call, with a url-encoded form.
    status, _, _ = http_request(port, "POST", "/v1/vision/face/delete",
                                body=urllib.parse.urlencode({"userid": "obama"}).encode(),
                                headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert status == 200
    assert held_faces(port, key) == []
