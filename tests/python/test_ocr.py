"""OCR on the real PP-OCRv4 models (the example ensemble `ocr`): pages rendered here with fonts from
Debian's packages, read back through tritonclient; the reference implementation RapidOCR (same
models, Python, OpenCV) reads the same pages."""
import io
import os
import shutil
import threading

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from PIL import Image, ImageDraw, ImageFont
from tritonclient.utils import InferenceServerException

import ocr_pages
from quern_testing import post_form, sanitized, start_quern

QUERN = os.environ["QUERN_BIN"]
EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples")
MODELS = ("ocr", "ocr_prepare", "ocr_detector", "ocr_boxes", "ocr_crop", "text_direction", "ocr_lines",
          "ocr_recognizer", "ocr_text")
DEJAVU = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf"  # fonts-dejavu-core
DROID = "/usr/share/fonts/truetype/droid/DroidSansFallbackFull.ttf"  # fonts-droid-fallback: CJK
WORDS = ["Quern", "HELLO2026", "3.14159", "Invoice", "Total:42.50", "mill-stone", "Batching", "zebra"]
CJK = ["你好世界", "中文识别测试", "北京欢迎你", "人工智能"]


def render(lines, width=720):
    """A white page with one line per (text, font, size, upside_down); returns the PNG and, per line, the
    bounding box of its ink in the page's pixels."""
    heights = [int(size * 1.9) for _, _, size, _ in lines]
    page = Image.new("RGB", (width, sum(heights) + 40), "white")
    ink, y = [], 20
    for (text, font_file, size, upside_down), h in zip(lines, heights):
        font = ImageFont.truetype(font_file, size)
        line = Image.new("RGB", (width, h), "white")
        origin = (30, (h - size) // 2)
        ImageDraw.Draw(line).text(origin, text, font=font, fill="black")
        x0, y0, x1, y1 = ImageDraw.Draw(line).textbbox(origin, text, font=font)
        if upside_down:
            line = line.rotate(180)
            x0, y0, x1, y1 = width - x1, h - y1, width - x0, h - y0
        page.paste(line, (0, y))
        ink.append((x0, y0 + y, x1, y1 + y))
        y += h
    out = io.BytesIO()
    page.save(out, "PNG")
    return out.getvalue(), ink


def encoded(image):
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


PAGES = {
    **{f"latin {size}px": [(w, DEJAVU, size, i % 3 == 2) for i, w in enumerate(WORDS)] for size in (20, 32, 52)},
    **{f"cjk {size}px": [(w, DROID, size, i == 1) for i, w in enumerate(CJK)] for size in (24, 40)},
    "mixed": [("Quern", DEJAVU, 36, False), ("你好世界", DROID, 30, True), ("Receipt", DEJAVU, 24, False)],
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("ocr")
    for m in MODELS:
        shutil.copytree(os.path.join(EXAMPLES, "models", m), repo / m)
    proc, ports = start_quern(QUERN, str(repo))
    yield ports
    proc.terminate()
    proc.wait(timeout=30)


def read(client, png):
    inp = httpclient.InferInput("image", [1], "BYTES")
    inp.set_data_from_numpy(np.array([png], dtype=object), binary_data=True)
    r = client.infer("ocr", [inp])
    return [t.decode() for t in r.as_numpy("text")], r.as_numpy("confidence"), r.as_numpy("boxes")


@pytest.mark.parametrize("name", sorted(PAGES))
def test_the_rendered_text_comes_back_with_boxes_over_its_lines(server, name):
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server['HTTP']}")
    lines = PAGES[name]
    png, ink = render(lines)
    text, confidence, boxes = read(client, png)
    assert text == [t for t, _, _, _ in lines], (name, text)
    assert confidence.shape == (len(lines),) and (confidence >= 0.5).all() and (confidence <= 1).all()
    assert boxes.shape == (len(lines), 4, 2)
    for (x0, y0, x1, y1), box in zip(ink, boxes):
        bx0, by0 = box.min(axis=0)
        bx1, by1 = box.max(axis=0)
        # The box holds the line's ink (up to a tenth of the line's height of slack: the ink box
        # includes glyph edges the detector finds faint) and is not much larger than it.
        slack = 3 + 0.1 * (y1 - y0)
        assert bx0 <= x0 + slack and by0 <= y0 + slack and bx1 >= x1 - slack and by1 >= y1 - slack, (
            name, box.tolist(), (x0, y0, x1, y1))
        assert (bx1 - bx0) < (x1 - x0) + 2 * (y1 - y0) + 10 and (by1 - by0) < 3 * (y1 - y0) + 10, (name, box.tolist())


def test_rapidocr_reads_the_same_words(server):
    """On pages of one word per line RapidOCR (same models, its own pre- and post-processing) reads
    what Quern reads, and its boxes (the detector's, before any margin) are Quern's."""
    if sanitized(QUERN):
        # The same pages go through Quern in the test above; the reference's runs are not Quern's code.
        pytest.skip("the release stage compares with RapidOCR")
    from rapidocr_onnxruntime import RapidOCR
    reference = RapidOCR()
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server['HTTP']}")
    for name, lines in sorted(PAGES.items()):
        png, _ = render(lines)
        text, _, boxes = read(client, png)
        result, _ = reference(png)
        assert text == [r[1] for r in result], name
        np.testing.assert_allclose(boxes, np.array([r[0] for r in result], dtype=np.float32), atol=3, err_msg=name)


