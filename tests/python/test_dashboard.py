"""The dashboard at GET /, in a real browser: Debian's Chromium, headless, driven by Selenium
through Debian's chromedriver.

What the page shows is checked against what the test did and against the server's other
interfaces, never against the page's own arithmetic: the models and their states against the
KServe repository index, request and error counts against the number of requests the test sent,
percentiles against Prometheus' histogram_quantile computed here from GET /metrics, and the boxes
drawn on the test page against what a person reads in the photograph (the regions in
test_real_models.py) and against the pixels of the canvas."""
import base64
import json
import os
import shutil
import time
import urllib.request

import numpy as np
import pytest

from quern_testing import http_request, iou, start_quern

QUERN = os.environ["QUERN_BIN"]
ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
MODELS = os.path.join(ROOT, "examples", "models")
PHOTOS = os.path.join(ROOT, "examples", "data")
CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
# A name no HTML may come from: the page must show it as text.
HOSTILE = 'x<img src=x id=injected onerror="document.title=1">'

# What a person sees in dog.jpg (768x576), as test_real_models.py reads it.
# What a person sees in dog.jpg; a pickup truck may fairly be called a car.
DOG_OBJECTS = [({"dog"}, (133, 222, 305, 540)), ({"bicycle"}, (127, 140, 566, 420)),
               ({"truck", "car"}, (466, 75, 685, 170))]


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    for m in ("objects", "imagenet", "small_cnn"):
        shutil.copytree(os.path.join(MODELS, m), repo / m)
    # A model whose file is missing (its load error is on the page), named with markup.
    broken = repo / HOSTILE
    shutil.copytree(os.path.join(MODELS, "small_cnn"), broken)
    for f in (broken / "1").iterdir():
        f.unlink()
    return repo


@pytest.fixture(scope="module")
def server(repo):
    proc, ports = start_quern(QUERN, str(repo), "--vision-port", "0")
    yield ports
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    assert os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER), \
        "Chromium and chromedriver come from Debian's chromium and chromium-driver (scripts/setup.sh)"
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1280,1000", "--no-first-run", "--disable-extensions"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


def wait_for(driver, script, timeout=20):
    """Runs `script` (a JavaScript function body) until it returns something truthy."""
    deadline = time.time() + timeout
    while True:
        value = driver.execute_script(script)
        if value:
            return value
        assert time.time() < deadline, f"timed out waiting for: {script}"
        time.sleep(0.2)


def console_errors(driver):
    return [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def page_rows(driver):
    """The models table, read at once (the page redraws it every second)."""
    return driver.execute_script("""
        return Array.from(document.querySelectorAll('#models tbody tr.model')).map(r => {
          const row = {model: r.dataset.model, version: Number(r.dataset.version)};
          for (const c of r.querySelectorAll('[data-field]')) {
            const f = c.dataset.field;
            if (c.dataset.p50 !== undefined) { row[f + '_p50'] = Number(c.dataset.p50); row[f + '_p99'] = Number(c.dataset.p99); }
            else if (c.dataset.value !== undefined) row[f] = c.dataset.value === '' ? null : Number(c.dataset.value);
            else row[f] = c.textContent;
          }
          return row;
        });""")


def scrape(port):
    """GET /metrics, parsed with the Prometheus project's own parser."""
    from prometheus_client.parser import text_string_to_metric_families
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    samples = []
    for family in text_string_to_metric_families(text):
        samples.extend(family.samples)
    return samples


def value(samples, name, **labels):
    found = [s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    return sum(found) if found else None


def histogram_quantile(q, samples, name, **labels):
    """Prometheus' histogram_quantile over the cumulative buckets of one series."""
    buckets = sorted((float(s.labels["le"]), s.value) for s in samples
                     if s.name == name + "_bucket" and all(s.labels.get(k) == v for k, v in labels.items()))
    total = buckets[-1][1]
    if total == 0:
        return float("nan")
    rank = q * total
    for i, (bound, count) in enumerate(buckets):
        if count >= rank:
            break
    if bound == float("inf"):
        return buckets[-2][0]
    lower, below = (0.0, 0.0) if i == 0 else buckets[i - 1]
    return lower + (bound - lower) * (rank - below) / (count - below)


def kserve_infer(port, model, x):
    body = json.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": list(x.shape),
                                   "data": x.ravel().tolist()}]})
    return http_request(port, "POST", f"/v2/models/{model}/infer", body, {"Content-Type": "application/json"})


