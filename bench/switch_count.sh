#!/usr/bin/env bash
# Context switches, futex calls, epoll calls, requests/s and server CPU per request: `quern serve`
# loaded by `quern perf` over HTTP while `perf stat -p` counts the server's events (needs root and
# linux-perf), divided by the requests served. Shows where a request's batch runs: handed to an
# instance's thread and back (a futex wake-up and two context switches per batch on one core) or
# run by the thread that read it. Server on QUERN_BENCH_SERVER_CPUS (default CPU 0), load on the
# other CPUs.
#   bench/switch_count.sh [connections, default 16] [models, default "small_cnn identity"]
#   QUERN_BENCH_PRESET=ci ...   # another optimised build (default: release)
#   QUERN_COST_BIN=path ...     # count that `quern` binary instead (e.g. a build before a change)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
C="${1:-16}"
MODELS="${2:-small_cnn identity}"
command -v perf >/dev/null || { echo "switch_count: perf is not installed" >&2; exit 1; }
# shellcheck source=bench/serve_lib.sh
source bench/serve_lib.sh
CLIENT="$QUERN"
QUERN="${QUERN_COST_BIN:-$QUERN}"
EVENTS="context-switches,syscalls:sys_enter_futex,syscalls:sys_enter_epoll_wait,syscalls:sys_enter_epoll_ctl,task-clock"
mkdir -p "$WORK/repo"
cp -r bench/models/identity bench/models/small_cnn "$WORK/repo/"
start_server "$WORK/repo"
echo "| model | connections | requests/s | context switches | futex | epoll_wait | epoll_ctl | server CPU µs/request |"
echo "|---|---:|---:|---:|---:|---:|---:|---:|"
for model in $MODELS; do
  shape=()
  [ "$model" = identity ] && shape=(--shape x=1,4)
  taskset -c "$CLIENT_CPUS" "$CLIENT" perf --url "http://127.0.0.1:$PORT" -m "$model" "${shape[@]}" -c "$C" -s 2 \
    --warmup 0 >/dev/null
  perf stat -e "$EVENTS" -x, -o "$WORK/stat" -p "$SERVER" -- sleep 4.5 &
  stat=$!
  sleep 0.2
  line=$(taskset -c "$CLIENT_CPUS" "$CLIENT" perf --url "http://127.0.0.1:$PORT" -m "$model" "${shape[@]}" -c "$C" \
    -s 4 --warmup 0 --format csv | tail -1)
  wait "$stat"
  ok=$(cut -d, -f8 <<< "$line")
  rps=$(cut -d, -f3 <<< "$line")
  get() { awk -F, -v e="$1" '$3 == e {print $1}' "$WORK/stat"; }
  awk -v m="$model" -v c="$C" -v ok="$ok" -v rps="$rps" -v cs="$(get context-switches)" \
    -v fu="$(get syscalls:sys_enter_futex)" -v ew="$(get syscalls:sys_enter_epoll_wait)" \
    -v ec="$(get syscalls:sys_enter_epoll_ctl)" -v ms="$(get task-clock)" \
    'BEGIN { printf "| %s | %s | %.0f | %.2f | %.2f | %.2f | %.2f | %.1f |\n", m, c, rps, cs / ok, fu / ok, ew / ok,
             ec / ok, ms * 1000 / ok }'
done
stop_server