@pytest.mark.parametrize("name", sorted(ocr_pages.BUILDERS))
def test_pages_read_line_by_line_at_least_as_well_as_rapidocr(server, name):
    """The page set (fonts, sizes, a rotated page, a photo, two columns, a receipt; the renderer's text
    as the truth): each line of text is one prediction, word spaces kept, in reading order, and the
    reading scores at least RapidOCR's character accuracy (spaces included)."""
    from rapidocr_onnxruntime import RapidOCR
    if sanitized(QUERN) and sorted(ocr_pages.BUILDERS).index(name) % 3 != 0:
        # Every third page under the sanitizers: the same stages run on each (the release stage reads
        # them all, against RapidOCR).
        pytest.skip("every third page under the sanitizers")
    png, truth = ocr_pages.pages()[name]
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server['HTTP']}")
    text, _, boxes = read(client, png)
    # Under the sanitizers the page goes through Quern alone (RapidOCR's run is not Quern's code).
    theirs = [] if sanitized(QUERN) else [r[1] for r in (RapidOCR()(png)[0] or [])]
    ours, reference = ocr_pages.accuracy(text, truth), ocr_pages.accuracy(theirs, truth) if theirs else 0
    assert ours >= reference and ours >= 0.97, (name, ours, reference, text, theirs)
    assert len(text) == len(truth), (name, text, truth)
    assert all(t and t == t.strip() for t in text), (name, text)  # no blank margin read as spaces
    assert boxes.shape == (len(text), 4, 2)


def test_pages_without_text_have_no_lines(server):
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server['HTTP']}")
    white = Image.new("RGB", (640, 480), "white")
    ramp = Image.fromarray(np.tile(np.linspace(0, 255, 640, dtype=np.uint8), (480, 1))).convert("RGB")
    tiny = Image.new("RGB", (3, 2), "black")
    for image in (white, ramp, tiny):
        text, confidence, boxes = read(client, encoded(image))
        assert text == [] and confidence.shape == (0,) and boxes.shape == (0, 4, 2)


def test_garbage_gets_a_clear_error(server):
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server['HTTP']}")
    png, _ = render(PAGES["mixed"])
    for garbage in (b"not an image at all", b"", png[:200]):
        with pytest.raises(InferenceServerException) as e:
            read(client, garbage)
        message = str(e.value)
        assert "ensemble 'ocr' step 0 (model 'ocr_prepare')" in message and "image" in message, message
        assert e.value.status() in ("400", "StatusCode.INVALID_ARGUMENT"), e.value.status()
    # The server is still there.
    assert read(client, png)[0] == ["Quern", "你好世界", "Receipt"]


