#!/usr/bin/env bash
# What an idle server costs: starts `quern serve` on the example repository,
# waits for it to load, then reads every thread's CPU time and context
# switches (its own and its Python processes') from /proc over a quiet
# window. Prints the threads that ran or woke, and the total as a share of
# one core.
#   bench/idle.sh [seconds, default 60]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SECONDS_IDLE="${1:-60}"
BIN="${QUERN_BIN:-$ROOT/build/release/src/cli/quern}"
LOG="$(mktemp)"
"$BIN" serve --model-repository "$ROOT/examples/models" --http-port 0 --grpc-port 0 --metrics-port 0 >"$LOG" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; rm -f "$LOG"' EXIT
for _ in $(seq 600); do grep -q "quern: serving" "$LOG" && break; sleep 0.1; done
sleep 5  # the load's stragglers
snapshot() {
  for p in $server $(pgrep -P $server); do
    for t in /proc/$p/task/*; do
      printf '%s/%s %s %s %s\n' "$p" "${t##*/}" "$(tr ' ' _ < "$t/comm")" "$(awk '{print $14 + $15}' "$t/stat")" \
        "$(awk '/ctxt_switches/ {s += $2} END {print s}' "$t/status")"
    done
  done | sort
}
snapshot >"$LOG.1"
sleep "$SECONDS_IDLE"
snapshot >"$LOG.2"
hz=$(getconf CLK_TCK)
join "$LOG.1" "$LOG.2" | awk -v hz="$hz" -v secs="$SECONDS_IDLE" '
  { ticks = $6 - $3; wakes = $7 - $4; total += ticks; all_wakes += wakes
    if (ticks > 0 || wakes > 0) printf "  %-22s %-16s cpu %5.2f s  wake-ups %6d\n", $1, $2, ticks / hz, wakes }
  END { printf "idle for %d s: %.3f s of CPU = %.3f%% of one core; %d wake-ups (%.1f/s)\n",
               secs, total / hz, total / hz / secs * 100, all_wakes, all_wakes / secs }'
rm -f "$LOG.1" "$LOG.2"
