#!/usr/bin/env bash
# User-space instructions per request: `quern serve` runs under valgrind's callgrind, loaded by
# `quern perf` (one connection: each request its own batch), counters zeroed after a warm-up and
# dumped after the measured run, divided by the requests served. Like alloc_count.sh, a count that
# does not depend on the machine's load (CPU time here moves by more than most changes between
# hours): the measure to compare builds of the server's own code with. Prints the total and the
# largest parts of a request's path (inclusive counts: a part includes what it calls).
#   bench/instr_count.sh [model, default identity] [protocol http|grpc|stream, default http] [seconds, default 8]
#   QUERN_BENCH_PRESET=ci ...   # another optimised build (default: release)
#   QUERN_INSTR_BIN=path ...    # count that binary instead (e.g. a copy of the build before a change)
#   QUERN_INSTR_KEEP=file ...   # keep the callgrind profile there (callgrind_annotate --tree=caller: who allocates)
# Needs valgrind (scripts/setup.sh installs it). ONNX Runtime runs its non-AVX-512 kernels under
# valgrind, so its own count is not the one of a native run; the server's code is the same.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
MODEL="${1:-identity}" PROTO="${2:-http}" SECS="${3:-8}"
command -v valgrind >/dev/null || { echo "instr_count: valgrind is not installed" >&2; exit 1; }
# shellcheck source=bench/serve_lib.sh
source bench/serve_lib.sh
QUERN="${QUERN_INSTR_BIN:-$QUERN}"  # another build's binary, to compare with
mkdir -p "$WORK/repo"
cp -r "bench/models/$MODEL" "$WORK/repo/"
shape=()
[ "$MODEL" = identity ] && shape=(--shape x=1,4)
valgrind --tool=callgrind --callgrind-out-file="$WORK/callgrind.out" "$QUERN" serve --model-repository "$WORK/repo" \
  --http-port "$PORT" --grpc-port "$GRPC_PORT" --metrics-port "$METRICS_PORT" --host 127.0.0.1 > "$WORK/log" 2>&1 &
SERVER=$!
for _ in $(seq 300); do grep -q "metrics listening" "$WORK/log" && break; sleep 0.5; done
grep -q "metrics listening" "$WORK/log" || { echo "quern did not start under valgrind:"; cat "$WORK/log"; exit 1; }
proto_url "$PROTO"
# shellcheck disable=SC2086
"$QUERN" perf --url "$url" $extra -m "$MODEL" "${shape[@]}" -c 1 -s 3 --warmup 0 >/dev/null
callgrind_control -z "$SERVER" >/dev/null 2>&1
# shellcheck disable=SC2086
ok=$("$QUERN" perf --url "$url" $extra -m "$MODEL" "${shape[@]}" -c 1 -s "$SECS" --warmup 0 --format csv |
  tail -1 | cut -d, -f8)
callgrind_control -d "$SERVER" >/dev/null 2>&1
sleep 1
stop_server
dump=$(ls -t "$WORK"/callgrind.out.* | head -1)
[ -n "${QUERN_INSTR_KEEP:-}" ] && cp "$dump" "$QUERN_INSTR_KEEP"
callgrind_annotate --inclusive=yes --threshold=100 "$dump" > "$WORK/annotated" 2>/dev/null
total=$(awk '/PROGRAM TOTALS/ {gsub(",", "", $1); print $1}' "$WORK/annotated")
echo "$MODEL over $PROTO, one connection: $ok requests, $((total / ok)) instructions per request (user space, all threads)"
echo "| part | instructions per request |"
echo "|---|---:|"
for part in "ServedModel::ExecuteBatch" "OrtModel::Execute" "ServedModel::Finish" "ParseKServeInfer(" \
  "quern::ParseJson(" "ParseJsonTensor" "WriteKServeResult" "basic_parser<true>::put" "Session::OnHeader" \
  "Session::Dispatch()" "Session::Respond" "malloc.c:free " "operator new(unsigned long)"; do
  n=$({ grep -m1 -F "$part" "$WORK/annotated" || true; } | awk '{gsub(",", "", $1); print $1}')
  if [ -n "$n" ]; then echo "| \`${part%(}\` | $((n / ok)) |"; fi
done
