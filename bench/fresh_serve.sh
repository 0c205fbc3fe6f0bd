#!/usr/bin/env bash
# scripts/serve.sh on a fresh Debian 12 root, as a newcomer runs it: a debootstrap'd bookworm
# (minbase + git + ca-certificates: empty package caches, no ccache, no venv), this checkout cloned
# into it, serve.sh run inside; prints the seconds to the end of setup, to the linked binary and to
# the first answered inference (add_sub over HTTP), and the bytes received on the network interface
# meanwhile (the whole machine's: keep other downloads away while it runs). Needs root.
#   bench/fresh_serve.sh [ROOT_DIR, default /srv/quern-fresh] [interface, default eth0]
# The root: bench/fresh_root.sh (the network settings are the machine's, the root is fresh).
set -uo pipefail
SRC="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
R=${1:-/srv/quern-fresh}
IF=${2:-eth0}
source "$SRC/bench/fresh_root.sh"
fresh_root_prepare "$R"
cleanup() { pkill -f "quern serve .*--http-port 18000" ; sleep 1; fresh_root_release "$R"; }
trap cleanup EXIT
rm -rf "$R/root/quern" && git clone -q "$SRC" "$R/root/quern"
rx() { awk -v i="$IF:" '$1==i {print $2}' /proc/net/dev; }
log=$(mktemp)
rx0=$(rx) t0=$SECONDS
in_fresh_root "$R" 'cd /root/quern && scripts/serve.sh --http-port 18000 --grpc-port 18001 --metrics-port 18002' > "$log" 2>&1 &
pid=$!
body='{"inputs":[{"name":"INPUT0","shape":[1,4],"datatype":"FP32","data":[1,2,3,4]},{"name":"INPUT1","shape":[1,4],"datatype":"FP32","data":[10,20,30,40]}]}'
setup=0 linked=0
while kill -0 $pid 2>/dev/null; do
  if [ $setup = 0 ] && grep -qE '^\[setup +[0-9]+ s\] done' "$log"; then setup=1; echo "setup: $((SECONDS - t0)) s, $(( ($(rx) - rx0) / 1000000 )) MB received"; fi
  if [ $linked = 0 ] && grep -q 'Linking CXX executable src/cli/quern' "$log"; then linked=1; echo "quern linked: $((SECONDS - t0)) s"; fi
  curl -sf -o /dev/null "http://127.0.0.1:18000/v2/models/add_sub/infer" -d "$body" && break
  sleep 1
done
kill -0 $pid 2>/dev/null || { echo "fresh_serve: serve.sh stopped; its log:"; tail -30 "$log"; exit 1; }
echo "first answer: $((SECONDS - t0)) s, $(( ($(rx) - rx0) / 1000000 )) MB received"
grep 'models:' "$log"
