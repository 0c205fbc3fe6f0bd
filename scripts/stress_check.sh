#!/usr/bin/env bash
# Runs the README's test command (scripts/test.sh) with stress-ng keeping half of every core busy at
# normal priority beside it, as a laptop with other work or a shared CI runner would: the suite must
# pass anyway (no test may depend on how much CPU the machine lends it). Prints one line per run
# (passed or failed, seconds) and a summary; the runs' logs stay in build/stress/.
#   scripts/stress_check.sh [runs, default 5]
#   QUERN_STRESS_LOAD=50 ...   # the share of each core stress-ng keeps busy, %
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
RUNS="${1:-5}"
LOAD="${QUERN_STRESS_LOAD:-50}"
if ! command -v stress-ng >/dev/null; then
  sudo=""
  [ "$(id -u)" = 0 ] || sudo=sudo
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends stress-ng >/dev/null
fi
mkdir -p build/stress
passed=0
for run in $(seq "$RUNS"); do
  stress-ng --cpu "$(nproc)" --cpu-load "$LOAD" --quiet &
  stress=$!
  start=$SECONDS
  if scripts/test.sh >"build/stress/run-$run.log" 2>&1; then
    result=passed
    passed=$((passed + 1))
  else
    result=FAILED
  fi
  kill "$stress" 2>/dev/null || true
  wait "$stress" 2>/dev/null || true
  echo "run $run of $RUNS: $result in $((SECONDS - start)) s, stress-ng at $LOAD % of each of $(nproc) cores" \
       "(build/stress/run-$run.log)"
  [ "$result" = passed ] || grep -E '^(==|FAILED|E  )|\*\*\*Failed|\(Failed\)' "build/stress/run-$run.log" | tail -20
done
echo "$passed of $RUNS runs passed"
[ "$passed" = "$RUNS" ]