def test_the_page_lists_every_model_with_its_state_and_load_error(server, browser):
    browser.get(f"http://127.0.0.1:{server['HTTP']}/")
    wait_for(browser, "return document.querySelector('#live').textContent === 'live'")
    index = json.loads(http_request(server["HTTP"], "POST", "/v2/repository/index")[2])
    assert len(index) == 4
    rows = wait_for(browser, "return document.querySelectorAll('#models tbody tr.model').length === 4") and \
        page_rows(browser)
    shown = {(r["model"], r["version"]): r["state"] for r in rows}
    assert shown == {(m["name"], int(m["version"])): m["state"] for m in index}
    assert shown[(HOSTILE, 1)] == "UNAVAILABLE"
    # Each model's runtime as /metrics names it: the one backend "auto" measured fastest for the
    # detector and the classifier ("openvino bf16" on a CPU with AVX512_BF16), ONNX Runtime otherwise.
    runtimes = {s.labels["model"]: s.labels["runtime"] for s in scrape(server["metrics"])
                if s.name == "quern_model_runtime"}
    assert {"objects", "imagenet", "small_cnn"} <= runtimes.keys(), runtimes
    for r in rows:
        if r["model"] in runtimes:
            assert r["layout"].startswith(runtimes[r["model"]] + ","), (r, runtimes)
    reason = browser.execute_script(
        "return document.querySelector('#models tr.reason [data-field=reason]').textContent")
    assert reason == next(m["reason"] for m in index if m["name"] == HOSTILE) and reason
    # The model's name is text on the page, not markup.
    assert browser.execute_script("return document.getElementById('injected')") is None
    assert HOSTILE in browser.find_element("css selector", "#models").text
    assert browser.title == "Quern"
    assert console_errors(browser) == []


