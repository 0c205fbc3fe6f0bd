#!/usr/bin/env bash
# Overload: open-loop load at a constant arrival rate against a real
# `quern serve`, at 1x, 2x and 3x the capacity measured just before with the
# same tool (closed loop): vegeta for HTTP and ghz for gRPC,
# both from the Go module proxy. For each run: offered and achieved rate,
# goodput (answers OK per second) against capacity, refusals (503 /
# UNAVAILABLE / RESOURCE_EXHAUSTED) and their latency, the latency of served
# requests, and the server's resident memory (min and max over the run,
# sampled every 0.5 s).
#
# The server runs on QUERN_BENCH_SERVER_CPUS (default: CPU 0) and the load
# generator on QUERN_BENCH_CLIENT_CPUS (default: the other CPUs), so that
# the generator's own cost at 3x does not take the server's cores; the
# server sizes its instances for the CPUs it is given.
#   bench/overload_bench.sh [seconds per run, default 15] [targets...]
#   targets: small_cnn small_cnn_grpc resnet50 resnet50_grpc vision (default: all but resnet50_grpc)
#   QUERN_BENCH_PRESET=ci ...   # use another optimised build (default: release)
#   QUERN_BENCH_SERVER_FLAGS="--max-queue-wait-ms 500" ...   # extra `quern serve` flags
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
SECS="${1:-15}"
shift || true
TARGETS="${*:-small_cnn small_cnn_grpc resnet50 vision}"
VEGETA="$ROOT/build/tools/bin/vegeta"
GHZ="$ROOT/build/tools/bin/ghz"
if [ ! -x "$VEGETA" ] || [ ! -x "$GHZ" ]; then
  command -v go >/dev/null || { echo "needs Go to install vegeta and ghz"; exit 1; }
  GOBIN="$ROOT/build/tools/bin" go install github.com/tsenart/vegeta/v12@v12.12.0
  GOBIN="$ROOT/build/tools/bin" GOFLAGS=-mod=mod go install github.com/bojand/ghz/cmd/ghz@v0.120.0
fi
# shellcheck source=bench/serve_lib.sh
source bench/serve_lib.sh
ON_SERVER=(taskset -c "$SERVER_CPUS")
ON_CLIENT=(taskset -c "$CLIENT_CPUS")
cmake --build --preset "$PRESET" --target image_bench >/dev/null
SAMPLER=""
trap 'kill $SERVER $SAMPLER 2>/dev/null || true; rm -rf "$WORK"' EXIT
mkdir -p "$WORK/repo"
for m in small_cnn resnet50 detect_640; do ln -s "$ROOT/bench/models/$m" "$WORK/repo/$m"; done
build/$PRESET/bench/image_bench --iterations 1 --out-dir "$WORK" >/dev/null
# A fresh server for every target: what one target leaves queued must not weigh on the next.
start_overload_server() {
  # shellcheck disable=SC2086
  start_server "$WORK/repo" ${QUERN_BENCH_SERVER_FLAGS:-} --allow-links-outside-repository
}
start_overload_server
echo "server on CPUs $SERVER_CPUS, load generator on CPUs $CLIENT_CPUS ($PRESET build)"

# Request bodies and vegeta targets.
build/venv/bin/python - "$WORK" "$PORT" <<'PY'
import json, sys, numpy as np
from tritonclient.grpc import service_pb2
work, port = sys.argv[1], sys.argv[2]
for name, shape in [("small_cnn", [1, 3, 64, 64]), ("resnet50", [1, 3, 224, 224])]:
    data = np.random.default_rng(0).standard_normal(shape).astype(np.float32).tobytes()
    header = json.dumps({"inputs": [{"name": "input", "shape": shape, "datatype": "FP32",
                                     "parameters": {"binary_data_size": len(data)}}],
                         "parameters": {"binary_data_output": True}}).encode()
    open(f"{work}/{name}.body", "wb").write(header + data)
    # The same request as a gRPC ModelInferRequest (ghz -B).
    req = service_pb2.ModelInferRequest(model_name=name)
    req.inputs.add(name="input", datatype="FP32", shape=shape)
    req.raw_input_contents.append(data)
    open(f"{work}/{name}.pb", "wb").write(req.SerializeToString())
    open(f"{work}/{name}.targets", "w").write(
        f"POST http://127.0.0.1:{port}/v2/models/{name}/infer\n"
        f"Inference-Header-Content-Length: {len(header)}\nContent-Type: application/octet-stream\n"
        f"@{work}/{name}.body\n")
