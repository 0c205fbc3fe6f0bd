#!/usr/bin/env bash
# Generates the benchmark models and runs the engine benchmark on each.
#   bench/run.sh [seconds per configuration, default 3]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
SECS="${1:-3}"
scripts/setup.sh
build/venv/bin/python scripts/gen_models.py --bench bench/models --quiet
cmake --preset release >/dev/null
cmake --build --preset release --target engine_bench
B=build/release/bench/engine_bench
echo "### small_cnn (generated, ~6 MFLOPs)"
$B --model bench/models/small_cnn/1/model.onnx --seconds "$SECS" --max-batch 32 --raw-batches 1 8 32
echo
echo "### text_direction (PP-OCR mobile v2.0 direction classifier, real weights)"
$B --model third_party/ocr-models/ch_ppocr_mobile_v2.0_cls_infer.onnx --item-shape 3 48 192 \
   --seconds "$SECS" --max-batch 32 --raw-batches 1 4 8 16
echo
echo "### resnet50 (generated, ResNet-50 v1.5 architecture)"
$B --model bench/models/resnet50/1/model.onnx --seconds "$SECS" --max-batch 8 --raw-batches 1 2 4 8 \
   --submitters 1 4 16
