#!/usr/bin/env bash
# Deadline-aware admission under overload: a real `quern serve` is loaded with
# `quern perf` in an open loop at 1x and 2x the capacity measured just before
# (closed loop, same tool), every request carrying a deadline: over gRPC the
# call's own deadline, over HTTP the KServe `timeout` parameter (the most it
# may wait in the queue). For each run: offered rate, goodput (answers OK per
# second) against capacity, answers that came after their deadline, refusals
# (503 / UNAVAILABLE) and failures at the deadline
# (DEADLINE_EXCEEDED: admitted, then dropped or cut off).
#
# The server runs on QUERN_BENCH_SERVER_CPUS (default CPU 0) and the load
# generator on QUERN_BENCH_CLIENT_CPUS (default: the other CPUs).
#   bench/deadline_bench.sh [seconds per run, default 10] [targets...]
#   targets: small_cnn_grpc small_cnn_http resnet50_grpc (default: all)
#   QUERN_BENCH_PRESET=ci ...   # another optimised build (default: release)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
SECS="${1:-10}"
shift || true
TARGETS="${*:-small_cnn_grpc small_cnn_http resnet50_grpc}"
# shellcheck source=bench/serve_lib.sh
source bench/serve_lib.sh
mkdir -p "$WORK/repo"
for m in small_cnn resnet50; do ln -s "$ROOT/bench/models/$m" "$WORK/repo/$m"; done

echo "server on CPUs $SERVER_CPUS, quern perf on CPUs $CLIENT_CPUS ($PRESET build), $SECS s per run"
echo "target          load  deadline ms  offered/s  goodput/s  x cap  ok p50 ms  ok p99 ms  after deadline  refused  deadline exceeded  other"
for target in $TARGETS; do
  model="${target%_*}"
  proto="${target##*_}"
  case "$model" in
    small_cnn) deadline=20; workers=16 ;;
    resnet50) deadline=300; workers=4 ;;
    *) echo "unknown target $target"; exit 2 ;;
  esac
  url="http://127.0.0.1:$PORT"
  [ "$proto" = grpc ] && url="grpc://127.0.0.1:$GRPC_PORT"
  start_server "$WORK/repo" --allow-links-outside-repository
  perf() {
    taskset -c "$CLIENT_CPUS" "$QUERN" perf --url "$url" -m "$model" -s "$SECS" --warmup 2 --format json "$@"
  }
  cap=$(perf -c "$workers" | build/venv/bin/python -c 'import json, sys; print(json.load(sys.stdin)["levels"][0]["requests_per_s"])')
  printf "%-15s %-5s %11s  %9s  %9.1f  %5s\n" "$target" closed - - "$cap" 1.00
  for mult in 1 2; do
    rate=$(awk -v c="$cap" -v m="$mult" 'BEGIN {printf "%d", c * m}')
    perf -r "$rate" --max-inflight "${QUERN_BENCH_INFLIGHT:-64}" --deadline-ms "$deadline" > "$WORK/run.json" || true
    build/venv/bin/python - "$WORK/run.json" "$target" "${mult}x" "$deadline" "$cap" <<'PY'
import json, sys
doc = json.load(open(sys.argv[1]))
target, load, deadline, cap = sys.argv[2], sys.argv[3], sys.argv[4], float(sys.argv[5])
(lv,) = doc["levels"]
kinds = {k: v["count"] for k, v in lv["error_kinds"].items()}
refused = kinds.pop("gRPC UNAVAILABLE", 0) + kinds.pop("HTTP 503", 0)
exceeded = kinds.pop("gRPC DEADLINE_EXCEEDED", 0) + kinds.pop("HTTP 504", 0)
other = sum(kinds.values())
f = lambda v: "-" if v is None else f"{v:.2f}"
print(f"{target:<15} {load:<5} {deadline:>11}  {lv['value']:9.0f}  {lv['requests_per_s']:9.1f}  "
      f"{lv['requests_per_s'] / cap:5.2f}  {f(lv['latency_ms']['p50']):>9}  {f(lv['latency_ms']['p99']):>9}  "
      f"{lv['past_deadline']:>14}  {refused:>7}  {exceeded:>17}  {other:>5}")
PY
    sleep 2  # let the queue empty between runs
  done
  stop_server
done
