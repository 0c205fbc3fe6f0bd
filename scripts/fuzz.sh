#!/usr/bin/env bash
# Builds the libFuzzer targets (preset fuzz: clang, ASan + UBSan, -O2) and runs each
# one for a while on a copy of its corpus, then minimises the corpus with what
# it found (libFuzzer -merge=1) back into tests/fuzz/corpus/<target>: the
# hand-made seed-* files, and the fewest inputs that add coverage to them.
#
#   scripts/fuzz.sh                    # every target, 60 s each
#   scripts/fuzz.sh 3600 kserve_infer  # one target for an hour
#   QUERN_FUZZ_CI=1 scripts/fuzz.sh    # CI: replay the corpora, then every target
#                                      # for QUERN_FUZZ_CI_SECONDS (5), two at a
#                                      # time, nothing merged back
#
# Environment: QUERN_FUZZ_PRESET (the build to use: fuzz, or asan -- the sanitizer
# build the tests run in, which builds the fuzz targets too; scripts/test.sh
# uses it so that CI compiles the project once under clang),
# QUERN_FUZZ_JOBS (targets run at once; 1, or 2 in CI),
# QUERN_FUZZ_RESULTS (file a line per target is appended to;
# build/<preset>/results.txt), QUERN_FUZZ_MERGE=0 (do not merge back),
# QUERN_FUZZ_RUNS (stop a target after this many executions, or at the time
# given, whichever comes first), QUERN_FUZZ_BUILT=1 (the build is done: neither
# configured nor built again), QUERN_FUZZ_REPLAYED=1 (CI: the corpora are
# replayed by the caller's ctest run: not here), QUERN_FUZZ_TIMEOUT (seconds of wall
# time an input may take before it counts as a hang; 10).
# Prints the executions per target and exits non-zero on any crash, leak,
# timeout, out-of-memory or undefined behaviour; the input that caused it is
# kept in build/<preset>/artifacts/<target>/ (run the target on that file to
# reproduce: build/<preset>/tests/fuzz/fuzz_<target> FILE).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

ALL_TARGETS=(kserve_infer multipart image_decode image_decode_jpeg image_decode_png image_decode_bmp image_decode_webp
             model_config resp stream_entry job_record grpc_convert http_handlers content_encoding custom_metrics)

CI="${QUERN_FUZZ_CI:-0}"
if [ "$CI" = 1 ]; then
  SECONDS_PER_TARGET="${1:-${QUERN_FUZZ_CI_SECONDS:-5}}"
  JOBS="${QUERN_FUZZ_JOBS:-2}"
  MERGE=0
else
  SECONDS_PER_TARGET="${1:-60}"
  JOBS="${QUERN_FUZZ_JOBS:-1}"
  MERGE="${QUERN_FUZZ_MERGE:-1}"
