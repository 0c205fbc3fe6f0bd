#!/usr/bin/env bash
# The embedded package against onnxruntime-python of the same ONNX Runtime version as Quern's
# (scripts/setup.sh's ORT_VERSION), in a venv of its own (build/bench-venv: onnxruntime and numpy
# from PyPI), on the release build's extension. Arguments go to bench/python_embed_bench.py.
#   bench/python_embed_bench.sh [--model examples/models/small_cnn] [--threads 4 8 16] [--rounds 5]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
scripts/setup.sh
ORT_VERSION=$(sed -n 's/^ORT_VERSION=//p' scripts/setup.sh)
VENV=build/bench-venv
if [ "$(cat "$VENV/.onnxruntime" 2>/dev/null)" != "$ORT_VERSION" ]; then
  echo "[bench] creating $VENV with onnxruntime $ORT_VERSION"
  rm -rf "$VENV"
  /usr/bin/python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --disable-pip-version-check "onnxruntime==$ORT_VERSION" "numpy<2"
  echo "$ORT_VERSION" >"$VENV/.onnxruntime"
fi
cmake --preset release >/dev/null
cmake --build --preset release --target _quern >/dev/null
[ $# -gt 0 ] || set -- --model examples/models/small_cnn --threads 1 4 8 16 --seconds 3 --rounds 5
PYTHONPATH=build/release/python exec "$VENV/bin/python" bench/python_embed_bench.py "$@"
