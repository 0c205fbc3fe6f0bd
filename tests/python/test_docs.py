"""The documentation cannot drift from the server it describes.

- Every shell example of the front page, the getting-started page and the API pages that shows an
  answer (the `# ...` lines after a command) is run as written against a real `quern serve` of the
  example repository, and the answer it prints must read as shown: the same text, `...` standing
  for anything, numbers within what another CPU or runtime moves them by (a confidence within 0.05,
  a pixel coordinate within 8 px or 5 %, counts and ids exactly).
- The configuration reference is the binary's own `--help` (scripts/gen_config_doc.py --check).
- The site builds with MkDocs in strict mode: a broken link or anchor fails it.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from quern_testing import start_quern

QUERN = os.environ["QUERN_BIN"]
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
PAGES = ["README.md", "docs/getting-started.md", "docs/api/http.md", "docs/api/grpc.md", "docs/api/vision.md",
         "docs/api/jobs.md"]
NUMBER = r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?"


def examples(page):
    """[(line, commands, shown)] of a page's ```sh blocks: the commands before each shown answer."""
    out = []
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        lines = f.read().split("\n")
    inside, pending, shown, start = False, [], [], 0
    for number, line in enumerate(lines, 1):
        if shown and (line.startswith("```") or not line.startswith("#")):
            out.append((start, "\n".join(pending), "".join(shown)))
            pending, shown = [], []
        if line.startswith("```"):
            inside, pending = line.strip() == "```sh", []
            continue
        if not inside or (not line.strip() and not pending):
            continue
        if line.startswith("#"):
            if pending:
                shown.append(re.sub(r"\s+<-\s.*$", "", line[1:].strip()))
            continue
        if not line.strip():
            pending = []
            continue
        if not pending:
            start = number
        pending.append(line)
    return out


def close(shown, got):
    """Whether a number printed `got` reads as the documented `shown`."""
    s, g = float(shown), float(got)
    if re.fullmatch(r"-?\d+", shown):
        return s == g if abs(s) < 50 else abs(s - g) <= max(8, 0.05 * abs(s))
    return abs(s - g) <= 0.05 if abs(s) <= 1 else abs(s - g) <= 0.02 * abs(s)


def reads_as(shown, output):
    """None when `output` reads as `shown`, else why not."""
    pattern, numbers = "", []
    for piece in re.split(r"(\.\.\.|" + NUMBER + r"|\s+)", shown):
        if piece == "...":
            pattern += ".*?"
        elif re.fullmatch(NUMBER, piece):
            pattern += "(" + NUMBER + ")"
            numbers.append(piece)
        elif piece.isspace():
            pattern += r"\s*"
        else:
            pattern += re.escape(piece)
    m = re.search(pattern, output, re.S)
    if not m:
        return "the text differs"
    for want, got in zip(numbers, m.groups()):
        if not close(want, got):
            return f"{got} where the page shows {want}"
    return None


ALL = [(page, *e) for page in PAGES for e in examples(page)]


def test_the_pages_have_examples_to_run():
    # The parser itself: a page that lost its answers would silently check nothing.
    assert len([e for e in ALL if e[0] == "docs/getting-started.md"]) >= 7
    for page in ("README.md", "docs/api/jobs.md", "docs/api/grpc.md", "docs/api/vision.md"):
        assert any(e[0] == page for e in ALL), page
    assert reads_as('{"a":0.910,...,"n":3}', '{"a":0.93,"b":[1,2],"n":3}') is None
    assert reads_as('{"a":0.910,...,"n":3}', '{"a":0.81,"n":3}') is not None
    assert reads_as('{"x":127}', '{"x":140}') is not None and reads_as('{"x":127}', '{"x":133}') is None


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc, ports = start_quern(QUERN, os.path.join(ROOT, "examples", "models"), start_timeout=300)
    work = tmp_path_factory.mktemp("docs")
    os.symlink(os.path.join(ROOT, "examples"), work / "examples")
    yield ports, work
    proc.terminate()
    proc.wait(timeout=60)


@pytest.mark.parametrize("page,line,commands,shown", ALL, ids=[f"{e[0]}:{e[1]}" for e in ALL])
def test_the_example_answers_as_shown(server, page, line, commands, shown):
    ports, work = server
    script = (commands.replace("localhost:8000", f"127.0.0.1:{ports['HTTP']}")
              .replace("localhost:8001", f"127.0.0.1:{ports['gRPC']}")
              .replace("build/release/src/cli/quern", QUERN)
              .replace("build/venv/bin/python", sys.executable))
    env = dict(os.environ, JOB_ID=server_job_id(work))
    # A job's answer may still say queued or running on a busy machine: asked again until it reads as
    # shown (60 s at most), as its client would poll.
    deadline = time.monotonic() + (60 if "/v2/jobs/" in commands else 0)
    while True:
        run = subprocess.run(["bash", "-c", script], cwd=work, env=env, capture_output=True, text=True, timeout=120)
        got = run.stdout
        why = reads_as(shown, got)
        if why is None or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for job in re.findall(r'"job_id":"([^"]+)"', got):
        (work / "job_id").write_text(job)
    assert run.returncode == 0 and why is None, (
        f"{page}:{line}: the example\n{commands}\nanswered\n{got}{run.stderr}\nwhere the page shows\n{shown}\n({why})")


def server_job_id(work):
    path = work / "job_id"
    return path.read_text() if path.exists() else ""


def test_the_configuration_reference_is_the_binarys_help():
    run = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gen_config_doc.py"), QUERN, "--check"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr


def test_the_site_builds_strictly(tmp_path):
    mkdocs = shutil.which("mkdocs", path=os.path.dirname(sys.executable))
    assert mkdocs, "mkdocs is not installed beside this Python (scripts/setup.sh installs it)"
    run = subprocess.run([mkdocs, "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=ROOT,
                         capture_output=True, text=True, timeout=300, env=dict(os.environ, NO_MKDOCS_2_WARNING="1"))
    assert run.returncode == 0, run.stdout + run.stderr
    assert (tmp_path / "site" / "api" / "http" / "index.html").exists()
