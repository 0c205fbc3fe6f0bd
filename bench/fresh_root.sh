# Sourced by bench/fresh_serve.sh and bench/fresh_test.sh: a fresh Debian 12 root to run this
# checkout's scripts in, as on a newcomer's machine (needs root).
#   fresh_root_prepare DIR   debootstraps DIR once (minbase + git + ca-certificates: empty apt, pip
#                            and ccache caches), gives it the machine's network settings (DNS, the
#                            CA certificates in /usr/local/share/ca-certificates, pip's cert) and
#                            /etc/hosts with localhost (a debootstrap'd root has none; every
#                            installed system has), and mounts it: bind-mounted on itself (so that
#                            `ip netns` can remount / inside it), /proc, /sys, /dev, a tmpfs /run
#   fresh_root_release DIR   unmounts all of that
#   in_fresh_root DIR CMD    runs bash -c CMD inside, as root, with a clean environment
fresh_root_prepare() {
  local r=$1
  [ "$(id -u)" = 0 ] || { echo "$(basename "$0"): needs root (debootstrap, chroot)" >&2; exit 1; }
  command -v debootstrap >/dev/null || apt-get install -y -qq debootstrap
  if [ ! -d "$r" ]; then
    debootstrap --variant=minbase --include=git,ca-certificates bookworm "$r" http://deb.debian.org/debian >/dev/null
  fi
  cp /usr/local/share/ca-certificates/*.crt "$r/usr/local/share/ca-certificates/" 2>/dev/null
  chroot "$r" update-ca-certificates >/dev/null 2>&1
  cp /etc/resolv.conf "$r/etc/resolv.conf"
  printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' > "$r/etc/pip.conf"
  [ -f "$r/etc/hosts" ] || printf '127.0.0.1\tlocalhost\n::1\t\tlocalhost ip6-localhost ip6-loopback\n' > "$r/etc/hosts"
  mountpoint -q "$r" || mount --bind "$r" "$r"
  mountpoint -q "$r/proc" || mount -t proc proc "$r/proc"
  mountpoint -q "$r/sys" || mount --rbind /sys "$r/sys"
  mountpoint -q "$r/dev" || mount --rbind /dev "$r/dev"
  mkdir -p "$r/run" && { mountpoint -q "$r/run" || mount -t tmpfs tmpfs "$r/run"; }
}

fresh_root_release() {
  umount -R "$1" 2>/dev/null
}

in_fresh_root() {
  chroot "$1" /usr/bin/env -i HOME=/root PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8 \
    bash -c "$2"
}
