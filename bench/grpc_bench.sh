#!/usr/bin/env bash
# gRPC benchmark: bench/grpc_load (C++, the project's proto, gRPC callback
# client) drives a real `quern serve` with ModelInfer (unary, one call in flight
# per connection) and ModelStreamInfer (requests in flight on bidirectional
# streams, at most 16 per stream); reports throughput, latency and the
# server's CPU time per request (from /proc, user + system, all threads),
# beside the raw ONNX Runtime ceiling X* measured in the same run. A ServerLive
# row gives gRPC's own cost per unary call (no engine work) on this machine.
# The load generator's own CPU per request (user + system) is shown beside it.
#   bench/grpc_bench.sh [seconds per run, default 5]
#   QUERN_BENCH_PRESET=ci ...   # use another optimised build (default: release)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
SECS="${1:-5}"
build/venv/bin/python scripts/gen_models.py --bench bench/models --quiet
PRESET="${QUERN_BENCH_PRESET:-release}"
cmake --preset "$PRESET" >/dev/null
cmake --build --preset "$PRESET" --target quern engine_bench grpc_load >/dev/null
WORK=$(mktemp -d)
trap 'kill $SERVER 2>/dev/null || true; rm -rf "$WORK"' EXIT
mkdir -p "$WORK/repo"
MODELS="identity small_cnn resnet50"
for m in $MODELS; do ln -s "$ROOT/bench/models/$m" "$WORK/repo/$m"; done

declare -A XSTAR SHAPE INPUT
SHAPE=([identity]=1,4 [small_cnn]=1,3,64,64 [resnet50]=1,3,224,224)
INPUT=([identity]=x [small_cnn]=input [resnet50]=input)
for m in small_cnn resnet50; do
  if [ "$m" = small_cnn ]; then args=(--max-batch 32 --raw-batches 8 32); else args=(--max-batch 8 --raw-batches 1 2 4); fi
  out=$(build/$PRESET/bench/engine_bench --model "bench/models/$m/1/model.onnx" --seconds "$SECS" "${args[@]}" \
        --submitters 1 --gain-submitters 0)
  XSTAR[$m]=$(echo "$out" | awk '/ceiling X\*/ {print $4}')
  echo "$m: X* ${XSTAR[$m]} items/s"
done

build/$PRESET/src/cli/quern serve --model-repository "$WORK/repo" --allow-links-outside-repository --http-port 0 --grpc-port 0 --metrics-port 0 \
  --host 127.0.0.1 > "$WORK/log" 2>&1 &
SERVER=$!
for _ in $(seq 100); do grep -q "gRPC listening" "$WORK/log" && break; sleep 0.2; done
PORT=$(grep -o 'gRPC listening on [^ ]*' "$WORK/log" | sed 's/.*://')

cpu_ticks() { awk '{print $14 + $15}' "/proc/$SERVER/stat"; }
TCK=$(getconf CLK_TCK)
# run MODEL CALL CONCURRENCY: one row.
run() {
  local model=$1 call=$2 c=$3 conns inflight mode=$2
  if [ "$call" = stream ]; then conns=$(((c + 15) / 16)); inflight=$((c / conns)); else conns=$c; inflight=1; fi
  build/$PRESET/bench/grpc_load --target "127.0.0.1:$PORT" --mode "$mode" --model "$model" \
    --input "${INPUT[$model]}" --shape "${SHAPE[$model]}" --connections "$conns" --inflight "$inflight" \
    --seconds 1 --warmup 0 >/dev/null  # warm-up, not measured
  local t0 t1 out
  t0=$(cpu_ticks)
  { time build/$PRESET/bench/grpc_load --target "127.0.0.1:$PORT" --mode "$mode" --model "$model" \
    --input "${INPUT[$model]}" --shape "${SHAPE[$model]}" --connections "$conns" --inflight "$inflight" \
    --seconds "$SECS" --warmup 0 > "$WORK/out"; } 2> "$WORK/client_cpu"
  out=$(cat "$WORK/out")
  t1=$(cpu_ticks)
  local client
  client=$(awk '{print $1 + $2}' "$WORK/client_cpu")
  echo "$out" | awk -v m="$model" -v call="$call" -v c="$c" -v t="$((t1 - t0))" -v k="$TCK" -v x="${XSTAR[$model]:-0}" \
      -v cl="$client" '
    { for (i = 1; i <= NF; i++) { split($i, kv, "="); v[kv[1]] = kv[2] } }
    END {
      ratio = (x > 0 && call != "live") ? sprintf("%.3f", v["rps"] / x) : "-"
      n = v["ok"] > 0 ? v["ok"] : 1
      printf "%-12s %-7s %5s  %9s  %6s  %7sus  %7sus  %9.1f  %9.1f%s\n", m, call, c, v["rps"], ratio, v["p50_us"],
             v["p99_us"], t / k * 1e6 / n, cl * 1e6 / n, (v["errors"] > 0 ? "  errors " v["errors"] : "")
    }'
}
TIMEFORMAT="%U %S"  # bash's `time`: the load generator's user and system CPU seconds
echo "model        call    conc.   req/s      x X*    p50        p99        server us  client us  (CPU per request)"
run identity live 16
for model in $MODELS; do
  for call in unary stream; do
    for c in 1 4 16 64; do run "$model" "$call" "$c"; done
  done
done
