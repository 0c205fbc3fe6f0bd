#!/usr/bin/env python3
"""Screenshots of the dashboard for docs/: the status tab under a little load, and the test page with
the boxes found in examples/data/dog.jpg. Uses the same headless Chromium as tests/python/test_dashboard.py.

    build/venv/bin/python scripts/dashboard_screenshot.py build/release/src/cli/quern docs/
"""
import io
import json
import os
import shutil
import sys
import tempfile
import threading
import time

import numpy as np
from PIL import Image
from selenium import webdriver
from selenium.webdriver.chrome.service import Service

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.join(ROOT, "tests", "python"))
from quern_testing import http_request, post_form, start_quern  # noqa: E402

MODELS = os.path.join(ROOT, "examples", "models")
PHOTOS = os.path.join(ROOT, "examples", "data")


def load(port, stop):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((1, 3, 64, 64), np.float32)
    body = json.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 3, 64, 64],
                                   "data": x.ravel().tolist()}]})
    with open(os.path.join(PHOTOS, "person.jpg"), "rb") as f:
        photo = f.read()
    while not stop.is_set():
        for _ in range(8):
            http_request(port, "POST", "/v2/models/small_cnn/infer", body, {"Content-Type": "application/json"})
        post_form(port, "/v1/vision/custom/objects", [("image", photo)])
        time.sleep(0.02)


def save(driver, path):
    Image.open(io.BytesIO(driver.get_screenshot_as_png())).convert("RGB").save(path, quality=85, optimize=True)
    print("wrote", path)


def main():
    binary, out = sys.argv[1], sys.argv[2]
    repo = tempfile.mkdtemp()
    for m in ("objects", "imagenet", "faces", "small_cnn", "add_sub"):
        shutil.copytree(os.path.join(MODELS, m), os.path.join(repo, m))
    proc, ports = start_quern(binary, repo)
    stop = threading.Event()
    threads = [threading.Thread(target=load, args=(ports["HTTP"], stop)) for _ in range(2)]
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1280,900", "--hide-scrollbars"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
    try:
        driver.get(f"http://127.0.0.1:{ports['HTTP']}/")
        for t in threads:
            t.start()
        time.sleep(12)
        driver.execute_script("document.querySelector('#models tr.model[data-model=objects]').click()")
        time.sleep(1.5)
        save(driver, os.path.join(out, "dashboard.jpg"))
        stop.set()
        for t in threads:
            t.join()
        driver.find_element("id", "show-try").click()
        driver.execute_script("document.getElementById('try-model').value = 'objects';"
                              "document.getElementById('try-confidence').value = '0.3';")
        driver.find_element("id", "try-image").send_keys(os.path.abspath(os.path.join(PHOTOS, "dog.jpg")))
        driver.find_element("id", "try-run").click()
        time.sleep(3)
        save(driver, os.path.join(out, "dashboard-try.jpg"))
    finally:
        stop.set()
        driver.quit()
        proc.terminate()
        proc.wait(timeout=30)
        shutil.rmtree(repo)


if __name__ == "__main__":
    main()