def test_the_numbers_on_the_page_are_those_of_metrics_after_known_requests(server, browser):
    rng = np.random.default_rng(7)
    sent_ok, sent_bad = 23, 3
    for _ in range(sent_ok):
        status, _, body = kserve_infer(server["HTTP"], "small_cnn", rng.standard_normal((1, 3, 64, 64), np.float32))
        assert status == 200, body
    for _ in range(sent_bad):  # the wrong image size: refused as invalid
        status, _, _ = kserve_infer(server["HTTP"], "small_cnn", np.zeros((1, 3, 32, 32), np.float32))
        assert status == 400
    browser.get(f"http://127.0.0.1:{server['HTTP']}/")
    browser.execute_script("const w = document.getElementById('window'); w.value = '0';"
                           "w.dispatchEvent(new Event('change'));")  # all time, as /metrics counts
    row = None
    deadline = time.time() + 20
    while time.time() < deadline:
        row = next((r for r in page_rows(browser) if r["model"] == "small_cnn"), None)
        if row and row["requests"] == sent_ok + sent_bad:
            break
        time.sleep(0.2)
    assert row is not None and row["requests"] == sent_ok + sent_bad, row
    assert row["errors"] == sent_bad

    samples = scrape(server["metrics"])
    labels = {"model": "small_cnn", "version": "1"}
    assert value(samples, "quern_request_success_total", **labels) == sent_ok
    assert value(samples, "quern_request_failure_total", reason="invalid", **labels) == sent_bad
    for field, family in (("total", "quern_request_duration_us"), ("queue", "quern_queue_duration_us"),
                          ("infer", "quern_compute_infer_duration_us")):
        for q in ("p50", "p99"):
            expected = histogram_quantile(0.5 if q == "p50" else 0.99, samples, family, **labels)
            assert row[f"{field}_{q}"] == pytest.approx(expected, rel=1e-9), (field, q)
    assert row["queued"] == value(samples, "quern_pending_requests", **labels) == 0
    assert row["batch_limit"] == value(samples, "quern_batch_size_limit", **labels)

    # The details: failures by reason, and the batch sizes as /metrics' buckets count them.
    browser.execute_script("document.querySelector('#models tr.model[data-model=small_cnn]').click()")
    details = wait_for(browser, """
        const d = document.querySelector('#details .detail[data-model=small_cnn]');
        if (!d) return null;
        const out = {failures: {}, batches: {}};
        for (const c of d.querySelectorAll('[data-field^=failure_]:not([data-field^=failure_rate_])')) out.failures[c.dataset.field.slice(8)] = Number(c.dataset.value);
        for (const c of d.querySelectorAll('[data-bucket]')) out.batches[c.dataset.bucket] = Number(c.dataset.count);
        return out;""")
    assert details["failures"] == {"rejected": 0, "cancelled": 0, "timeout": 0, "invalid": sent_bad, "backend": 0}
    buckets = sorted((float(s.labels["le"]), s.value) for s in samples
                     if s.name == "quern_batch_size_bucket" and s.labels["model"] == "small_cnn")
    per_bucket, below, low = {}, 0, 1
    for bound, count in buckets:
        if count - below > 0:
            label = f"> {int(low - 1)}" if bound == float("inf") else (
                str(int(bound)) if low == bound else f"{int(low)}–{int(bound)}")
            per_bucket[label] = count - below
        below, low = count, bound + 1
    assert details["batches"] == per_bucket
    assert sum(per_bucket.values()) == value(samples, "quern_execution_count_total", **labels)
    assert console_errors(browser) == []


