#!/usr/bin/env bash
# Generates the benchmark models and runs the engine benchmark on both.
#   bench/run.sh [seconds per configuration, default 5]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
SECS="${1:-5}"
scripts/setup.sh
build/venv/bin/python scripts/gen_models.py --bench bench/models --quiet
cmake --preset release >/dev/null
cmake --build --preset release --target engine_bench
B=build/release/bench/engine_bench
echo "### small_cnn"
$B --model bench/models/small_cnn/1/model.onnx --seconds "$SECS" --max-batch 32
echo
echo "### resnet50"
$B --model bench/models/resnet50/1/model.onnx --seconds "$SECS" --max-batch 16 --raw-batches 1 2 4 8 16
