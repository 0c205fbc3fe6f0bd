#!/usr/bin/env bash
# Server CPU per request, Quern against the floor: `quern serve` and
# bench/protocol_floor (the least a KServe v2 server can do: canned answers,
# no parsing, no model) are each loaded by `quern perf` in turn, over HTTP
# (binary tensors), gRPC unary and gRPC streams, for the identity model
# ([1,4] floats), the same as a Python model (py_identity: model.py returns
# its input, run in its own process) and the small CNN (48 KiB in), at 1 and
# 16 connections.
# Server CPU is the process's user + system time from /proc over the whole
# run (warm-up included), its child processes' (the Python model's) added, divided by the requests it served then, the same
# way for both servers. Quern's own cost per request is its figure minus the
# floor's; the model's compute is part of it (its time per batch is printed
# from Quern's metrics).
#
# The server runs on QUERN_BENCH_SERVER_CPUS (default CPU 0) and the load
# generator on QUERN_BENCH_CLIENT_CPUS (default: the other CPUs).
# With QUERN_BENCH_ROUNDS=N the two servers are loaded in turn N times (this
# host's figures drift between minutes by more than the differences looked
# for): each row is the round with the median server CPU, and Quern's own
# cost, its figure minus the floor's of the same round minus the model's
# compute per request, is printed as the median and range over the rounds.
#   bench/request_cost.sh [seconds per level, default 4] [concurrency levels, default "1 16"]
#   QUERN_BENCH_PRESET=ci ...   # another optimised build (default: release)
#   QUERN_BENCH_ROUNDS=3 ...    # rounds (default 1)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
SECS="${1:-4}"
LEVELS="${2:-1 16}"
WARMUP=1
# shellcheck source=bench/serve_lib.sh
source bench/serve_lib.sh
cmake --build --preset "$PRESET" --target protocol_floor >/dev/null
FLOOR="build/$PRESET/bench/protocol_floor"

mkdir -p "$WORK/repo"
cp -r bench/models/identity bench/models/small_cnn "$WORK/repo/"
mkdir -p "$WORK/repo/py_identity/1"
cat > "$WORK/repo/py_identity/config.pbtxt" <<'EOF'
backend: "python"
max_batch_size: 64
input [ { name: "x" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 4 ] } ]
dynamic_batching { }
instance_group [ { count: 1 } ]
EOF
printf 'def infer(inputs):\n    return {"y": inputs["x"]}\n' > "$WORK/repo/py_identity/1/model.py"

# A process's user + system ticks and its children's (fields 14 and 15 of
# /proc/PID/stat, counted after the command's closing parenthesis).
cpu_ticks() {
  local t=0 p
  for p in "$1" $(pgrep -P "$1"); do
    t=$((t + $(sed 's/.*) //' "/proc/$p/stat" | awk '{print $12 + $13}')))
  done
  echo "$t"
}
TICK=$(getconf CLK_TCK)

# measure NAME PID MODEL SHAPE_ARGS: one line per protocol and level
measure() {
  local name="$1" pid="$2" model="$3"
  shift 3
  local proto url extra c before after line
  for proto in http grpc stream; do
    proto_url "$proto"
    for c in $LEVELS; do
      local metrics=()
      [ "$name" = quern ] && metrics=(--metrics-url "http://127.0.0.1:$METRICS_PORT/metrics")
      before=$(cpu_ticks "$pid")
      # shellcheck disable=SC2086
      line=$(taskset -c "$CLIENT_CPUS" "$QUERN" perf --url "$url" $extra -m "$model" "$@" -c "$c" -s "$SECS" \
        --warmup "$WARMUP" --format csv "${metrics[@]}" | tail -1)
      after=$(cpu_ticks "$pid")
      # mode,value,requests_per_s,p50_ms,p90,p95,p99,ok,errors,client_us,server_us,queue_us,compute_us,batch,...
      echo "$line" | awk -F, -v r="$ROUND" -v n="$name" -v m="$model" -v p="$proto" -v d="$((after - before))" \
        -v t="$TICK" -v s="$((SECS + WARMUP))" '{
          cpu = d / t / ($3 * s) * 1e6
          printf "%s,%s,%s,%s,%s,%.0f,%.3f,%.3f,%s,%.1f,%.2f,%s,%s\n",
                 r, m, p, $2, n, $3, $4, $7, $9, $10, cpu, $13, $14 }' >> "$WORK/rows"
    done
  done
}

ROUNDS="${QUERN_BENCH_ROUNDS:-1}"
for ROUND in $(seq "$ROUNDS"); do
for spec in "identity --shape x=1,4|x:FP32:-1,4|y:FP32:-1,4" "py_identity --shape x=1,4|" \
            "small_cnn|input:FP32:-1,3,64,64|logits:FP32:-1,10"; do
  IFS='|' read -r model_args in_spec out_spec <<< "$spec"
  read -r model shape_args <<< "$model_args"
  start_server "$WORK/repo"
  # shellcheck disable=SC2086
  measure quern "$SERVER" "$model" $shape_args
  stop_server
  [ -n "$in_spec" ] || continue  # the floor of the same shapes is identity's
  taskset -c "$SERVER_CPUS" "$FLOOR" --http-port "$PORT" --grpc-port "$GRPC_PORT" --model "$model" \
    --input "$in_spec" --output "$out_spec" &
  FLOOR_PID=$!
  SERVER=$FLOOR_PID  # stopped on exit
  sleep 1
  # shellcheck disable=SC2086
  measure floor "$FLOOR_PID" "$model" $shape_args
  kill "$FLOOR_PID"
  wait "$FLOOR_PID" 2>/dev/null || true
done
done

build/venv/bin/python - "$WORK/rows" "$ROUNDS" <<'PY'
import csv, statistics, sys
rows = list(csv.reader(open(sys.argv[1])))
rounds = int(sys.argv[2])
keys, by = [], {}
for r in rows:
    k = tuple(r[1:5])  # model, protocol, connections, server
    if k not in by:
        keys.append(k)
    by.setdefault(k, []).append(r)
print(f"Medians of {rounds} round(s): each row is the round with the median server CPU.")
print("| model | protocol | connections | server | req/s | p50 ms | p99 ms | errors | client CPU µs/req | server CPU µs/req | compute µs/batch | batch |")
print("|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
for k in keys:
    rs = sorted(by[k], key=lambda r: float(r[10]))
    r = rs[(len(rs) - 1) // 2]
    print("| " + " | ".join(r[1:]) + " |")
# Own cost per round: Quern minus the floor of the same model minus the model's compute per
# request (not for py_identity: its time per batch is the round trip to its process, mostly
# waiting, not the server's CPU).
print()
print("Quern's own cost, µs per request (its server CPU - the floor's - compute per batch / batch):")
print("| model | protocol | connections | median | range |")
print("|---|---|---:|---:|---|")
for k in keys:
    model, proto, conns, server = k
    if server != "quern":
        continue
    floors = {r[0]: float(r[10]) for r in by.get((model, proto, conns, "floor"), [])}
    own = []
    for r in by[k]:
        if r[0] not in floors:
            continue
        compute = float(r[11]) / float(r[12]) if r[11] not in ("-", "") and float(r[12]) > 0 else 0.0
        own.append(float(r[10]) - floors[r[0]] - compute)
    if own:
        print(f"| {model} | {proto} | {conns} | {statistics.median(own):.1f} | {min(own):.1f} to {max(own):.1f} |")
PY