def test_the_test_page_draws_the_boxes_a_person_sees_in_the_photograph(server, browser):
    browser.get(f"http://127.0.0.1:{server['HTTP']}/")
    browser.find_element("id", "show-try").click()
    wait_for(browser, "return Array.from(document.querySelectorAll('#try-model option')).some(o => o.value === 'objects')")
    browser.execute_script("document.getElementById('try-model').value = 'objects';"
                           "document.getElementById('try-confidence').value = '0.3';")
    browser.find_element("id", "try-image").send_keys(os.path.abspath(os.path.join(PHOTOS, "dog.jpg")))
    browser.find_element("id", "try-run").click()
    drawn = wait_for(browser, """
        const rows = Array.from(document.querySelectorAll('#try-predictions tbody tr[data-label]'));
        if (rows.length === 0) return null;
        const canvas = document.getElementById('try-canvas');
        const ctx = canvas.getContext('2d');
        const scale = Number(canvas.dataset.scale);
        return rows.map(r => {
          const box = JSON.parse(r.dataset.box);
          // The pixel in the middle of the box's left edge, where its outline is drawn.
          const x = Math.round(box[0] * scale), y = Math.round((box[1] + box[3]) / 2 * scale);
          return {label: r.dataset.label, confidence: Number(r.dataset.confidence), box, color: r.dataset.color,
                  edge: Array.from(ctx.getImageData(x, y, 1, 1).data.slice(0, 3)),
                  width: canvas.width};
        });""", timeout=60)
    assert browser.find_element("id", "try-error").text == ""
    for names, region in DOG_OBJECTS:
        match = [d for d in drawn if d["label"] in names and iou(d["box"], region) >= 0.5]
        assert match, f"no {names} over {region} drawn: {drawn}"
    for d in drawn:
        want = [int(d["color"][i:i + 2], 16) for i in (1, 3, 5)]
        assert max(abs(a - b) for a, b in zip(d["edge"], want)) <= 48, (d, want)
    assert drawn[0]["width"] == 768  # dog.jpg at its own size (under 960 px)
    stages = browser.execute_script(
        "return Array.from(document.querySelectorAll('#try-timings tr')).map(r => r.dataset.stage)")
    assert stages == ["decode", "resize", "queue", "infer", "post", "round trip (this browser)"]

    # Boxes that share a corner (whole-image boxes, as a scene-like detector answers) get labels
    # that do not cover each other: the server's answer for the same photograph, with three such
    # boxes put in its place in the browser.
    browser.execute_script("""
        const real = window.fetch;
        window.fetch = async (url, options) => {
          const r = await real(url, options);
          if (!String(url).includes('/v1/vision/custom/')) return r;
          const answer = await r.json();
          answer.predictions = [0.9, 0.8, 0.7].map((confidence, i) => ({
            label: 'whole ' + i, confidence, x_min: 0, y_min: 0, x_max: 768, y_max: 576}));
          return new Response(JSON.stringify(answer), {status: r.status, headers: r.headers});
        };""")
    browser.find_element("id", "try-image").send_keys(os.path.abspath(os.path.join(PHOTOS, "dog.jpg")))
    browser.find_element("id", "try-run").click()
    rects = wait_for(browser, """
        const rows = Array.from(document.querySelectorAll('#try-predictions tbody tr[data-label]'));
        return rows.length === 3 && rows[0].dataset.label === 'whole 0' && rows.map(r => JSON.parse(r.dataset.labelAt));""",
                     timeout=60)
    for i, a in enumerate(rects):
        for b in rects[i + 1:]:
            apart = a[0] + a[2] <= b[0] or b[0] + b[2] <= a[0] or a[1] + a[3] <= b[1] or b[1] + b[3] <= a[1]
            assert apart, f"labels {a} and {b} cover each other"

    # A classification model: its labels, no boxes (POST /predict), those under the page's
    # "Min. confidence" left out as for detections.
    browser.execute_script("document.getElementById('try-model').value = 'imagenet';"
                           "document.getElementById('try-confidence').value = '0.3';")
    browser.find_element("id", "try-image").send_keys(os.path.abspath(os.path.join(PHOTOS, "eagle.jpg")))
    browser.find_element("id", "try-run").click()
    shown = wait_for(browser, """
        const rows = Array.from(document.querySelectorAll('#try-predictions tbody tr[data-label]'));
        return rows.length > 0 && rows.every(r => r.dataset.box === '') &&
               rows.map(r => [r.dataset.label, Number(r.dataset.confidence)]);""", timeout=60)
    labels = [label for label, _ in shown]
    assert {"bald eagle", "kite"} & set(labels[:2]), labels
    assert all(c >= 0.3 for _, c in shown), shown
    # The same photograph answered by the server itself: the classes the page left out are there.
    status, _, data = http_request(server["HTTP"], "POST", "/predict/imagenet",
                                   json.dumps({"image": base64.b64encode(open(os.path.join(PHOTOS, "eagle.jpg"), "rb").read()).decode()}).encode(),
                                   {"Content-Type": "application/json"}, timeout=60)
    assert status == 200, data
    assert any(p["confidence"] < 0.3 for p in json.loads(data)["predictions"]), "nothing for the threshold to leave out"
    assert console_errors(browser) == []


