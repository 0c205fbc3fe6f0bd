#!/usr/bin/env bash
# The camera's case: one request in flight. For ResNet-50 and a detector of
# YOLOv5n's cost ([1, 25200, 85] output), prints the engine's default layout
# against raw ONNX Runtime's best layout for one request in flight, measured
# side by side (engine_bench --raw-per-concurrency), RUNS times, and the
# median ratio. Run it after changing the scheduler or a backend.
#   bench/camera.sh [RUNS, default 3] [seconds per measurement, default 4] [in flight, default 1]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
RUNS="${1:-3}"
SECS="${2:-4}"
INFLIGHT="${3:-1}"
scripts/setup.sh
build/venv/bin/python scripts/gen_models.py --bench bench/models --quiet
cmake --preset release >/dev/null
cmake --build --preset release --target engine_bench >/dev/null
B=build/release/bench/engine_bench
for model in resnet50 detect_v5n; do
  echo "### $model, $INFLIGHT in flight: raw layout, raw items/s, engine items/s, engine / raw"
  ratios=()
  for ((i = 1; i <= RUNS; i++)); do
    line=$($B --model "bench/models/$model/1/model.onnx" --seconds "$SECS" --warmup 2 --max-batch 8 \
      --submitters "$INFLIGHT" --raw-per-concurrency | tail -1)
    echo "$line"
    ratios+=("$(echo "$line" | awk '{print $5}')")
  done
  printf '%s\n' "${ratios[@]}" | sort -g | awk '{v[NR]=$1} END {printf "median engine / raw: %s\n\n", v[int((NR+1)/2)]}'
done
