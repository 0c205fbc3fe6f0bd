#!/usr/bin/env bash
# Engine vs raw ONNX Runtime on one GPU (CUDA execution provider): the batch-size curve of raw
# sessions and the engine's KIND_GPU instances at several requests in flight, on one model.
#   QUERN_WITH_CUDA=1 scripts/setup.sh && cmake --preset release && cmake --build build/release
#   bench/gpu_bench.sh [GPU] [MODEL.onnx] [SECONDS]
# Needs a machine where CUDA sees a device; says so and stops elsewhere.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
GPU="${1:-0}"
MODEL="${2:-$ROOT/bench/models/small_cnn/1/model.onnx}"
SECONDS_PER="${3:-5}"
BIN="$ROOT/build/${QUERN_BENCH_PRESET:-release}/bench/engine_bench"
LIB="$ROOT/third_party/onnxruntime/lib"
if ! python3 -c 'import ctypes,sys; c=ctypes.CDLL("libcuda.so.1"); n=ctypes.c_int(); sys.exit(c.cuInit(0) or c.cuDeviceGetCount(ctypes.byref(n)) or n.value == 0)' 2>/dev/null; then
  echo "gpu_bench: CUDA sees no device on this machine; nothing measured" >&2
  exit 3
fi
[ -f "$LIB/libonnxruntime_providers_cuda.so" ] || { echo "gpu_bench: run scripts/setup.sh with QUERN_WITH_CUDA=1 first" >&2; exit 2; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
"$BIN" --model "$MODEL" --gpu "$GPU" --seconds "$SECONDS_PER" --max-batch 64 \
  --raw-batches 1 2 4 8 16 32 64 --submitters 1 4 16 64 --tuning on --gain-submitters 16
