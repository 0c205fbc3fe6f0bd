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
# from Quern's metrics). Over HTTP a second floor answers in batches
# (--http-batch, as many at a time as Quern's batches held at that level in
# the same round): a batching server's clients wait asleep for a batch and
# each answer wakes one, which a floor answering at once does not pay. A
# third, the model floor, does the same and runs each batch through the
# model's ONNX file first (--http-model: the inputs gathered into one batch,
# ONNX Runtime on one thread): Quern's figure minus that one is its own cost
# with nothing subtracted for compute (Quern's compute time is the run's wall
# time, which on one core includes its other threads' turns).
#
# The server runs on QUERN_BENCH_SERVER_CPUS (default CPU 0) and the load
# generator on QUERN_BENCH_CLIENT_CPUS (default: the other CPUs).
# Quern and the floors listen side by side (each idle while another is
# loaded) and are loaded row by row, Quern first, the floors seconds after:
# this host's figures drift between minutes by more than the differences
# looked for. With QUERN_BENCH_ROUNDS=N all of it runs N times: each row is
# the round with the median server CPU, and Quern's own cost, its figure
# minus the floor's of the same round minus the model's compute per request,
# is printed as the median and range over the rounds, with the same for user
# time alone (system time carries the wake-ups, which this host's load moves
# most).
#   bench/request_cost.sh [seconds per level, default 4] [concurrency levels, default "1 16"]
#   QUERN_BENCH_PRESET=ci ...   # another optimised build (default: release)
#   QUERN_BENCH_ROUNDS=3 ...    # rounds (default 1)
#   QUERN_BENCH_MODELS="small_cnn" QUERN_BENCH_PROTOCOLS="http" ...   # a part of the table (default: all)
#   QUERN_BENCH_SERVE_ARGS="--http-threads 2" ...   # flags for quern serve (bench/serve_lib.sh)
#   QUERN_BENCH_SERVER_CPUS=0-1 QUERN_BENCH_CLIENT_CPUS=0-1 ...   # nothing pinned apart
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
# /proc/PID/stat, counted after the command's closing parenthesis); with
# `user`, user time alone (field 14).
cpu_ticks() {
  local t=0 p fields='$12 + $13'
  [ "${2:-}" = user ] && fields='$12'
  for p in "$1" $(pgrep -P "$1"); do
    t=$((t + $(sed 's/.*) //' "/proc/$p/stat" | awk "{print $fields}")))
  done
  echo "$t"
}
TICK=$(getconf CLK_TCK)

# row NAME PID MODEL PROTO CONNECTIONS HTTP_PORT GRPC_PORT SHAPE_ARGS: one line into $WORK/rows
row() {
  local name="$1" pid="$2" model="$3" proto="$4" c="$5" http_port="$6" grpc_port="$7"
  shift 7
  local url extra before after user_before user_after line metrics=()
  proto_url "$proto" "$http_port" "$grpc_port"
  [ "$name" = quern ] && metrics=(--metrics-url "http://127.0.0.1:$METRICS_PORT/metrics")
  before=$(cpu_ticks "$pid")
  user_before=$(cpu_ticks "$pid" user)
  # shellcheck disable=SC2086
  line=$(taskset -c "$CLIENT_CPUS" "$QUERN" perf --url "$url" $extra -m "$model" "$@" -c "$c" -s "$SECS" \
    --warmup "$WARMUP" --format csv "${metrics[@]}" | tail -1)
  after=$(cpu_ticks "$pid")
  user_after=$(cpu_ticks "$pid" user)
  # mode,value,requests_per_s,p50_ms,p90,p95,p99,ok,errors,client_us,server_us,queue_us,compute_us,batch,...
  echo "$line" | awk -F, -v r="$ROUND" -v n="$name" -v m="$model" -v p="$proto" -v d="$((after - before))" \
    -v u="$((user_after - user_before))" -v t="$TICK" -v s="$((SECS + WARMUP))" '{
      cpu = d / t / ($3 * s) * 1e6
      user = u / t / ($3 * s) * 1e6
      printf "%s,%s,%s,%s,%s,%.0f,%.3f,%.3f,%s,%.1f,%.2f,%s,%s,%.2f\n",
             r, m, p, $2, n, $3, $4, $7, $9, $10, cpu, $13, $14, user }' >> "$WORK/rows"
}

# The floors listen beside Quern (each idle while another is loaded), so
# that each of Quern's rows is followed by the floor's seconds later.
read -r FLOOR_PORT FLOOR_GRPC_PORT BATCHED_PORT <<< "$(free_ports 3)"
FLOOR_PID="" BATCHED_PID=""
trap 'kill $SERVER $FLOOR_PID $BATCHED_PID 2>/dev/null || true; rm -rf "$WORK"' EXIT

# batched_row NAME [FLOOR FLAGS...]: a floor answering $batch HTTP requests at a
# time (with the flags given) is started, loaded as row NAME, and stopped.
batched_row() {
  local name="$1"
  shift
  taskset -c "$SERVER_CPUS" "$FLOOR" --http-port "$BATCHED_PORT" --grpc-port 0 --model "$model" \
    --input "$in_spec" --output "$out_spec" --http-batch "$batch" "$@" &
  BATCHED_PID=$!
  sleep 1
  # shellcheck disable=SC2086
  row "$name" "$BATCHED_PID" "$model" http "$c" "$BATCHED_PORT" 0 $shape_args
  kill "$BATCHED_PID"
  wait "$BATCHED_PID" 2>/dev/null || true
  BATCHED_PID=""
}

