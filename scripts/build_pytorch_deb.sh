#!/usr/bin/env bash
# Builds quern-pytorch, the Debian package of the LibTorch plugin (cmake --install --component
# pytorch): /usr/lib/quern/libquern_pytorch.so, which the quern package's server loads when the
# first PyTorch model loads. It depends on the same version of quern and on the LibTorch packages
# the plugin links (dpkg-shlibdeps), so the quern package itself never needs LibTorch.
#   scripts/build_pytorch_deb.sh [build dir, default build/ci] [output folder, default the build dir]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${1:-$ROOT/build/ci}"
OUT="${2:-$BUILD}"
[ -f "$BUILD/src/backends/libquern_pytorch.so" ] || { echo "build_pytorch_deb: $BUILD has no LibTorch plugin" >&2; exit 1; }
version=$(sed -n 's/^CMAKE_PROJECT_VERSION:STATIC=//p' "$BUILD/CMakeCache.txt")
[ -n "$version" ] || { echo "build_pytorch_deb: no project version in $BUILD/CMakeCache.txt" >&2; exit 1; }
arch=$(dpkg --print-architecture)
WORK="$(mktemp -d /tmp/quern-pytorch-deb-XXXXXX)"
trap 'rm -rf "$WORK"' EXIT
stage="$WORK/quern-pytorch_${version}_$arch"
# The quern package's prefix (/usr) and library folder, so the plugin lands where its server looks.
DESTDIR="$stage" cmake --install "$BUILD" --prefix /usr --component pytorch >/dev/null
plugin=$(cd "$stage" && find . -name libquern_pytorch.so | sed 's#^\./##')
[ -n "$plugin" ] || { echo "build_pytorch_deb: the pytorch component installed no plugin" >&2; exit 1; }
strip --strip-unneeded "$stage/$plugin"
# dpkg-shlibdeps reads a source package's control file: a minimal one in a scratch folder.
mkdir -p "$WORK/src/debian"
printf 'Source: quern\n\nPackage: quern-pytorch\nArchitecture: any\n' > "$WORK/src/debian/control"
depends=$(cd "$WORK/src" && dpkg-shlibdeps -O "$stage/$plugin" 2>/dev/null | sed -n 's/^shlibs:Depends=//p')
[ -n "$depends" ] || { echo "build_pytorch_deb: dpkg-shlibdeps found no dependencies" >&2; exit 1; }
mkdir -p "$stage/DEBIAN"
cat > "$stage/DEBIAN/control" <<CONTROL
Package: quern-pytorch
Version: $version
Architecture: $arch
Maintainer: Quern developers <quern@localhost>
Section: net
Priority: optional
Depends: quern (= $version), $depends
Installed-Size: $(du -sk "$stage/usr" | cut -f1)
Description: Quern's LibTorch plugin: PyTorch (TorchScript) models
 Lets the quern server run models with platform "pytorch_libtorch" (backend "pytorch") through
 Debian's LibTorch; loaded by the server when the first such model loads.
CONTROL
mkdir -p "$OUT"
dpkg-deb --root-owner-group --build "$stage" "$OUT" >/dev/null
echo "$OUT/quern-pytorch_${version}_$arch.deb"
