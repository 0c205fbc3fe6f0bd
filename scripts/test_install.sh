#!/usr/bin/env bash
# Installs a build (cmake --install) into a temporary prefix and builds
# examples/embed against the installation -- with find_package(Quern) and with
# pkg-config -- never the source tree; runs it (a C++ model registered in
# code, requests scheduled and polled, and the repository's add_sub through
# the installed ONNX Runtime). Checks that the public headers are the only
# ones installed and that the installed `quern` binary starts.
#   scripts/test_install.sh [build dir, default build/ci]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
BUILD="${1:-$ROOT/build/ci}"
MODELS="${QUERN_TEST_MODELS:-$BUILD/test_models}"
[ -d "$MODELS/add_sub" ] || { echo "test_install: no test models in $MODELS (run ctest first)" >&2; exit 1; }
WORK="$(mktemp -d /tmp/quern-install-XXXXXX)"
trap 'rm -rf "$WORK"' EXIT
PREFIX="$WORK/prefix"

echo "== cmake --install into a temporary prefix"
cmake --install "$BUILD" --prefix "$PREFIX" >/dev/null
headers=$(cd "$PREFIX/include" && find . -type f | sort | tr '\n' ' ')
expected=$(cd "$ROOT/include" && find . -type f -name '*.h' | sort | tr '\n' ' ')
[ "$headers" = "$expected" ] || { echo "installed headers: $headers; expected the public ones: $expected" >&2; exit 1; }
for f in LICENSE NOTICE onnxruntime/LICENSE onnxruntime/ThirdPartyNotices.txt; do
  [ -f "$PREFIX/share/doc/quern/$f" ] || { echo "test_install: share/doc/quern/$f is missing" >&2; exit 1; }
done
if [ -f "$BUILD/src/backends/libquern_openvino.so" ]; then
  # OpenVINO where the build found it: the plugin, the runtime it loads and their notices.
  for f in lib/quern/libquern_openvino.so lib/quern/openvino/libopenvino_intel_cpu_plugin.so share/doc/quern/openvino/LICENSE; do
    [ -f "$PREFIX/$f" ] || { echo "test_install: $f is missing" >&2; exit 1; }
  done
fi
"$PREFIX/bin/quern" --help >/dev/null
"$PREFIX/bin/quern" perf --help >/dev/null  # runs quern-perf, installed beside it
# runs quern-quantize (Python, by its first line), installed beside it; --help needs no packages
"$PREFIX/bin/quern" quantize --help | grep -q "^usage: quern quantize"

echo "== examples/embed with find_package(Quern)"
cmake -S examples/embed -B "$WORK/cmake" -G Ninja -DCMAKE_PREFIX_PATH="$PREFIX" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$WORK/cmake" >/dev/null
"$WORK/cmake/embed" "$MODELS" | tail -3

echo "== examples/embed with pkg-config"
# shellcheck disable=SC2046
c++ -O2 -o "$WORK/embed-pc" examples/embed/main.cc $(PKG_CONFIG_PATH="$(dirname "$(find "$PREFIX" -name quern.pc)")" \
  pkg-config --cflags --libs quern) -pthread
"$WORK/embed-pc" | tail -1
if [ -f "$BUILD/src/backends/libquern_pytorch.so" ]; then
  echo "== the LibTorch plugin (cmake --install --component pytorch), found by the installed quern"
  cmake --install "$BUILD" --prefix "$PREFIX" --component pytorch >/dev/null
  /usr/bin/python3 tests/python/make_torch_models.py "$WORK/pt" >/dev/null
  # Run from PATH, as a user would: the plugin is found from the binary's own file, not argv[0].
  (cd "$WORK" && PATH="$PREFIX/bin:$PATH" exec quern serve --model-repository "$WORK/pt" --http-port 0 \
    --grpc-port 0 --metrics-port 0 --host 127.0.0.1) >"$WORK/serve.log" 2>&1 &
  server=$!
  port=""
  for _ in $(seq 100); do
    port=$(sed -n 's/.*HTTP listening on 127.0.0.1:\([0-9]*\).*/\1/p' "$WORK/serve.log")
    [ -n "$port" ] && grep -q "quern: serving" "$WORK/serve.log" && break
    sleep 0.2
  done
  answer=$(curl -s -X POST "http://127.0.0.1:$port/v2/models/pair/infer" -d '{"inputs":[
    {"name":"a","datatype":"FP32","shape":[1,2],"data":[0.5,-1.5]},
    {"name":"b","datatype":"INT64","shape":[1,2],"data":[1,2]}]}')
  kill "$server"
  wait "$server" 2>/dev/null || true
  grep -q "LibTorch plugin $PREFIX/lib.*/quern/libquern_pytorch.so" "$WORK/serve.log" ||
    { echo "the installed quern did not load the installed plugin:" >&2; cat "$WORK/serve.log" >&2; exit 1; }
  case "$answer" in
    *'"data":[1.5,0.5]'*'"data":[3,6]'*) ;;
    *) echo "pair answered: $answer" >&2; exit 1 ;;
  esac
fi
echo "== the installation works"
