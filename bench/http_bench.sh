#!/usr/bin/env bash
# HTTP benchmark: wrk (Debian) posts KServe v2 binary-tensor requests to a
# real `quern serve`; reports throughput, latency and the server's CPU time
# per request (from /proc, user + system, all threads), beside the raw ONNX
# Runtime ceiling X* and Engine-direct throughput measured in the same run.
#   bench/http_bench.sh [seconds per run, default 5]
#   QUERN_BENCH_PRESET=ci ...   # use another optimised build (default: release)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
SECS="${1:-5}"
command -v wrk >/dev/null || { echo "needs wrk: apt-get install wrk"; exit 1; }
build/venv/bin/python scripts/gen_models.py --bench bench/models --quiet
PRESET="${QUERN_BENCH_PRESET:-release}"
cmake --preset "$PRESET" >/dev/null
cmake --build --preset "$PRESET" --target quern engine_bench >/dev/null
WORK=$(mktemp -d)
trap 'kill $SERVER 2>/dev/null || true; rm -rf "$WORK"' EXIT
mkdir -p "$WORK/repo"
MODELS="identity small_cnn resnet50"
for m in $MODELS; do ln -s "$ROOT/bench/models/$m" "$WORK/repo/$m"; done

# The ceiling and Engine-direct figures (engine_bench), before the server starts.
declare -A XSTAR ENGINE
for m in small_cnn resnet50; do
  if [ "$m" = small_cnn ]; then args=(--max-batch 32 --raw-batches 8 32); else args=(--max-batch 8 --raw-batches 1 2 4); fi
  out=$(build/$PRESET/bench/engine_bench --model "bench/models/$m/1/model.onnx" --seconds "$SECS" "${args[@]}" \
        --submitters 64 --gain-submitters 0)
  XSTAR[$m]=$(echo "$out" | awk '/ceiling X\*/ {print $4}')
  ENGINE[$m]=$(echo "$out" | awk '$1 == "64" {print $3}')
  echo "$m: X* ${XSTAR[$m]} items/s, Engine-direct ${ENGINE[$m]} items/s at 64 in flight"
done

build/$PRESET/src/cli/quern serve --model-repository "$WORK/repo" --allow-links-outside-repository --http-port 0 --metrics-port 0 \
  --host 127.0.0.1 > "$WORK/log" 2>&1 &
SERVER=$!
for _ in $(seq 100); do grep -q "HTTP listening" "$WORK/log" && break; sleep 0.2; done
PORT=$(grep -o 'HTTP listening on [^ ]*' "$WORK/log" | sed 's/.*://')

# One request body per model: JSON header + binary input (batch 1).
build/venv/bin/python - "$WORK" <<'PY'
import json, sys, numpy as np
work = sys.argv[1]
for name, shape, inp in [("identity", [1, 4], "x"), ("small_cnn", [1, 3, 64, 64], "input"),
                         ("resnet50", [1, 3, 224, 224], "input")]:
    data = np.random.default_rng(0).standard_normal(shape).astype(np.float32).tobytes()
    header = json.dumps({"inputs": [{"name": inp, "shape": shape, "datatype": "FP32",
                                     "parameters": {"binary_data_size": len(data)}}],
                         "parameters": {"binary_data_output": True}}).encode()
    open(f"{work}/{name}.body", "wb").write(header + data)
    open(f"{work}/{name}.len", "w").write(str(len(header)))
PY

cpu_ticks() { awk '{print $14 + $15}' "/proc/$SERVER/stat"; }
TCK=$(getconf CLK_TCK)
# CPU per request: the server process (all threads) and wrk (user + system, bash's `time`).
TIMEFORMAT="%U %S"
echo "model        conns   req/s      x X*    p50        p99        server us  wrk us  (CPU per request)"
for model in $MODELS; do
  cat > "$WORK/$model.lua" <<LUA
wrk.method = "POST"
local f = io.open("$WORK/$model.body", "rb"); wrk.body = f:read("*a"); f:close()
wrk.headers["Inference-Header-Content-Length"] = "$(cat "$WORK/$model.len")"
wrk.headers["Content-Type"] = "application/octet-stream"
LUA
  for c in 1 4 16 64; do
    t0=$(cpu_ticks)
    { time wrk -t 1 -c "$c" -d "${SECS}s" --timeout 20s --latency -s "$WORK/$model.lua" \
          "http://127.0.0.1:$PORT/v2/models/$model/infer" > "$WORK/out"; } 2> "$WORK/wrk_cpu"
    out=$(cat "$WORK/out")
    t1=$(cpu_ticks)
    reqs=$(echo "$out" | awk '/requests in/ {print $1}')
    rps=$(echo "$out" | awk '/Requests\/sec/ {print $2}')
    p50=$(echo "$out" | awk '$1 == "50%" {print $2}')
    p99=$(echo "$out" | awk '$1 == "99%" {print $2}')
    errors=$(echo "$out" | grep -E "Non-2xx|Socket errors" || true)
    us=$(awk -v t="$((t1 - t0))" -v k="$TCK" -v n="$reqs" 'BEGIN {printf "%.1f", t / k * 1e6 / n}')
    wrk_us=$(awk -v n="$reqs" '{printf "%.1f", ($1 + $2) * 1e6 / n}' "$WORK/wrk_cpu")
    ratio=$(awk -v r="$rps" -v x="${XSTAR[$model]:-0}" 'BEGIN {if (x > 0) printf "%.3f", r / x; else print "-"}')
    printf "%-12s %5s  %9s  %6s  %9s  %9s  %9s  %9s %s\n" "$model" "$c" "$rps" "$ratio" "$p50" "$p99" "$us" \
           "$wrk_us" "$errors"
  done
done
