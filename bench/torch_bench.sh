#!/usr/bin/env bash
# ResNet-50 (torchvision's architecture, random weights) through LibTorch and through ONNX Runtime:
# each runtime's own best on this machine (raw, no server) beside Quern's engine serving the same
# model, the TorchScript file and its ONNX export written by tests/python/make_torch_models.py
# with Debian's torch. LibTorch's thread pool is one per process, so each LibTorch layout runs in
# a process of its own: one module on every core (intra-op threads = cores), or one caller per
# core on one thread each.
#   bench/torch_bench.sh [seconds per setting, default 5]
#   QUERN_BENCH_PRESET=ci ...   # another optimised build (default: release)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
SECS="${1:-5}"
PRESET="${QUERN_BENCH_PRESET:-release}"
cmake --preset "$PRESET" >/dev/null
cmake --build --preset "$PRESET" --target torch_bench engine_bench >/dev/null
B="build/$PRESET/bench"
CORES=$(nproc)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
/usr/bin/python3 tests/python/make_torch_models.py "$WORK/gen" --resnet >/dev/null
PT="$WORK/gen/resnet50/1/model.pt"
# A repository per layout, each with the one model (hard links to the same file): raw runs read
# model.pt and its config; the engine serves every core on one instance, or one instance per core.
layout() {  # layout NAME INSTANCES
  mkdir -p "$WORK/$1/resnet50/1"
  ln "$PT" "$WORK/$1/resnet50/1/model.pt"
  cat > "$WORK/$1/resnet50/config.pbtxt" <<CONFIG
platform: "pytorch_libtorch"
max_batch_size: 8
input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 3, 224, 224 ] } ]
output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 1000 ] } ]
dynamic_batching { }
instance_group [ { count: $2 } ]
CONFIG
}
layout wide 1
layout narrow "$CORES"
echo "== LibTorch, raw"
"$B/torch_bench" --repo "$WORK/wide" --mode raw --threads "$CORES" --callers 1 --batches 1 2 4 --seconds "$SECS"
"$B/torch_bench" --repo "$WORK/wide" --mode raw --threads 1 --callers "$CORES" --batches 1 2 --seconds "$SECS"
echo "== LibTorch through Quern's engine: one instance on $CORES threads, then $CORES instances on one each"
"$B/torch_bench" --repo "$WORK/wide" --mode engine --submitters 1 2 4 --seconds "$SECS"
"$B/torch_bench" --repo "$WORK/narrow" --mode engine --submitters 1 2 4 --seconds "$SECS"
echo "== ONNX Runtime (the same module exported to ONNX), raw and through Quern's engine"
"$B/engine_bench" --model "$WORK/gen/resnet50_onnx/1/model.onnx" --seconds "$SECS" --submitters 1 2 4 \
  --raw-batches 1 2 4 --gain-submitters 0
