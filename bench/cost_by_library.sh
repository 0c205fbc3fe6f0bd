#!/usr/bin/env bash
# Server CPU per request by library, `quern serve` against the model floor: each is loaded by the
# same `quern perf` run (HTTP, binary tensors) while `perf record` samples it, and each sample is
# counted in the library (or the kernel) it landed in, as µs per request (samples x the sampling
# period / requests served while recorded). The model floor (bench/protocol_floor --http-model)
# receives, gathers and runs the same model on batches of Quern's mean batch size (read from
# Quern's metrics in the same run) and answers canned bytes. ONNX Runtime's own time depends on the
# sizes of the batches it runs, which the two do not share exactly; the CPU outside ONNX Runtime
# does not, so Quern's own cost is its CPU outside ONNX Runtime minus the floor's.
#   bench/cost_by_library.sh [model, default small_cnn] [connections, default 16] [rounds, default 3]
#   QUERN_BENCH_PRESET=ci ...   # another optimised build (default: release)
#   QUERN_COST_BIN=path ...     # record that `quern` binary instead (e.g. a copy of the build before a change)
# Needs root and linux-perf (perf record -p). The model needs an ONNX file in bench/models/MODEL/1.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
MODEL="${1:-small_cnn}" C="${2:-16}" ROUNDS="${3:-3}"
case "$MODEL" in
  small_cnn) specs=(--input input:FP32:-1,3,64,64 --output logits:FP32:-1,10) shape=() ;;
  identity) specs=(--input x:FP32:-1,4 --output y:FP32:-1,4) shape=(--shape x=1,4) ;;
  *) echo "cost_by_library: no tensor specs for model '$MODEL' (small_cnn, identity)" >&2; exit 2 ;;
esac
ONNX="bench/models/$MODEL/1/model.onnx"
[ -f "$ONNX" ] || { echo "cost_by_library: $ONNX is missing" >&2; exit 1; }
command -v perf >/dev/null || { echo "cost_by_library: perf is not installed" >&2; exit 1; }
# shellcheck source=bench/serve_lib.sh
source bench/serve_lib.sh
QUERN="${QUERN_COST_BIN:-$QUERN}"
cmake --build --preset "$PRESET" --target protocol_floor >/dev/null
FLOOR="build/$PRESET/bench/protocol_floor"
mkdir -p "$WORK/repo"
cp -r "bench/models/$MODEL" "$WORK/repo/"
read -r FLOOR_PORT <<< "$(free_ports 1)"
HZ=4999
RECORD_S=4
FLOOR_PID=""
trap 'kill $SERVER $FLOOR_PID 2>/dev/null || true; rm -rf "$WORK"' EXIT

# measure NAME PID HTTP_PORT [perf flags]: loads the server, records it, appends
# "NAME ROUND LIBRARY US_PER_REQUEST" lines to $WORK/libs, echoes requests/s and mean batch.
measure() {
  local name="$1" pid="$2" port="$3"
  shift 3
  taskset -c "$CLIENT_CPUS" "$QUERN" perf --url "http://127.0.0.1:$port" -m "$MODEL" "${shape[@]}" -c "$C" \
    -s $((RECORD_S + 3)) --warmup 0 --format csv "$@" > "$WORK/perf.csv" &
  local load=$!
  sleep 1.5
  perf record -q -F "$HZ" -p "$pid" -o "$WORK/perf.data" -- sleep "$RECORD_S" >/dev/null 2>&1
  wait "$load"
  local line rps batch
  line=$(tail -1 "$WORK/perf.csv")
  rps=$(cut -d, -f3 <<< "$line")
  batch=$(cut -d, -f14 <<< "$line")
  perf report -i "$WORK/perf.data" -n --no-children --sort dso --stdio 2>/dev/null | grep -v '^#' | grep '%' |
    awk -v r="$rps" -v hz="$HZ" -v s="$RECORD_S" -v name="$name" -v round="$ROUND" \
      '{printf "%s %s %s %.3f\n", name, round, $3, $2 * 1e6 / hz / (r * s)}' >> "$WORK/libs"
  echo "$rps $batch"
}

