#!/usr/bin/env bash
# Heap allocations per request: `quern serve` loaded by `quern perf` while a uprobe on glibc's malloc
# (perf probe; needs root and linux-perf) counts the server's calls, divided by the requests served.
# Counts do not depend on the machine's load, unlike CPU time: the measure to compare builds with.
#   bench/alloc_count.sh [connections, default 16]
#   QUERN_BENCH_PRESET=ci ...   # another optimised build (default: release)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
C="${1:-16}"
# shellcheck source=bench/serve_lib.sh
source bench/serve_lib.sh
LIBC=$(ldd "$QUERN" | sed -n 's/.*libc\.so\.6 => \([^ ]*\).*/\1/p')
perf probe -q -x "$LIBC" malloc 2>/dev/null || true  # once per boot; "already exists" is fine
EVENT=$(perf probe -l 2>/dev/null | sed -n 's/^ *\(probe_libc:malloc\) .*/\1/p' | head -1)
[ -n "$EVENT" ] || { echo "alloc_count: no uprobe on malloc (perf probe -x $LIBC malloc failed)" >&2; exit 1; }
mkdir -p "$WORK/repo"
cp -r bench/models/identity bench/models/small_cnn "$WORK/repo/"
start_server "$WORK/repo"
echo "| model | protocol | connections | allocations per request |"
echo "|---|---|---:|---:|"
for model in identity small_cnn; do
  for proto in http grpc stream; do
    proto_url "$proto"
    # shellcheck disable=SC2086
    taskset -c "$CLIENT_CPUS" "$QUERN" perf --url "$url" $extra -m "$model" -c "$C" -s 1 --warmup 0 >/dev/null
    perf stat -e "$EVENT" -x, -o "$WORK/stat" -p "$SERVER" -- sleep 4.5 &
    stat=$!
    sleep 0.2
    # shellcheck disable=SC2086
    ok=$(taskset -c "$CLIENT_CPUS" "$QUERN" perf --url "$url" $extra -m "$model" -c "$C" -s 4 --warmup 0 \
      --format csv | tail -1 | cut -d, -f8)
    wait "$stat"
    n=$(grep "$EVENT" "$WORK/stat" | cut -d, -f1)
    awk -v n="$n" -v ok="$ok" -v m="$model" -v p="$proto" -v c="$C" \
      'BEGIN { printf "| %s | %s | %s | %.1f |\n", m, p, c, n / ok }'
  done
done
stop_server
