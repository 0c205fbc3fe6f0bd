#!/usr/bin/env bash
# scripts/test.sh (what CI runs) on a fresh Debian 12 root: a debootstrap'd bookworm (minbase + git
# + ca-certificates: no packages of the project's, no ccache, no venv), this checkout cloned into it;
# prints test.sh's own per-stage seconds (its "== stage: N s" lines) and the total. Needs root.
# The root is made only when ROOT_DIR does not exist: a later run in the same directory clones the
# project anew but finds the Debian packages and ccache of the runs before (name a new directory for
# a run from an empty root).
# Run it a second time with KEEP=1 for the warm figures (the same root, its caches filled), or with
# COLD_BUILD=1 to keep the root's packages, venv and downloads but empty its ccache and build trees.
# STRESS=50: stress-ng (run here, outside the root) keeps 50 % of every core busy meanwhile, as
# scripts/stress_check.sh does.
#   bench/fresh_test.sh [ROOT_DIR, default /srv/quern-fresh-test]
# The root: bench/fresh_root.sh.
set -uo pipefail
SRC="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
R=${1:-/srv/quern-fresh-test}
source "$SRC/bench/fresh_root.sh"
fresh_root_prepare "$R"
stress=""
cleanup() { [ -n "$stress" ] && kill "$stress" 2>/dev/null; fresh_root_release "$R"; }
trap cleanup EXIT
if [ "${KEEP:-0}" = 1 ] || [ "${COLD_BUILD:-0}" = 1 ] && [ -d "$R/root/quern" ]; then
  (cd "$R/root/quern" && git pull -q "$SRC" HEAD)
  if [ "${COLD_BUILD:-0}" = 1 ]; then
    rm -rf "$R/root/.ccache" "$R/root/.cache/ccache"
    find "$R/root/quern/build" -mindepth 1 -maxdepth 1 ! -name venv -exec rm -rf {} +
  fi
else
  rm -rf "$R/root/quern" && git clone -q "$SRC" "$R/root/quern"
fi
log="$R/root/test.log"
if [ -n "${STRESS:-}" ]; then
  command -v stress-ng >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends stress-ng >/dev/null
  stress-ng --cpu "$(nproc)" --cpu-load "$STRESS" --quiet &
  stress=$!
  echo "fresh_test: stress-ng keeps $STRESS % of each of $(nproc) cores busy"
fi
in_fresh_root "$R" 'cd /root/quern && scripts/test.sh' > "$log" 2>&1
rc=$?
[ -n "$stress" ] && { kill "$stress" 2>/dev/null; wait "$stress" 2>/dev/null; stress=""; }
grep -E '^== .*: [0-9]+ s$|^== all tests passed' "$log"
[ $rc = 0 ] || { echo "fresh_test: scripts/test.sh failed ($rc); the end of its log ($log):"; tail -40 "$log"; }
exit $rc
