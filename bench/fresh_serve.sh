#!/usr/bin/env bash
# scripts/serve.sh on a fresh Debian 12 root, as a newcomer runs it: a debootstrap'd bookworm
# (minbase + git + ca-certificates: empty package caches, no ccache, no venv), this checkout cloned
# into it, serve.sh run inside; prints the seconds to the end of setup, to the linked binary and to
# the first answered inference (add_sub over HTTP), and the bytes received on the network interface
# meanwhile (the whole machine's: keep other downloads away while it runs). Needs root.
#   bench/fresh_serve.sh [ROOT_DIR, default /srv/quern-fresh] [interface, default eth0]
# The machine's own CA certificates (e.g. an egress proxy's, in /usr/local/share/ca-certificates)
# and pip.conf's cert are copied in: the network is the machine's, the root is fresh.
set -uo pipefail
SRC="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
R=${1:-/srv/quern-fresh}
IF=${2:-eth0}
[ "$(id -u)" = 0 ] || { echo "fresh_serve: needs root (debootstrap, chroot)" >&2; exit 1; }
command -v debootstrap >/dev/null || apt-get install -y -qq debootstrap
if [ ! -d "$R" ]; then
  debootstrap --variant=minbase --include=git,ca-certificates bookworm "$R" http://deb.debian.org/debian >/dev/null
fi
cp /usr/local/share/ca-certificates/*.crt "$R/usr/local/share/ca-certificates/" 2>/dev/null
chroot "$R" update-ca-certificates >/dev/null 2>&1
cp /etc/resolv.conf "$R/etc/resolv.conf"
[ -f "$R/etc/hosts" ] || printf '127.0.0.1\tlocalhost\n::1\t\tlocalhost ip6-localhost ip6-loopback\n' > "$R/etc/hosts"
printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' > "$R/etc/pip.conf"
for m in proc sys dev dev/pts; do mountpoint -q "$R/$m" && continue
  case $m in proc) mount -t proc proc "$R/proc" ;; sys) mount -t sysfs sys "$R/sys" ;; *) mount --bind "/$m" "$R/$m" ;; esac
done
cleanup() { pkill -f "quern serve .*--http-port 18000" ; sleep 1; for m in dev/pts dev sys proc; do umount "$R/$m" 2>/dev/null; done; }
trap cleanup EXIT
rm -rf "$R/root/quern" && git clone -q "$SRC" "$R/root/quern"
rx() { awk -v i="$IF:" '$1==i {print $2}' /proc/net/dev; }
log=$(mktemp)
rx0=$(rx) t0=$SECONDS
chroot "$R" /usr/bin/env -i HOME=/root PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8 \
  bash -c 'cd /root/quern && scripts/serve.sh --http-port 18000 --grpc-port 18001 --metrics-port 18002' > "$log" 2>&1 &
pid=$!
body='{"inputs":[{"name":"INPUT0","shape":[1,4],"datatype":"FP32","data":[1,2,3,4]},{"name":"INPUT1","shape":[1,4],"datatype":"FP32","data":[10,20,30,40]}]}'
setup=0 linked=0
while kill -0 $pid 2>/dev/null; do
  if [ $setup = 0 ] && grep -q '^\[setup\] done' "$log"; then setup=1; echo "setup: $((SECONDS - t0)) s, $(( ($(rx) - rx0) / 1000000 )) MB received"; fi
  if [ $linked = 0 ] && grep -q 'Linking CXX executable src/cli/quern' "$log"; then linked=1; echo "quern linked: $((SECONDS - t0)) s"; fi
  curl -sf -o /dev/null "http://127.0.0.1:18000/v2/models/add_sub/infer" -d "$body" && break
  sleep 1
done
kill -0 $pid 2>/dev/null || { echo "fresh_serve: serve.sh stopped; its log:"; tail -30 "$log"; exit 1; }
echo "first answer: $((SECONDS - t0)) s, $(( ($(rx) - rx0) / 1000000 )) MB received"
grep 'models:' "$log"
