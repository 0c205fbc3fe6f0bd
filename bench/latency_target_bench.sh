#!/usr/bin/env bash
# Batching settings under a step change in load: one `quern serve` holds the
# same model (the small CNN by default) under several configurations, fixed
# ones and ones with a latency target (quern.latency_target_ms), and
# `quern perf` drives each with 1, then 16, then 64 clients (closed loop, no
# warm-up between the steps, so each step's first requests meet the batching
# state the previous load left). Per configuration and step: requests/s,
# p50 and p99 latency, the server's mean batch size.
#
# The server runs on QUERN_BENCH_SERVER_CPUS (default CPU 0) and the load
# generator on QUERN_BENCH_CLIENT_CPUS (default: the other CPUs).
#   bench/latency_target_bench.sh [seconds per step, default 5] [target ms, default 10] [model, default small_cnn]
#   QUERN_BENCH_PRESET=ci ...   # another optimised build (default: release)
#   QUERN_BENCH_RATES="3000 8000" ...   # open loop instead: requests sent at these rates
#                               # whatever the answers (1 s of warm-up each), where what a batching
#                               # delay buys is server CPU per request
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
SECS="${1:-5}"
TARGET_MS="${2:-10}"
MODEL="${3:-small_cnn}"
# shellcheck source=bench/serve_lib.sh
source bench/serve_lib.sh

# name | max_batch_size | max_queue_delay_microseconds | latency target ms (0 = none)
CONFIGS="b16_greedy 16 0 0
b16_delay2ms 16 2000 0
b64_greedy 64 0 0
b64_delay2ms 64 2000 0
b64_delay2ms_target 64 2000 $TARGET_MS
b64_greedy_target 64 0 $TARGET_MS"
while read -r name batch delay target; do
  mkdir -p "$WORK/repo/$name/1"
  cp "bench/models/$MODEL/1/model.onnx" "$WORK/repo/$name/1/"
  {
    echo "max_batch_size: $batch"
    echo "dynamic_batching { max_queue_delay_microseconds: $delay }"
    echo 'parameters { key: "quern.batch_size_tuning" value { string_value: "off" } }'
    if [ "$target" != 0 ]; then
      echo "parameters { key: \"quern.latency_target_ms\" value { string_value: \"$target\" } }"
    fi
  } > "$WORK/repo/$name/config.pbtxt"
done <<< "$CONFIGS"

start_server "$WORK/repo"

LOAD=(-c 1 16 64)
WARMUP=0
COLUMN=clients
if [ -n "${QUERN_BENCH_RATES:-}" ]; then
  read -r -a rates <<< "$QUERN_BENCH_RATES"
  LOAD=(-r "${rates[@]}" --max-inflight 256)
  WARMUP=1
  COLUMN="  rate"
fi
echo "$MODEL; server on CPUs $SERVER_CPUS, quern perf on CPUs $CLIENT_CPUS ($PRESET build); target $TARGET_MS ms; $SECS s per step"
echo "configuration          $COLUMN   req/s   p50 ms   p99 ms  batch  server CPU us/req"
while read -r name _ _ _; do
  # Each configuration's first batch is measured before the steps (the target needs a time per item).
  taskset -c "$CLIENT_CPUS" "$QUERN" perf --url "http://127.0.0.1:$PORT" -m "$name" -c 1 -s 0.5 --warmup 0 \
    --format json > /dev/null
  taskset -c "$CLIENT_CPUS" "$QUERN" perf --url "http://127.0.0.1:$PORT" -m "$name" "${LOAD[@]}" -s "$SECS" \
    --warmup "$WARMUP" --metrics-url "http://127.0.0.1:$METRICS_PORT/metrics" --format json > "$WORK/out.json"
  build/venv/bin/python - "$WORK/out.json" "$name" <<'PY'
import json, sys
name = sys.argv[2]
for lv in json.load(open(sys.argv[1]))["levels"]:
    f = lambda v, d=2: "-" if v is None else f"{v:.{d}f}"
    print(f"{name:<22} {lv['value']:>7.0f} {lv['requests_per_s']:>7.0f} {f(lv['latency_ms']['p50']):>8} "
          f"{f(lv['latency_ms']['p99']):>8} {f(lv['server_batch_size']):>6} {f(lv['server_cpu_us_per_request'], 1):>18}")
PY
done <<< "$CONFIGS"