def test_grpc_and_concurrent_pages(server):
    pages = {name: render(lines)[0] for name, lines in PAGES.items()}
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{server['gRPC']}")
    inp = grpcclient.InferInput("image", [1], "BYTES")
    inp.set_data_from_numpy(np.array([pages["cjk 24px"]], dtype=object))
    assert [t.decode() for t in grpc.infer("ocr", [inp]).as_numpy("text")] == CJK

    wrong, errors = [], []

    def caller(i):
        # Four callers' pages through a detector that reads one page at a time: the last one waits
        # behind the others (seconds each under the sanitizers), past the client's default 60 s on
        # a busy machine.
        client = httpclient.InferenceServerClient(f"127.0.0.1:{server['HTTP']}", network_timeout=300)
        names = sorted(pages)
        for k in range(3):
            name = names[(i + k) % len(names)]
            try:
                text, _, _ = read(client, pages[name])
            except InferenceServerException as e:
                errors.append(str(e))
                continue
            if text != [t for t, _, _, _ in PAGES[name]]:
                wrong.append((name, text))

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and not wrong, (errors[:2], wrong[:2])


def call(client, model, inputs):
    tensors = []
    for name, array, dtype in inputs:
        t = httpclient.InferInput(name, list(array.shape), dtype)
        t.set_data_from_numpy(array, binary_data=True)
        tensors.append(t)
    return client.infer(model, tensors)


def test_stages_called_on_their_own_with_hostile_tensors(server):
    """Each stage is a model of its own, reachable by any client: tensors no pipeline would make get clear
    errors, never a crash or a runaway allocation."""
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server['HTTP']}")
    pixels = np.full((10, 10, 3), 255, np.uint8)
    huge = np.array([[[0, 0], [1e6, 0], [1e6, 1e6], [0, 1e6]]], np.float32)
    many = np.tile(np.array([[[0, 0], [5, 0], [5, 5], [0, 5]]], np.float32), (2000, 1, 1))
    nan = np.full((1, 4, 2), np.nan, np.float32)
    # Boxes of no height but a side 2e6 long: each crop is still a row of 2e6 pixels.
    flat = np.tile(np.array([[[-999999, 0], [999999, 0], [999999, 0], [-999999, 0]]], np.float32), (1000, 1, 1))
    for boxes, why in ((huge, "pixels"), (many, "at most 1000"), (nan, "not a pixel position"), (flat, "pixels")):
        with pytest.raises(InferenceServerException) as e:
            call(client, "ocr_crop", [("pixels", pixels, "UINT8"), ("boxes", boxes, "FP32")])
        assert "ocr_crop" in str(e.value) and why in str(e.value), str(e.value)
    with pytest.raises(InferenceServerException) as e:
        call(client, "ocr_boxes", [("probability", np.ones((1, 1, 8, 8), np.float32), "FP32"),
                                   ("geometry", np.array([np.nan, 1, 0], np.float32), "FP32")])
    assert "geometry" in str(e.value), str(e.value)
    probabilities = [(f"probabilities_{g}", np.ones((1 if g == 0 else 0, 4, 7), np.float32), "FP32")
                     for g in range(12)]
    rest = [("order", np.array([[0, 0]], np.int32), "INT32"), ("boxes", np.zeros((1, 4, 2), np.float32), "FP32"),
            ("geometry", np.array([10, 10, 0], np.float32), "FP32")]
    with pytest.raises(InferenceServerException) as e:
        call(client, "ocr_text", probabilities + rest)
    assert "classes" in str(e.value) and "dictionary" in str(e.value), str(e.value)
    probabilities[0] = ("probabilities_0", np.ones((1, 4, 6625), np.float32), "FP32")
    rest[0] = ("order", np.array([[3, 7]], np.int32), "INT32")
    with pytest.raises(InferenceServerException) as e:
        call(client, "ocr_text", probabilities + rest)
    assert "order" in str(e.value), str(e.value)
    # ocr_lines: widths past the line's end are held to it; an upside-down line is turned within its
    # width; two lines in twelve groups go each into a group of its own, padded to a multiple of 8.
    rng = np.random.default_rng(0)
    lines = rng.integers(0, 256, (2, 48, 100, 3), dtype=np.uint8)
    out = call(client, "ocr_lines", [("lines", lines, "UINT8"), ("widths", np.array([10**9, 50], np.int32), "INT32"),
                                     ("direction", np.array([[0, 1], [1, 0]], np.float32), "FP32")])
    assert out.as_numpy("order").tolist() == [[1, 0], [0, 0]]  # 100 px -> 104, 50 px -> 56
    wide, narrow = out.as_numpy("lines_1")[0], out.as_numpy("lines_0")[0]
    assert wide.shape == (3, 48, 104) and narrow.shape == (3, 48, 56)
    np.testing.assert_allclose(wide[:, :, :100], (lines[0][::-1, ::-1].transpose(2, 0, 1) / 127.5 - 1), atol=1e-6)
    assert not wide[:, :, 100:].any()
    np.testing.assert_allclose(narrow[:, :, :50], lines[1][:, :50].transpose(2, 0, 1) / 127.5 - 1, atol=1e-6)
    assert all(out.as_numpy(f"lines_{g}").shape[0] == 0 for g in range(2, 12))
    with pytest.raises(InferenceServerException) as e:
        call(client, "ocr_lines", [("lines", np.zeros((1, 48, 0, 3), np.uint8), "UINT8"),
                                   ("widths", np.array([5], np.int32), "INT32"),
                                   ("direction", np.array([[1, 0]], np.float32), "FP32")])
    assert "no width" in str(e.value), str(e.value)
    # A very long, flat image: refused when padding it would take too much memory, else read
    # (the detector's input scaled down to 4096 pixels).
    for width, ok in ((30000, False), (6000, True)):
        flat = encoded(Image.new("RGB", (width, 4), "white"))
        if ok:
            assert read(client, flat)[0] == []
        else:
            with pytest.raises(InferenceServerException) as e:
                read(client, flat)
            assert "too long and flat" in str(e.value), str(e.value)
    assert read(client, render(PAGES["mixed"])[0])[0] == ["Quern", "你好世界", "Receipt"]