jpeg = open(f"{work}/640x480.jpg", "rb").read()
b = "quernbenchboundary"
body = (f"--{b}\r\nContent-Disposition: form-data; name=\"image\"; filename=\"frame.jpg\"\r\n"
        f"Content-Type: image/jpeg\r\n\r\n").encode() + jpeg + f"\r\n--{b}--\r\n".encode()
open(f"{work}/vision.body", "wb").write(body)
open(f"{work}/vision.targets", "w").write(
    f"POST http://127.0.0.1:{port}/v1/vision/detection\n"
    f"Content-Type: multipart/form-data; boundary={b}\n@{work}/vision.body\n")
PY

# Prints: achieved rate, goodput (200/s), 200 p50/p99 (ms), refusals, refusal p99 (ms), others.
summarise() {
  "$VEGETA" encode --to json < "$1" | build/venv/bin/python -c '
import json, sys
import numpy as np
import base64
rows = [json.loads(line) for line in sys.stdin]
for r in rows:  # CodeProject.AI answers refusals and errors as 200 with success false
    if r["code"] == 200 and b"\"success\":false" in base64.b64decode(r.get("body") or ""):
        r["code"] = 503 if b"try again later" in base64.b64decode(r["body"]) else 500
t = np.array([r["timestamp"] for r in rows], dtype="datetime64[ns]").astype(np.int64)
span = (t.max() - t.min()) / 1e9 if len(rows) > 1 else 1.0
# Steady goodput: answers OK completed in the last two thirds of the run.
done = np.array([ti + r["latency"] for ti, r in zip(t, rows) if r["code"] == 200])
lo, hi = t.min() + (t.max() - t.min()) / 3, t.max()
steady = ((done >= lo) & (done <= hi)).sum() / ((hi - lo) / 1e9) if len(done) else 0
ok = np.array([r["latency"] for r in rows if r["code"] == 200]) / 1e6
refused = np.array([r["latency"] for r in rows if r["code"] in (503, 429)]) / 1e6
other = sum(1 for r in rows if r["code"] not in (200, 503, 429))
pct = lambda a, q: f"{np.percentile(a, q):.2f}" if len(a) else "-"
print(f"{len(rows) / span:.1f} {len(ok) / span:.1f} {pct(ok, 50)} {pct(ok, 99)} {len(refused)} {pct(refused, 99)} {other} {steady:.1f}")'
}

# The same line from a ghz JSON report (its per-request details).
summarise_ghz() {
  build/venv/bin/python -c '
import json, sys
import numpy as np
rep = json.load(open(sys.argv[1]))
# Calls still in flight when ghz stops at the end of the run fail with the end of
# its connection ("error reading from server", "transport is closing"):
# neither answered nor refused by the server, they are left out.
cut = ("error reading from server", "transport is closing")
rows = [r for r in rep.get("details") or [] if not any(c in r.get("error", "") for c in cut)]
if not rows:
    print("0 0 - - 0 - 0"); sys.exit()
t = np.array([np.datetime64(r["timestamp"][:26].replace("T", " ")) for r in rows]).astype("datetime64[ns]").astype(np.int64)
span = (t.max() - t.min()) / 1e9 if len(rows) > 1 else 1.0
done = np.array([ti + r["latency"] for ti, r in zip(t, rows) if r["status"] == "OK"])
lo, hi = t.min() + (t.max() - t.min()) / 3, t.max()
steady = ((done >= lo) & (done <= hi)).sum() / ((hi - lo) / 1e9) if len(done) else 0
ok = np.array([r["latency"] for r in rows if r["status"] == "OK"]) / 1e6
refused = np.array([r["latency"] for r in rows if r["status"] in ("Unavailable", "ResourceExhausted")]) / 1e6
other = sum(1 for r in rows if r["status"] not in ("OK", "Unavailable", "ResourceExhausted"))
pct = lambda a, q: f"{np.percentile(a, q):.2f}" if len(a) else "-"
print(f"{len(rows) / span:.1f} {len(ok) / span:.1f} {pct(ok, 50)} {pct(ok, 99)} {len(refused)} {pct(refused, 99)} {other} {steady:.1f}")' "$1"
}

