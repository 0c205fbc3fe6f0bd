#!/usr/bin/env bash
# Fails when a function in src/ is longer than 150 lines (lizard, from the
# project's venv), but for the ones listed in LONG, left to split: a new
# long function, or one of LONG that is now short enough (take it out of the
# list), fails the check.
#   scripts/check_functions.sh
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
LIZARD="$ROOT/build/venv/bin/lizard"
[ -x "$LIZARD" ] || { echo "check_functions: needs lizard in build/venv (scripts/setup.sh)" >&2; exit 1; }
MAX=150
LONG=()
found=$("$LIZARD" -L "$MAX" -C 100000 -a 100000 -w src --exclude "*/dashboard/*" 2>/dev/null |
        sed -nE 's|^([^:]+):[0-9]+: warning: ([^ ]+) has .* ([0-9]+) length.*|\1 \2 \3|p' || true)
bad=0
declare -A seen=()
while read -r file name length; do
  [ -n "$file" ] || continue
  key="$file $name"
  listed=0
  for l in "${LONG[@]}"; do [ "$l" = "$key" ] && listed=1; done
  if [ $listed = 1 ]; then
    seen[$key]=1
  else
    echo "check_functions: $file: $name is $length lines (at most $MAX: split it)" >&2
    bad=1
  fi
done <<<"$found"
for l in "${LONG[@]}"; do
  if [ -z "${seen[$l]+x}" ]; then
    echo "check_functions: '$l' is $MAX lines or fewer now: take it out of LONG in scripts/check_functions.sh" >&2
    bad=1
  fi
done
if [ $bad = 0 ]; then
  if [ ${#LONG[@]} = 0 ]; then
    echo "check_functions: no function in src/ over $MAX lines"
  else
    echo "check_functions: no function in src/ over $MAX lines but the ${#LONG[@]} listed to split"
  fi
fi
exit $bad
