#!/usr/bin/env bash
# gRPC benchmark: `quern perf` drives a real `quern serve` with ModelInfer
# (unary, one call in flight per caller) and ModelStreamInfer (requests in
# flight on bidirectional streams, at most 16 per stream: concurrency 64 = 4
# streams x 16); reports throughput, latency, the server's CPU time per
# request (from /proc, user + system, all threads, over warm-up and
# measurement) and the load generator's own, beside the raw ONNX Runtime
# ceiling X* measured in the same run. Two rows of bench/protocol_floor (canned
# answers, no engine) give what gRPC itself costs per call on this machine.
# Server and load generator share the machine's cores unless
# QUERN_BENCH_SERVER_CPUS / QUERN_BENCH_CLIENT_CPUS say otherwise.
#   bench/grpc_bench.sh [seconds per run, default 5]
#   QUERN_BENCH_PRESET=ci ...   # use another optimised build (default: release)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
SECS="${1:-5}"
WARMUP=1
ALL_CPUS="0-$(($(nproc) - 1))"
export QUERN_BENCH_SERVER_CPUS="${QUERN_BENCH_SERVER_CPUS:-$ALL_CPUS}"
export QUERN_BENCH_CLIENT_CPUS="${QUERN_BENCH_CLIENT_CPUS:-$ALL_CPUS}"
# shellcheck source=bench/serve_lib.sh
source bench/serve_lib.sh
cmake --build --preset "$PRESET" --target engine_bench protocol_floor >/dev/null
mkdir -p "$WORK/repo"
MODELS="identity small_cnn resnet50"
for m in $MODELS; do ln -s "$ROOT/bench/models/$m" "$WORK/repo/$m"; done

declare -A XSTAR
for m in small_cnn resnet50; do
  if [ "$m" = small_cnn ]; then args=(--max-batch 32 --raw-batches 8 32); else args=(--max-batch 8 --raw-batches 1 2 4); fi
  out=$(build/$PRESET/bench/engine_bench --model "bench/models/$m/1/model.onnx" --seconds "$SECS" "${args[@]}" \
        --submitters 1 --gain-submitters 0)
  XSTAR[$m]=$(echo "$out" | awk '/ceiling X\*/ {print $4}')
  echo "$m: X* ${XSTAR[$m]} items/s"
done

TCK=$(getconf CLK_TCK)
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
# row LABEL PID MODEL CALL CONCURRENCY: one line.
row() {
  local label=$1 pid=$2 model=$3 call=$4 c=$5 flags=() t0 t1 line
  if [ "$call" = stream ]; then
    local streams=$(((c + 15) / 16))
    flags=(--grpc-stream --stream-inflight $((c / streams)) -c "$streams")
  else
    flags=(-c "$c")
  fi
  t0=$(cpu_ticks "$pid")
  line=$(taskset -c "$CLIENT_CPUS" "$QUERN" perf --url "grpc://127.0.0.1:$GRPC_PORT" -m "$model" "${flags[@]}" \
    -s "$SECS" --warmup "$WARMUP" --format csv | tail -1 || true)  # a level nothing finished in still prints
  t1=$(cpu_ticks "$pid")
  # mode,value,requests_per_s,p50_ms,p90,p95,p99,ok,errors,client_us,...
  echo "$line" | awk -F, -v l="$label" -v call="$call" -v c="$c" -v d="$((t1 - t0))" -v k="$TCK" \
    -v s="$((SECS + WARMUP))" -v x="${XSTAR[$model]:-0}" '{
      ratio = x > 0 ? sprintf("%.3f", $3 / x) : "-"
      printf "%-22s %-7s %5s  %9.0f  %6s  %8.3f  %8.3f  %9.1f  %9.1f%s\n", l, call, c, $3, ratio, $4, $7,
             d / k / ($3 * s) * 1e6, $10, ($9 > 0 ? "  errors " $9 : "")
    }'
}

echo "model                  call    conc.      req/s    x X*    p50 ms    p99 ms  server us  client us  (CPU per request)"
start_server "$WORK/repo" --allow-links-outside-repository
for model in $MODELS; do
  for call in unary stream; do
    for c in 1 4 16 64; do row "$model" "$SERVER" "$model" "$call" "$c"; done
  done
done
stop_server
taskset -c "$SERVER_CPUS" "build/$PRESET/bench/protocol_floor" --grpc-port "$GRPC_PORT" --model identity \
  --input x:FP32:-1,4 --output y:FP32:-1,4 &
SERVER=$!
sleep 1
row "(floor) identity" "$SERVER" identity unary 16
row "(floor) identity" "$SERVER" identity stream 64