for ROUND in $(seq "$ROUNDS"); do
  start_server "$WORK/repo"
  read -r q_rps q_batch <<< "$(measure quern "$SERVER" "$PORT" --metrics-url "http://127.0.0.1:$METRICS_PORT/metrics")"
  stop_server
  n=$(awk -v b="$q_batch" 'BEGIN {n = int(b + 0.5); print (n < 2 ? 2 : n)}')
  taskset -c "$SERVER_CPUS" "$FLOOR" --http-port "$FLOOR_PORT" --grpc-port 0 --model "$MODEL" "${specs[@]}" \
    --http-batch "$n" --http-model "$ONNX" &
  FLOOR_PID=$!
  sleep 1
  read -r f_rps _ <<< "$(measure floor "$FLOOR_PID" "$FLOOR_PORT")"
  kill "$FLOOR_PID"
  wait "$FLOOR_PID" 2>/dev/null || true
  FLOOR_PID=""
  echo "round $ROUND: quern $q_rps requests/s, mean batch $q_batch; model floor (batch $n) $f_rps requests/s"
done

build/venv/bin/python - "$WORK/libs" "$ROUNDS" "$MODEL" "$C" <<'PY'
import statistics, sys
from collections import defaultdict
rows = [l.split() for l in open(sys.argv[1])]
rounds, model, conns = int(sys.argv[2]), sys.argv[3], sys.argv[4]
us = defaultdict(float)  # (server, round, library) -> µs per request
for name, rnd, lib, v in rows:
    us[(name, int(rnd), lib)] += float(v)
libs = sorted({k[2] for k in us}, key=lambda l: -sum(v for k, v in us.items() if k[2] == l))
def med(name, lib):
    return statistics.median(us.get((name, r, lib), 0.0) for r in range(1, rounds + 1))
ort = [l for l in libs if "onnxruntime" in l]
print(f"{model} over HTTP, {conns} connections: µs of server CPU per request by library, medians of {rounds} rounds")
print("| library | quern serve | model floor |")
print("|---|---:|---:|")
for l in libs:
    q, f = med("quern", l), med("floor", l)
    if q >= 0.05 or f >= 0.05:
        print(f"| {l} | {q:.2f} | {f:.2f} |")
own = []
for r in range(1, rounds + 1):
    outside = {n: sum(v for k, v in us.items() if k[0] == n and k[1] == r and k[2] not in ort) for n in ("quern", "floor")}
    own.append(outside["quern"] - outside["floor"])
print()
print(f"Quern's own cost (its CPU outside ONNX Runtime minus the floor's): median {statistics.median(own):.1f} µs "
      f"per request, rounds {', '.join(f'{x:.1f}' for x in own)}")
# Each server's CPU outside ONNX Runtime, round by round, and the difference of their medians: the
# two are recorded one after the other, not at once, so a round's pair shares no noise, and the
# floor's own kernel time moves by several µs between rounds.
outside = {n: [sum(v for k, v in us.items() if k[0] == n and k[1] == r and k[2] not in ort) for r in range(1, rounds + 1)]
           for n in ("quern", "floor")}
print(f"Outside ONNX Runtime, µs per request: quern {', '.join(f'{x:.1f}' for x in outside['quern'])} "
      f"(median {statistics.median(outside['quern']):.1f}); floor {', '.join(f'{x:.1f}' for x in outside['floor'])} "
      f"(median {statistics.median(outside['floor']):.1f}); difference of the medians "
      f"{statistics.median(outside['quern']) - statistics.median(outside['floor']):.1f}")
for r in range(1, rounds + 1):
    parts = ", ".join(f"{l} {us.get(('quern', r, l), 0.0):.2f}/{us.get(('floor', r, l), 0.0):.2f}"
                      for l in libs if l not in ort and max(us.get(('quern', r, l), 0), us.get(('floor', r, l), 0)) >= 0.1)
    print(f"  round {r}, quern/floor outside ONNX Runtime: {parts}")
PY
