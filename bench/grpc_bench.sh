#!/usr/bin/env bash
# gRPC benchmark: ghz (from the Go module proxy) calls ModelInfer (unary) on
# a real `quern serve` with raw_input_contents; reports throughput, latency and the
# server's CPU time per request (from /proc, user + system, all threads).
#   bench/grpc_bench.sh [seconds per run, default 5]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
SECS="${1:-5}"
GHZ="$(command -v ghz || echo "$HOME/go/bin/ghz")"
if [ ! -x "$GHZ" ]; then
  command -v go >/dev/null || { echo "needs Go (for ghz): apt-get install golang"; exit 1; }
  go install github.com/bojand/ghz/cmd/ghz@v0.120.0
fi
build/venv/bin/python scripts/gen_models.py --bench bench/models --quiet
cmake --preset release >/dev/null
cmake --build --preset release --target quern >/dev/null
WORK=$(mktemp -d)
trap 'kill $SERVER 2>/dev/null || true; rm -rf "$WORK"' EXIT
mkdir -p "$WORK/repo"
MODELS="identity small_cnn"
for m in $MODELS; do ln -s "$ROOT/bench/models/$m" "$WORK/repo/$m"; done

build/release/src/cli/quern serve --model-repository "$WORK/repo" --http-port 0 --grpc-port 0 --metrics-port 0 \
  --host 127.0.0.1 > "$WORK/log" 2>&1 &
SERVER=$!
for _ in $(seq 100); do grep -q "gRPC listening" "$WORK/log" && break; sleep 0.2; done
PORT=$(grep -o 'gRPC listening on [^ ]*' "$WORK/log" | sed 's/.*://')

# One request per model (batch 1, raw_input_contents), as ghz's JSON (bytes in base64).
build/venv/bin/python - "$WORK" <<'PY'
import base64, json, sys, numpy as np
work = sys.argv[1]
for name, shape, inp in [("identity", [1, 4], "x"), ("small_cnn", [1, 3, 64, 64], "input")]:
    data = np.random.default_rng(0).standard_normal(shape).astype(np.float32).tobytes()
    msg = {"model_name": name, "inputs": [{"name": inp, "datatype": "FP32", "shape": shape}],
           "raw_input_contents": [base64.b64encode(data).decode()]}
    json.dump(msg, open(f"{work}/{name}.json", "w"))
PY

cpu_ticks() { awk '{print $14 + $15}' "/proc/$SERVER/stat"; }
TCK=$(getconf CLK_TCK)
echo "model        call     conns   req/s      p50        p99        server CPU us/request"
for model in $MODELS; do
  for call in unary; do
    for c in 1 4 16 64; do
      t0=$(cpu_ticks)
      "$GHZ" --insecure --proto proto/grpc_service.proto --import-paths proto \
        --call inference.GRPCInferenceService.ModelInfer -D "$WORK/$model.json" -c "$c" --connections "$c" \
        -z "${SECS}s" --format json "127.0.0.1:$PORT" > "$WORK/out.json" 2>/dev/null || true
      t1=$(cpu_ticks)
      build/venv/bin/python - "$WORK/out.json" "$model" "$call" "$c" "$((t1 - t0))" "$TCK" <<'PY'
import json, sys
path, model, call, c, ticks, tck = sys.argv[1:]
r = json.load(open(path))
ok = r.get("statusCodeDistribution", {}).get("OK", 0)
lat = {d["percentage"]: d["latency"] / 1e3 for d in r.get("latencyDistribution") or []}
cpu_us = int(ticks) / int(tck) * 1e6 / max(ok, 1)
rps = ok / (r["total"] / 1e9) if r.get("total") else 0
errors = {k: v for k, v in r.get("statusCodeDistribution", {}).items() if k != "OK"}
print(f"{model:<12} {call:<7} {c:>5}  {rps:9.0f}  {lat.get(50, 0):8.0f}us  {lat.get(99, 0):8.0f}us  {cpu_us:.1f}"
      + (f"  errors {errors}" if errors else ""))
PY
    done
  done
done
