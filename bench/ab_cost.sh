#!/usr/bin/env bash
# Server CPU per request of two `quern serve` binaries served in turn (A, B,
# A, B, ...), each loaded by the same `quern perf` closed loop: this host's
# figures drift between minutes by more than most changes, so a change is
# measured against the build before it side by side, not against a table.
# Prints one line per run: req/s, p50/p99 and the server's user + system CPU
# per request (from /proc, the measured window only, after 1 s of warm-up).
#   bench/ab_cost.sh BASE_BINARY NEW_BINARY MODEL http|grpc|stream [connections, 16] [rounds, 3] [perf args...]
#   QUERN_AB_BASE_CHRT=1 ...   # the base is NEW_BINARY with its SCHED_BATCH threads put back to
#                              # SCHED_OTHER (chrt -o): what gRPC's threads ran under before
# Models: those of bench/models (identity takes --shape x=1,4). Server on
# QUERN_BENCH_SERVER_CPUS (CPU 0), `quern perf` on the others.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
BASE="$(realpath "$1")" NEW="$(realpath "$2")" MODEL="$3" PROTO="$4"
CONNS="${5:-16}" ROUNDS="${6:-3}"
shift 4
shift $(($# < 2 ? $# : 2))
# shellcheck source=bench/serve_lib.sh
source bench/serve_lib.sh
mkdir -p "$WORK/repo"
cp -r "bench/models/$MODEL" "$WORK/repo/"
TICK=$(getconf CLK_TCK)
proto_url "$PROTO"
for round in $(seq "$ROUNDS"); do
  for side in base new; do
    QUERN="$NEW"
    [ "$side" = base ] && [ "${QUERN_AB_BASE_CHRT:-0}" != 1 ] && QUERN="$BASE"
    start_server "$WORK/repo"
    if [ "$side" = base ] && [ "${QUERN_AB_BASE_CHRT:-0}" = 1 ]; then
      for t in /proc/"$SERVER"/task/*; do
        [ "$(sed 's/.*) //' "$t/stat" | awk '{print $39}')" = 3 ] && chrt -o -p 0 "$(basename "$t")"
      done
    fi
    # shellcheck disable=SC2086
    taskset -c "$CLIENT_CPUS" "$NEW" perf --url "$url" $extra -m "$MODEL" "$@" -c "$CONNS" -s 1 --warmup 0 >/dev/null
    before=$(sed 's/.*) //' "/proc/$SERVER/stat" | awk '{print $12 + $13}')
    # shellcheck disable=SC2086
    line=$(taskset -c "$CLIENT_CPUS" "$NEW" perf --url "$url" $extra -m "$MODEL" "$@" -c "$CONNS" -s 4 --warmup 0 \
      --format csv | tail -1)
    after=$(sed 's/.*) //' "/proc/$SERVER/stat" | awk '{print $12 + $13}')
    echo "$line" | awk -F, -v s="$side" -v r="$round" -v d="$((after - before))" -v t="$TICK" \
      '{printf "round %s %-4s %9.0f req/s  p50 %.3f ms  p99 %.3f ms  server %.1f us/req\n", r, s, $3, $4, $7, d / t / $8 * 1e6}'
    stop_server
  done
done