ROUNDS="${QUERN_BENCH_ROUNDS:-1}"
for ROUND in $(seq "$ROUNDS"); do
for spec in "identity --shape x=1,4|x:FP32:-1,4|y:FP32:-1,4" "py_identity --shape x=1,4|" \
            "small_cnn|input:FP32:-1,3,64,64|logits:FP32:-1,10"; do
  IFS='|' read -r model_args in_spec out_spec <<< "$spec"
  read -r model shape_args <<< "$model_args"
  [[ " ${QUERN_BENCH_MODELS:-$model} " == *" $model "* ]] || continue
  start_server "$WORK/repo"
  FLOOR_PID=""
  if [ -n "$in_spec" ]; then  # py_identity's floor is identity's
    taskset -c "$SERVER_CPUS" "$FLOOR" --http-port "$FLOOR_PORT" --grpc-port "$FLOOR_GRPC_PORT" --model "$model" \
      --input "$in_spec" --output "$out_spec" &
    FLOOR_PID=$!
    sleep 1
  fi
  for proto in ${QUERN_BENCH_PROTOCOLS:-http grpc stream}; do
    for c in $LEVELS; do
      # shellcheck disable=SC2086
      row quern "$SERVER" "$model" "$proto" "$c" "$PORT" "$GRPC_PORT" $shape_args
      [ -n "$FLOOR_PID" ] || continue
      # shellcheck disable=SC2086
      row floor "$FLOOR_PID" "$model" "$proto" "$c" "$FLOOR_PORT" "$FLOOR_GRPC_PORT" $shape_args
      [ "$proto" = http ] || continue
      # The batching floor: HTTP answers held and sent as many at a time as
      # Quern's batches held just before (its clients then wait asleep for a
      # batch, as Quern's do, and each answer wakes one).
      batch=$(tail -2 "$WORK/rows" | awk -F, -v c="$c" \
        '$3 == "http" && $4 == c && $5 == "quern" && $13 != "-" {printf "%d", $13 + 0.5}')
      [ "${batch:-1}" -gt 1 ] || continue
      batched_row floor_batched
      # The model floor: the same, and each batch runs through the model
      # (ONNX Runtime, one thread) before its answers: Quern's figure minus
      # this one is its own cost with no compute time to subtract.
      onnx="bench/models/$model/1/model.onnx"
      [ -f "$onnx" ] || continue
      batched_row floor_model --http-model "$onnx"
    done
  done
  stop_server
  if [ -n "$FLOOR_PID" ]; then
    kill "$FLOOR_PID"
    wait "$FLOOR_PID" 2>/dev/null || true
  fi
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
print("| model | protocol | connections | server | req/s | p50 ms | p99 ms | errors | client CPU µs/req | server CPU µs/req | compute µs/batch | batch | server user CPU µs/req |")
print("|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for k in keys:
    rs = sorted(by[k], key=lambda r: float(r[10]))
    r = rs[(len(rs) - 1) // 2]
    print("| " + " | ".join(r[1:]) + " |")
# Own cost per round: Quern minus the floor of the same model minus the model's compute per
# request (not for py_identity: its time per batch is the round trip to its process, mostly
# waiting, not the server's CPU).
print()
print("Quern's own cost, µs per request (its server CPU - the floor's - compute per batch / batch); over HTTP")
print("also against the batching floor (answers sent as many at a time as Quern's batches held); and the")
print("user time alone (Quern's user CPU - the floor's - compute: the part the host's wake-ups move least):")
print("The model floor runs the same model on batches of the same size (ONNX Runtime, one thread) and")
print("answers them: against it nothing is subtracted for compute (its total and its user time alone).")
print("| model | protocol | connections | median | range | against the batching floor: median | range | user: median | range | against the model floor: median | range | user: median | range |")
print("|---|---|---:|---:|---|---:|---|---:|---|---:|---|---:|---|")
def own_cost(k, floor_name, column=10, subtract_compute=True):
    model, proto, conns, _ = k
    floors = {r[0]: float(r[column]) for r in by.get((model, proto, conns, floor_name), [])}
    own = []
    for r in by[k]:
        if r[0] not in floors:
            continue
        compute = float(r[11]) / float(r[12]) if r[11] not in ("-", "") and float(r[12]) > 0 else 0.0
        own.append(float(r[column]) - floors[r[0]] - (compute if subtract_compute else 0.0))
    return f"{statistics.median(own):.1f} | {min(own):.1f} to {max(own):.1f}" if own else ""
for k in keys:
    if k[3] != "quern":
        continue
    plain = own_cost(k, "floor")
    if plain:
        model_floor = own_cost(k, "floor_model", subtract_compute=False)
        model_user = own_cost(k, "floor_model", 13, subtract_compute=False)
        print(f"| {k[0]} | {k[1]} | {k[2]} | {plain} | {own_cost(k, 'floor_batched') or '|'} | {own_cost(k, 'floor', 13)} "
              f"| {model_floor or '|'} | {model_user or '|'} |")
PY
