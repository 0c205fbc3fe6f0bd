#!/usr/bin/env bash
# Sets up, builds and runs the whole test suite: a release build with warnings
# as errors (gcc) and its black-box tests, then those again and the GoogleTest programs under
# AddressSanitizer + UndefinedBehaviorSanitizer (clang), with every fuzz target fuzzing for a
# short time beside them (scripts/fuzz.sh in its CI mode, on the sanitizer build's objects: the
# project is compiled once per compiler).
#   scripts/test.sh            # all three
#   QUERN_TEST_ASAN=0 ...      # skip the sanitizer build (the release build then runs the GoogleTest programs)
#   QUERN_TEST_FUZZ=0 ...      # skip the fuzzing step (libFuzzer, every target briefly)
#   QUERN_TEST_ASAN_ALL=1 ...  # the sanitizer build also runs the multi-host suite
#                              # (python_scale_out: Redis, HAProxy and three servers in
#                              # network namespaces, a minute of waiting on health checks
#                              # and failovers; its server paths, the stream consumer
#                              # and Redis results, run under the sanitizers in python_redis),
#                              # python_batch_delay (it checks which way the delay tuner
#                              # settles on from measured timings, which ASan's slowdown under a
#                              # parallel run can tip; its code paths run under the sanitizers in
#                              # batch_delay_tuner_test and the release stage checks the outcome),
#                              # and the two files that check real models' answers against
#                              # references: python_detector (the detection route's code runs
#                              # under the sanitizers in python_vision, python_openvino and
#                              # vision_service_test) and python_face_recognition (the face
#                              # routes' in python_face_clients and face_service_test)
# Each step prints how long it took.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

START=$SECONDS
STEP_START=$SECONDS
step() {  # step NAME: ends the step before (printing its seconds) and names the next
  if [ -n "${STEP_NAME:-}" ]; then
    echo "== ${STEP_NAME}: $((SECONDS - STEP_START)) s"
  fi
  STEP_NAME="$1"
  STEP_START=$SECONDS
  [ -n "$1" ] && echo "== $1"
  return 0
}

step "setup"
scripts/setup.sh
asan_build="" bench_build="" fuzz="" packaging=""
on_exit() {  # what runs in the background is stopped on the way out; the exit status stays the script's
  local rc=$?
  set +e
  for job in "$asan_build" "$bench_build"; do
    [ -n "$job" ] && { kill "$job" 2>/dev/null; wait "$job" 2>/dev/null; }
  done
  for group in "$fuzz" "$packaging"; do
    [ -n "$group" ] && { kill -- -"$group" 2>/dev/null; wait "$group" 2>/dev/null; }
  done
  exit "$rc"
}
trap on_exit EXIT
# The scale-out tests fail rather than skip when hosts cannot be built here.
export QUERN_REQUIRE_NETBED=1

