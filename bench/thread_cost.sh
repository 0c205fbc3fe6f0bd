#!/usr/bin/env bash
# Where a running server's CPU goes per request, thread by thread: loads `quern serve` (process
# SERVER_PID, its child processes included: a Python model's) with `quern perf` and prints, for
# every thread that used at least 0.5 µs per request, its CPU time and its voluntary and
# involuntary context switches per request, from /proc before and after.
#   bench/thread_cost.sh SERVER_PID URL MODEL [concurrency, default 1] [seconds, default 4] [perf args...]
#   e.g. bench/thread_cost.sh "$(pgrep -f 'quern serve')" grpc://127.0.0.1:8001 py_identity 1 4
#   QUERN=build/ci/src/cli/quern ...     # the quern that runs perf (default: the release build's)
#   QUERN_BENCH_CLIENT_CPUS=1 ...        # where perf runs (default CPU 1)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SERVER="$1" URL="$2" MODEL="$3" C="${4:-1}" SECS="${5:-4}"
shift $(($# < 5 ? $# : 5))
QUERN="${QUERN:-$ROOT/build/release/src/cli/quern}"
# One line per thread: tid name user+system ticks voluntary involuntary
snap() {
  local p t
  for p in "$SERVER" $(pgrep -P "$SERVER" || true); do
    for t in /proc/"$p"/task/*; do
      [ -r "$t/stat" ] || continue
      printf '%s %s %s %s\n' "$(basename "$t")" "$(tr ' ' '_' < "$t/comm")" \
        "$(sed 's/.*) //' "$t/stat" | awk '{print $12 + $13}')" \
        "$(awk '/^voluntary_ctxt_switches/ {v=$2} /^nonvoluntary_ctxt_switches/ {n=$2} END {print v, n}' "$t/status")"
    done
  done
}
before=$(snap)
line=$(taskset -c "${QUERN_BENCH_CLIENT_CPUS:-1}" "$QUERN" perf --url "$URL" -m "$MODEL" -c "$C" -s "$SECS" \
  --warmup 0 --format csv "$@" | tail -1)
after=$(snap)
requests=$(echo "$line" | awk -F, -v s="$SECS" '{printf "%d", $3 * s}')
echo "$MODEL at $URL, $C connection(s), $SECS s: $requests requests"
join <(echo "$before" | sort) <(echo "$after" | sort) | awk -v n="$requests" -v hz="$(getconf CLK_TCK)" '
  { cpu = ($7 - $3) / hz / n * 1e6; total += cpu
    if (cpu >= 0.5) printf "%-18s %7.1f µs  voluntary %.2f  involuntary %.2f\n", $2, cpu, ($8 - $4) / n, ($9 - $5) / n }
  END { printf "%-18s %7.1f µs per request\n", "all threads", total }'
