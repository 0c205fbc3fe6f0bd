#!/usr/bin/env bash
# Builds the `quern` wheel with `pip wheel .` (pyproject.toml: scikit-build-core
# and pybind11 from PyPI), installs it into a fresh venv with numpy 2 and runs
# the package's tests against the installed copy (numpy 1 is tested by ctest
# against the build tree). Needs scripts/setup.sh and the generated test models
# of a build (QUERN_TEST_MODELS, default build/ci/test_models).
#   scripts/test_wheel.sh
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
NUMPY2="numpy==2.4.6"
MODELS="${QUERN_TEST_MODELS:-$ROOT/build/ci/test_models}"
[ -d "$MODELS" ] || { echo "test_wheel: no test models in $MODELS (run ctest first)" >&2; exit 1; }

DIST="$ROOT/build/wheel/dist"
VENV="$ROOT/build/wheel/venv"
rm -rf "$DIST" "$VENV"
echo "== building the wheel (pip wheel .)"
# With the release build's compiler and compile flags (-Werror, as the ci preset) and a build folder
# as deep as build/ci, every engine object is a ccache hit after that build (ccache hashes the
# compiler's name too): only the extension is compiled.
CI_CXX=$(sed -n 's/^CMAKE_CXX_COMPILER:FILEPATH=//p' build/ci/CMakeCache.txt 2>/dev/null || true)
CXX="${CI_CXX:-${CXX:-c++}}" build/venv/bin/pip wheel -q --disable-pip-version-check --no-deps -w "$DIST" \
  --config-settings=cmake.define.QUERN_WERROR=ON --config-settings=build-dir=build/wheel-build .
wheel=$(ls "$DIST"/quern-*.whl)
# The licence in the metadata, the licence and notices in the wheel, and ONNX Runtime's beside its library.
python3 - "$wheel" <<'PY'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
meta = zipfile.ZipFile(sys.argv[1]).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
missing = [f for f in ("LICENSE", "NOTICE", "quern/onnxruntime/LICENSE", "quern/onnxruntime/ThirdPartyNotices.txt")
           if not any(n == f or n.endswith("/" + f) for n in names)]
if missing or "Apache-2.0" not in meta:
    sys.exit(f"test_wheel: the wheel lacks {missing} or its metadata the licence")
PY
echo "== installing $(basename "$wheel") into a fresh venv with $NUMPY2"
/usr/bin/python3 -m venv "$VENV"
"$VENV/bin/pip" install -q --disable-pip-version-check "$wheel" "$NUMPY2" pytest==8.3.3 onnx==1.17.0
echo "== the package's tests against the installed wheel"
cd "$VENV"  # not the checkout: `import quern` must find the installed package
QUERN_TEST_MODELS="$MODELS" QUERN_EXPECT_PACKAGE_IN="$VENV" \
  "$VENV/bin/python" -m pytest -q -p no:cacheprovider "$ROOT/tests/python/test_python_package.py"