def test_a_line_is_one_piece_of_text_at_every_height(server):
    """One line, "gRPC bytes OK" in DejaVu Serif at 40 px on a 420 px wide image, 60 to 90 px high:
    one prediction, the line (DB found the C of gRPC a second time, inside the line, at 8 of 16
    heights)."""
    font = ImageFont.truetype(DEJAVU.replace("DejaVuSans", "DejaVuSerif"), 40)
    # Under the sanitizers every third height (the detector's input here is 736 px high and 3.5-6.9 k
    # wide: over a second a line there); the same code runs at each.
    for height in range(60, 91, 6 if sanitized(QUERN) else 2):
        image = Image.new("RGB", (420, height), "white")
        ImageDraw.Draw(image).text((10, (height - 46) // 2), "gRPC bytes OK", fill="black", font=font)
        answer = post_form(server["HTTP"], "/v1/vision/ocr", files=[("upload", encoded(image))])
        assert [p["label"] for p in answer["predictions"]] == ["gRPC bytes OK"], (height, answer)


def test_codeproject_ai_ocr_route(server):
    """CodeProject.AI's OCR module: POST /v1/vision/ocr (and the legacy /v1/image/ocr) with the image in
    the form field 'upload'; predictions with label, confidence and x_min .. y_max."""
    lines = PAGES["mixed"]
    png, ink = render(lines)
    for path in ("/v1/vision/ocr", "/v1/image/ocr"):
        answer = post_form(server["HTTP"], path, files=[("upload", png)])
        assert answer["success"] is True, answer
        assert [p["label"] for p in answer["predictions"]] == [t for t, _, _, _ in lines]
        assert answer["count"] == 3 and answer["message"] == "3 pieces of text found"
        assert answer["command"] == "ocr"
        for p, (x0, y0, x1, y1) in zip(answer["predictions"], ink):
            assert 0.5 <= p["confidence"] <= 1
            assert p["x_min"] <= x0 + 6 and p["y_min"] <= y0 + 6 and p["x_max"] >= x1 - 6 and p["y_max"] >= y1 - 6, p
    single = post_form(server["HTTP"], "/v1/vision/ocr", files=[("upload", render([("Quern", DEJAVU, 40, False)])[0])])
    assert single["message"] == "1 text found" and single["predictions"][0]["label"] == "Quern"
    # An image field named 'image' works too; no image, or garbage, is a clear failure (success false).
    assert post_form(server["HTTP"], "/v1/vision/ocr", files=[("image", png)])["count"] == 3
    missing = post_form(server["HTTP"], "/v1/vision/ocr", min_confidence="0.4")
    assert missing["success"] is False and "upload" in missing["error"], missing
    garbage = post_form(server["HTTP"], "/v1/vision/ocr", files=[("upload", b"\x89PNG garbage")])
    assert garbage["success"] is False and "ocr_prepare" in garbage["error"], garbage
