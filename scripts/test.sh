#!/usr/bin/env bash
# Sets up, builds and runs the whole test suite: a release build with warnings
# as errors, then the same tests under AddressSanitizer + UndefinedBehaviorSanitizer,
# then every fuzz target for a short time (scripts/fuzz.sh in its CI mode).
#   scripts/test.sh            # all three
#   QUERN_TEST_ASAN=0 ...      # skip the sanitizer build
#   QUERN_TEST_FUZZ=0 ...      # skip the fuzzing step (libFuzzer, every target briefly)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

scripts/setup.sh
# The scale-out tests fail rather than skip when hosts cannot be built here.
export QUERN_REQUIRE_NETBED=1

echo "== format check"
mapfile -t sources < <(git ls-files '*.h' '*.cc' 2>/dev/null || true)
if [ ${#sources[@]} -gt 0 ]; then
  clang-format --dry-run --Werror "${sources[@]}"
fi

echo "== release build (warnings are errors)"
cmake --preset ci >/dev/null
cmake --build --preset ci
ctest --preset ci -j2
echo "== the Python wheel (pip wheel ., a fresh venv with numpy 2)"
QUERN_TEST_MODELS="$ROOT/build/ci/test_models" scripts/test_wheel.sh
echo "== the installation (cmake --install; examples/embed built against it)"
scripts/test_install.sh "$ROOT/build/ci"
echo "== the Debian package (cpack; dpkg -i, started as its unit starts it, dpkg -r and --purge)"
scripts/test_deb.sh "$ROOT/build/ci"

if [ "${QUERN_TEST_ASAN:-1}" = 1 ]; then
  echo "== AddressSanitizer + UndefinedBehaviorSanitizer build"
  cmake --preset asan >/dev/null
  cmake --build --preset asan
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    ctest --preset asan -j2
fi
if [ "${QUERN_TEST_FUZZ:-1}" = 1 ]; then
  echo "== fuzzing (libFuzzer under ASan + UBSan, every target briefly; scripts/fuzz.sh runs long)"
  QUERN_FUZZ_CI=1 scripts/fuzz.sh
fi
echo "== all tests passed"