# attack TARGET RATE OUT: RATE 0 = closed loop (64 workers for the small CNN, 16 for the slower
# models: as many as keep their batches full without queueing past the admission bound, where
# refused workers retrying at once would spend the server's CPU on refusals); prints the summary.
attack() {
  local target="$1" rate="$2" out="$3"
  local workers=16
  case "$target" in small_cnn*) workers=64 ;; esac
  if [[ "$target" == *_grpc ]]; then
    local load=(--concurrency "$workers")
    [ "$rate" != 0 ] && load=(--rps "$rate" --async --concurrency 256)
    "${ON_CLIENT[@]}" "$GHZ" --insecure --proto proto/grpc_service.proto --import-paths proto \
      --call inference.GRPCInferenceService/ModelInfer -B "$WORK/${target%_grpc}.pb" "${load[@]}" --duration "${SECS}s" \
      --timeout 30s --format json --output "$out" "127.0.0.1:$GRPC_PORT" >/dev/null 2>&1 || true
    summarise_ghz "$out"
  else
    local load=(-rate 0 -max-workers "$workers")
    [ "$rate" != 0 ] && load=(-rate "${rate}/s")
    "${ON_CLIENT[@]}" "$VEGETA" attack -targets "$WORK/$target.targets" "${load[@]}" -duration "${SECS}s" \
      -timeout 30s > "$out"
    summarise "$out"
  fi
}

rss_sampler() {  # writes VmRSS (KiB) every 0.5 s
  while kill -0 "$SERVER" 2>/dev/null; do awk '/VmRSS/ {print $2}' "/proc/$SERVER/status"; sleep 0.5; done
}

# The floor of this machine and tool: GET /v2/health/live at 100/s on the idle server.
echo "GET http://127.0.0.1:$PORT/v2/health/live" > "$WORK/live.targets"
"${ON_CLIENT[@]}" "$VEGETA" attack -targets "$WORK/live.targets" -rate 100/s -duration 10s > "$WORK/live.bin"
echo "idle floor (vegeta, GET /v2/health/live at 100/s): $("$VEGETA" report < "$WORK/live.bin" | sed -n 's/^Latencies *//p')"
echo "(goodput: answers OK per second over the last two thirds of a run, after queues have filled)"
echo "target     load   offered/s  achieved/s  goodput/s  x cap   200 p50 ms  200 p99 ms  refused  refused p99 ms  other  RSS MiB (min-max)"
stop_server
for target in $TARGETS; do
  start_overload_server
  # Capacity: closed loop, enough workers to keep every instance busy.
  read -r _ _ _ _ _ _ _ cap <<< "$(attack "$target" 0 "$WORK/cap.out")"
  printf "%-10s %-5s %10s  %10s  %9s  %5s\n" "$target" closed - - "$cap" 1.00
  for mult in 1 2 3; do
    rate=$(awk -v c="$cap" -v m="$mult" 'BEGIN {printf "%d", c * m}')
    rss_sampler > "$WORK/rss" &
    SAMPLER=$!
    line="$(attack "$target" "$rate" "$WORK/run.out")"
    kill $SAMPLER 2>/dev/null || true
    wait $SAMPLER 2>/dev/null || true
    read -r achieved _ p50 p99 refused rp99 other good <<< "$line"
    rss=$(sort -n "$WORK/rss" | awk 'NR == 1 {min = $1} {max = $1} END {printf "%d-%d", min / 1024, max / 1024}')
    ratio=$(awk -v g="$good" -v c="$cap" 'BEGIN {printf "%.2f", g / c}')
    printf "%-10s %-5s %10s  %10s  %9s  %5s  %10s  %10s  %7s  %14s  %5s  %s\n" "$target" "${mult}x" "$rate" \
      "$achieved" "$good" "$ratio" "$p50" "$p99" "$refused" "$rp99" "$other" "$rss"
    sleep 2  # let the queue empty between runs
  done
  stop_server
done