fi
[ $# -gt 0 ] && shift
TARGETS=("$@")
[ ${#TARGETS[@]} -eq 0 ] && TARGETS=("${ALL_TARGETS[@]}")
for t in "${TARGETS[@]}"; do
  [ -d "tests/fuzz/corpus/$t" ] || { echo "fuzz: unknown target '$t' (targets: ${ALL_TARGETS[*]})" >&2; exit 2; }
done

PRESET="${QUERN_FUZZ_PRESET:-fuzz}"
case "$PRESET" in fuzz | asan) ;; *) echo "fuzz: QUERN_FUZZ_PRESET must be fuzz or asan, not '$PRESET'" >&2; exit 2 ;; esac
BUILD="$ROOT/build/$PRESET"
RESULTS="${QUERN_FUZZ_RESULTS:-$BUILD/results.txt}"

log() { printf '[fuzz] %s\n' "$*"; }

if [ "${QUERN_FUZZ_BUILT:-0}" != 1 ]; then
  log "building (preset $PRESET)"
  cmake --preset "$PRESET" >/dev/null
  cmake --build --preset "$PRESET"
fi

# Readable stacks: llvm-symbolizer when installed, else binutils' addr2line.
SYMBOLIZER="$(command -v llvm-symbolizer-16 || command -v llvm-symbolizer || command -v addr2line || true)"
export ASAN_OPTIONS="detect_leaks=1:external_symbolizer_path=$SYMBOLIZER${ASAN_OPTIONS:+:$ASAN_OPTIONS}"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:external_symbolizer_path=$SYMBOLIZER${UBSAN_OPTIONS:+:$UBSAN_OPTIONS}"
# What ONNX Runtime allocates inside itself is not judged by the per-input leak check (see the file).
export LSAN_OPTIONS="suppressions=$ROOT/tests/fuzz/lsan.supp:print_suppressions=0${LSAN_OPTIONS:+:$LSAN_OPTIONS}"

if [ "$CI" = 1 ] && [ "${QUERN_FUZZ_REPLAYED:-0}" != 1 ]; then
  log "replaying every corpus (ctest)"
  ctest --preset "$PRESET" -j"$JOBS" -R '^fuzz_replay_'
fi

WORK="$BUILD/work"
LOGS="$BUILD/logs"
mkdir -p "$WORK" "$LOGS" "$(dirname "$RESULTS")"

# run_target NAME: fuzzes NAME for SECONDS_PER_TARGET; its summary goes to $LOGS/NAME.summary.
run_target() {
  local t="$1"
  local bin="$BUILD/tests/fuzz/fuzz_$t"
  local corpus="$WORK/$t" artifacts="$BUILD/artifacts/$t"
  local dict="tests/fuzz/$t.dict"
  case "$t" in image_decode*) dict="tests/fuzz/image_decode.dict" ;; esac
  rm -rf "$corpus"
  mkdir -p "$corpus" "$artifacts"
  cp -r "tests/fuzz/corpus/$t/." "$corpus/"
  local args=(-max_total_time="$SECONDS_PER_TARGET" -rss_limit_mb=2048 -timeout="${QUERN_FUZZ_TIMEOUT:-10}" -print_final_stats=1
              -artifact_prefix="$artifacts/")
  [ -f "$dict" ] && args+=(-dict="$dict")
  [ -n "${QUERN_FUZZ_RUNS:-}" ] && args+=(-runs="$QUERN_FUZZ_RUNS")
  local rc=0
  "$bin" "${args[@]}" "$corpus" >"$LOGS/$t.log" 2>&1 || rc=$?
  local execs rate
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$LOGS/$t.log" | tail -1)
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$LOGS/$t.log" | tail -1)
  local status=ok
  if [ "$rc" != 0 ]; then
    status="FAILED(rc=$rc)"
  elif [ "$MERGE" = 1 ]; then
    # Minimised from scratch: the hand-made seeds (seed-*) always stay, then
    # whatever of the old corpus and this run adds coverage to them.
    local merged="$WORK/$t.merged"
    rm -rf "$merged"
    mkdir -p "$merged"
    find "tests/fuzz/corpus/$t" -maxdepth 1 -type f -name 'seed-*' -exec cp {} "$merged/" \;
    if "$bin" -merge=1 -rss_limit_mb=2048 -timeout=10 "$merged" "tests/fuzz/corpus/$t" "$corpus" \
        >"$LOGS/$t.merge.log" 2>&1; then
      find "tests/fuzz/corpus/$t" -maxdepth 1 -type f ! -name 'seed-*' -delete
      find "$merged" -maxdepth 1 -type f ! -name 'seed-*' -exec cp {} "tests/fuzz/corpus/$t/" \;
    else
      status="merge-failed"
    fi
  fi
  printf '%s %s %ss %s execs %s exec/s %s\n' "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$t" "$SECONDS_PER_TARGET" \
    "${execs:-0}" "${rate:-0}" "$status" >"$LOGS/$t.summary"
}

log "running ${#TARGETS[@]} targets for ${SECONDS_PER_TARGET}s each, $JOBS at a time"
for t in "${TARGETS[@]}"; do
  rm -f "$LOGS/$t.summary"
  while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n || true; done
  run_target "$t" &
done
wait
failed=0

printf '%-20s %12s %10s  %s\n' target execs exec/s status
for t in "${TARGETS[@]}"; do
  if [ ! -f "$LOGS/$t.summary" ]; then
    printf '%-20s %12s %10s  %s\n' "$t" - - "did not finish"
    failed=1
    continue
  fi
  read -r _ _ _ execs _ rate _ status <"$LOGS/$t.summary"
  printf '%-20s %12s %10s  %s\n' "$t" "$execs" "$rate" "$status"
  cat "$LOGS/$t.summary" >>"$RESULTS"
  case "$status" in FAILED*) failed=1 ;; esac
  if [ "$status" != ok ]; then
    grep -E 'ERROR: |runtime error|SUMMARY|Test unit written|fuzz invariant' "$LOGS/$t.log" | head -8 | sed 's/^/    /'
    echo "    log: $LOGS/$t.log"
  fi
done
log "results appended to $RESULTS"
[ "$failed" = 0 ] || { log "FAILED: a target crashed, leaked or hit undefined behaviour (artifacts in $BUILD/artifacts/)"; exit 1; }
log "no crash, leak or undefined behaviour"