def test_the_vision_port_serves_the_dashboard_and_vision_stage_percentiles(server, browser):
    # An image on the vision port: its stages are in the details of `objects`.
    with open(os.path.join(PHOTOS, "person.jpg"), "rb") as f:
        image = f.read()
    boundary = "quernboundary"
    body = (f'--{boundary}\r\nContent-Disposition: form-data; name="image"; filename="p.jpg"\r\n\r\n'.encode() +
            image + f"\r\n--{boundary}--\r\n".encode())
    status, _, data = http_request(server["vision"], "POST", "/v1/vision/custom/objects", body,
                                   {"Content-Type": f"multipart/form-data; boundary={boundary}"}, timeout=60)
    assert status == 200 and json.loads(data)["success"], data
    browser.get(f"http://127.0.0.1:{server['vision']}/")
    browser.execute_script("const w = document.getElementById('window'); w.value = '0';"
                           "w.dispatchEvent(new Event('change'));")
    wait_for(browser, "return document.querySelectorAll('#models tbody tr.model').length === 4")
    browser.execute_script("document.querySelector('#models tr.model[data-model=objects]').click()")
    stages = wait_for(browser, """
        const cells = document.querySelectorAll('#details [data-field^=stage_]');
        return cells.length === 5 && Array.from(cells).map(c => [c.dataset.field.slice(6), Number(c.dataset.p50), Number(c.dataset.p99)]);""")
    samples = scrape(server["metrics"])
    for stage, p50, p99 in stages:
        assert p50 == pytest.approx(histogram_quantile(0.5, samples, "quern_vision_stage_duration_us",
                                                       model="objects", stage=stage), rel=1e-9), stage
        assert p99 == pytest.approx(histogram_quantile(0.99, samples, "quern_vision_stage_duration_us",
                                                       model="objects", stage=stage), rel=1e-9), stage
    # Every answered image is in its model's histograms (dog.jpg and eagle.jpg above, person.jpg here).
    assert value(samples, "quern_vision_stage_duration_us_count", stage="decode") == \
        value(samples, "quern_vision_timed_images_total") >= 1
    assert console_errors(browser) == []


def test_with_keys_the_state_needs_one_and_the_page_asks_for_it(repo, browser):
    env = dict(os.environ, QUERN_API_KEYS="sesame")
    proc, ports = start_quern(QUERN, str(repo), env=env)
    try:
        port = ports["HTTP"]
        # The page itself names no model: it is served without a key; its state is not.
        assert http_request(port, "GET", "/")[0] == 200
        status, _, body = http_request(port, "GET", "/dashboard/state")
        assert status == 401 and b"small_cnn" not in body
        assert http_request(port, "GET", "/dashboard/state", headers={"Authorization": "Bearer wrong"})[0] == 401
        status, _, body = http_request(port, "GET", "/dashboard/state", headers={"Authorization": "Bearer sesame"})
        assert status == 200 and "small_cnn" in {m["name"] for m in json.loads(body)["models"]}

        browser.get(f"http://127.0.0.1:{port}/")
        wait_for(browser, "return !document.getElementById('key-form').hidden")
        assert browser.execute_script("return document.querySelectorAll('#models tbody tr').length") == 0
        browser.find_element("id", "key").send_keys("sesame")
        browser.find_element("css selector", "#key-form button").click()
        wait_for(browser, "return document.querySelectorAll('#models tbody tr.model').length === 4")
        assert browser.execute_script("return document.getElementById('key-form').hidden") is True
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_the_files_are_served_with_a_content_security_policy(server):
    status, headers, body = http_request(server["HTTP"], "GET", "/")
    assert status == 200 and headers["Content-Type"].startswith("text/html") and b"/dashboard/app.js" in body
    assert "script-src 'self'" in headers["Content-Security-Policy"]
    assert "'unsafe-inline'" not in headers["Content-Security-Policy"]
    for path, kind in (("/dashboard/app.js", "text/javascript"), ("/dashboard/app.css", "text/css")):
        status, headers, body = http_request(server["HTTP"], "GET", path)
        assert status == 200 and headers["Content-Type"].startswith(kind) and len(body) > 1000
        assert headers["X-Content-Type-Options"] == "nosniff"
    # Nothing else under /dashboard/, and no path out of it.
    for path in ("/dashboard/", "/dashboard/../CMakeLists.txt", "/dashboard/index.html/", "/dashboard/state/x",
                 "/dashboard/app.js%00"):
        assert http_request(server["HTTP"], "GET", path)[0] == 404, path
    assert http_request(server["HTTP"], "POST", "/", b"x")[0] in (404, 405)
