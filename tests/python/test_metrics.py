"""Every metric docs/metrics.md documents is exported by a live `quern serve` (with a vision model,
results in a real redis-server and the stream consumer on, so that every family exists), with the
type the document gives; and nothing is exported under quern_ that the document does not name."""
import os
import re
import shutil
from pathlib import Path

import pytest

from quern_testing import RedisServer, http_request, start_quern

QUERN = os.environ["QUERN_BIN"]
MODELS = os.environ["QUERN_TEST_MODELS"]
DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def documented():
    """{name: type} from the document's tables: each row's first cell names one or more metrics
    (in backticks, labels in braces), its second cell their type."""
    out = {}
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.replace("\\|", "/").split("|")]  # "\|" is a | inside a cell
        if len(cells) < 4 or not cells[1].startswith("`"):
            continue
        kind = cells[2]
        for name in re.findall(r"`([a-z_]+)(?:\{[^`]*\})?`", cells[1]):
            out[name] = kind
    return out


def exported(text):
    """{name: type} from the # TYPE lines of Prometheus text."""
    return dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))


@pytest.fixture
def server(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    for m in ("add_sub", "detect_yolov8"):
        shutil.copytree(os.path.join(MODELS, m), repo / m)
    # A name a directory may have: its label value must be escaped.
    shutil.copytree(os.path.join(MODELS, "add_sub"), repo / 'add"sub')
    redis = RedisServer(tmp_path)
    proc, ports = start_quern(QUERN, str(repo), "--redis-url", redis.url(), "--consume")
    yield ports
    proc.terminate()
    proc.wait(timeout=30)
    redis.stop()


def test_every_documented_metric_is_exported_with_its_type(server):
    doc = documented()
    assert len(doc) >= 35, f"the document's tables were not read: {doc}"
    status, _, body = http_request(server["metrics"], "GET", "/metrics")
    assert status == 200
    live = exported(body.decode())
    missing = sorted(n for n in doc if n not in live)
    assert not missing, f"documented but not exported: {missing}"
    wrong = sorted((n, doc[n], live[n]) for n in doc if live[n] != doc[n])
    assert not wrong, f"documented with another type (name, documented, exported): {wrong}"
    undocumented = sorted(n for n in live if n.startswith("quern_") and n not in doc)
    assert not undocumented, f"exported but not documented: {undocumented}"


def test_the_exposition_parses_with_each_family_once(server):
    """Read by the reference parser (prometheus_client's): a model named with a quote is escaped in
    its labels, and every family has one header, its samples together."""
    from prometheus_client.parser import text_string_to_metric_families

    status, _, body = http_request(server["metrics"], "GET", "/metrics")
    assert status == 200
    text = body.decode()
    types = re.findall(r"^# TYPE (\S+) ", text, re.M)
    assert len(types) == len(set(types)), f"a family declared twice: {sorted(types)}"
    families = list(text_string_to_metric_families(text))
    assert len(families) == len(types)
    models = {s.labels.get("model") for f in families for s in f.samples if s.name == "quern_request_success_total"}
    assert models == {"add_sub", 'add"sub', "detect_yolov8"}, models
    # Samples of one family are contiguous: the parser would otherwise start the family again.
    seen, last = set(), None
    for line in text.splitlines():
        if line.startswith("#") or not line:
            continue
        name = re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", line).group(0)
        family = re.sub(r"_(bucket|sum|count)$", "", name) if name not in types else name
        if family != last:
            assert family not in seen, f"samples of {family} are not together"
            seen.add(family)
            last = family