step "format, layer and function-length checks"
mapfile -t sources < <(git ls-files '*.h' '*.cc' 2>/dev/null || true)
if [ ${#sources[@]} -gt 0 ]; then
  clang-format --dry-run --Werror "${sources[@]}"
fi
scripts/check_layers.sh --self-test
scripts/check_layers.sh
scripts/check_functions.sh

step "release build (warnings are errors)"
# The GoogleTest programs compile and run in the sanitizer build, which runs them all (but the few
# that only a build without the sanitizers can run): one compile of them instead of one per compiler.
unit_tests=ON
[ "${QUERN_TEST_ASAN:-1}" = 1 ] && unit_tests=OFF
cmake --preset ci -DQUERN_BUILD_UNIT_TESTS=$unit_tests >/dev/null
cmake --build --preset ci

# The sanitizer build compiles while the release tests run, on CPU time they leave idle (a third of
# it: they wait on servers, Redis, failovers): SCHED_IDLE runs it only when nothing else wants a core,
# and idle I/O priority, so the tests see the machine as before. Only compiles and links go there (the
# asan preset lists its GoogleTest cases when ctest runs, not in the build): anything with a time
# limit would be starved of time. The benchmarks (they only compile here: bench/ runs the release
# preset's) come after the tests' targets, beside the sanitizer tests.
if [ "${QUERN_TEST_ASAN:-1}" = 1 ]; then
  cmake --preset asan >/dev/null
  idle=(chrt --idle 0)
  "${idle[@]}" true 2>/dev/null || idle=(nice -n 19)
  ionice -c3 true 2>/dev/null && idle=(ionice -c3 "${idle[@]}")
  mkdir -p build/asan
  # ninja itself (the preset's two jobs), so that a kill on the way out stops its compilers too.
  "${idle[@]}" ninja -C build/asan -j2 proto/all src/all tests/all tests/fuzz/all >build/asan/build.log 2>&1 &
  asan_build=$!
  asan_start=$SECONDS
fi

# The wheel and the installation need only the release build: they run beside the release tests
# (at normal priority: each starts a server with a time limit), one after the other, in a session of
# their own (setsid, so that a way out stops what they started), their output kept for after the
# tests. (Alone, after the tests, they took 58 s on this machine's kind.) The Debian package, which
# installs into /usr and adds a user, waits for the tests.
# Their test models are their own (made in half a second), not the ones ctest makes and may remake.
packaging_log="$ROOT/build/ci/packaging.log"
setsid -w bash -c '
  set -euo pipefail
  t=$SECONDS
  export QUERN_TEST_MODELS="$1/packaging_models"
  rm -rf "$QUERN_TEST_MODELS"
  build/venv/bin/python scripts/gen_models.py --tests "$QUERN_TEST_MODELS" --quiet
  echo "== the Python wheel (pip wheel ., a fresh venv with numpy 2)"
  scripts/test_wheel.sh
  echo "== the Python wheel: $((SECONDS - t)) s"; t=$SECONDS
  echo "== the installation (cmake --install; examples/embed built against it)"
  scripts/test_install.sh "$1"
  echo "== the installation: $((SECONDS - t)) s"' packaging "$ROOT/build/ci" >"$packaging_log" 2>&1 &
packaging=$!

step "release tests (the sanitizer build compiles meanwhile on idle CPU; the wheel and the installation beside them)"
ctest --preset ci -j2
step "the Python wheel and the installation (begun beside the release tests): their end"
rc=0
wait "$packaging" || rc=$?
packaging=""
cat "$packaging_log"
[ "$rc" = 0 ] || { echo "== the wheel or the installation failed (rc $rc; build/ci/packaging.log)" >&2; exit 1; }
step "the Debian package (cpack; dpkg -i, started as its unit starts it, dpkg -r and --purge)"
scripts/test_deb.sh "$ROOT/build/ci"

if [ "${QUERN_TEST_ASAN:-1}" = 1 ]; then
  step "AddressSanitizer + UndefinedBehaviorSanitizer build (clang; the fuzz targets too): its end"
  running=1
  kill -0 "$asan_build" 2>/dev/null || running=0
  rc=0
  wait "$asan_build" || rc=$?
  asan_build=""
  if [ "$rc" != 0 ]; then
    tail -60 build/asan/build.log
    echo "== the sanitizer build failed (rc $rc; build/asan/build.log)" >&2
    exit 1
  fi
  if [ "$running" = 1 ]; then
    echo "== (the sanitizer build, started $((SECONDS - asan_start)) s ago beside the release tests, ended now)"
  else
    echo "== (the sanitizer build, started $((SECONDS - asan_start)) s ago beside the release tests, had ended)"
  fi
  "${idle[@]}" ninja -C build/asan -j2 >build/asan/bench-build.log 2>&1 &
  bench_build=$!
  step "AddressSanitizer + UndefinedBehaviorSanitizer tests (every fuzz target fuzzes and the benchmarks compile beside them)"
  # The fuzzing step's targets are this build's: each fuzzes for a fixed time (5 s, two at a time),
  # so beside the tests it takes no longer, it runs fewer inputs; at nice 10 the tests keep most of
  # the cores. The corpora are replayed here, among the tests. Its report follows the tests'.
  if [ "${QUERN_TEST_FUZZ:-1}" = 1 ]; then
    # A hang is an input past 60 s of wall time here (a tenth of a core, not 10 s alone); in a
    # session of its own (setsid), so that a way out stops its fuzzers too.
    QUERN_FUZZ_CI=1 QUERN_FUZZ_PRESET=asan QUERN_FUZZ_BUILT=1 QUERN_FUZZ_REPLAYED=1 QUERN_FUZZ_TIMEOUT=60 \
      setsid -w nice -n 10 scripts/fuzz.sh >build/asan/fuzz.log 2>&1 &
    fuzz=$!
  fi
  # Three at a time: the tests here leave CPU time, RSS and latency bounds to the release stage.
  skip=()
  [ "${QUERN_TEST_ASAN_ALL:-0}" = 1 ] || skip+=(python_scale_out python_batch_delay python_detector python_face_recognition)
  exclude=()
  [ ${#skip[@]} -gt 0 ] && exclude=(-E "^($(IFS='|'; echo "${skip[*]}"))$")
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    ctest --preset asan -j3 "${exclude[@]}"
  if [ -n "$fuzz" ]; then
    step "fuzzing (libFuzzer under ASan + UBSan, every target briefly, begun beside the tests; scripts/fuzz.sh runs long)"
    rc=0
    wait "$fuzz" || rc=$?
    fuzz=""
    cat build/asan/fuzz.log
    [ "$rc" = 0 ] || { echo "== fuzzing failed (rc $rc; build/asan/fuzz.log)" >&2; exit 1; }
  fi
  step "the benchmarks' sanitizer build (begun beside the tests): its end"
  rc=0
  wait "$bench_build" || rc=$?
  bench_build=""
  if [ "$rc" != 0 ]; then
    tail -60 build/asan/bench-build.log
    echo "== the benchmarks' sanitizer build failed (rc $rc; build/asan/bench-build.log)" >&2
    exit 1
  fi
elif [ "${QUERN_TEST_FUZZ:-1}" = 1 ]; then
  step "fuzzing (libFuzzer under ASan + UBSan, every target briefly; scripts/fuzz.sh runs long)"
  # The fuzz preset's own build (the sanitizer build is off).
  QUERN_FUZZ_CI=1 QUERN_FUZZ_PRESET=fuzz scripts/fuzz.sh
fi
step ""
echo "== all tests passed in $((SECONDS - START)) s"
