#!/usr/bin/env bash
# scripts/test.sh (what CI runs) on a fresh Debian 12 root: a debootstrap'd bookworm (minbase + git
# + ca-certificates: empty package caches, no ccache, no venv), this checkout cloned into it;
# prints test.sh's own per-stage seconds (its "== stage: N s" lines) and the total. Needs root.
# Run it a second time with KEEP=1 for the warm figures (the same root, its caches filled), or with
# COLD_BUILD=1 to keep the root's packages, venv and downloads but empty its ccache and build trees.
#   bench/fresh_test.sh [ROOT_DIR, default /srv/quern-fresh-test]
# (A debootstrap'd root lacks /etc/hosts, which every installed system has: localhost is written
# in. The root is bind-mounted on itself so that `ip netns` can remount / inside it.)
set -uo pipefail
SRC="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
R=${1:-/srv/quern-fresh-test}
[ "$(id -u)" = 0 ] || { echo "fresh_test: needs root (debootstrap, chroot)" >&2; exit 1; }
command -v debootstrap >/dev/null || apt-get install -y -qq debootstrap
if [ ! -d "$R" ]; then
  debootstrap --variant=minbase --include=git,ca-certificates bookworm "$R" http://deb.debian.org/debian >/dev/null
fi
cp /usr/local/share/ca-certificates/*.crt "$R/usr/local/share/ca-certificates/" 2>/dev/null
chroot "$R" update-ca-certificates >/dev/null 2>&1
cp /etc/resolv.conf "$R/etc/resolv.conf"
printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' > "$R/etc/pip.conf"
[ -f "$R/etc/hosts" ] || printf '127.0.0.1\tlocalhost\n::1\t\tlocalhost ip6-localhost ip6-loopback\n' > "$R/etc/hosts"
mountpoint -q "$R" || mount --bind "$R" "$R"
mountpoint -q "$R/proc" || mount -t proc proc "$R/proc"
mountpoint -q "$R/sys" || mount --rbind /sys "$R/sys"
mountpoint -q "$R/dev" || mount --rbind /dev "$R/dev"
mkdir -p "$R/run" && { mountpoint -q "$R/run" || mount -t tmpfs tmpfs "$R/run"; }
cleanup() { umount -R "$R" 2>/dev/null; }
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
chroot "$R" /usr/bin/env -i HOME=/root PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8 \
  bash -c 'cd /root/quern && scripts/test.sh' > "$log" 2>&1
rc=$?
grep -E '^== .*: [0-9]+ s$|^== all tests passed' "$log"
[ $rc = 0 ] || { echo "fresh_test: scripts/test.sh failed ($rc); the end of its log ($log):"; tail -40 "$log"; }
exit $rc
