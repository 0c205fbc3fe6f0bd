#!/usr/bin/env bash
# Job stream benchmark: small_cnn jobs (batch 1, binary tensors) through the
# Redis stream (XADD by bench/jobs_load.py; `quern serve --consume` takes them
# with XREADGROUP, writes results:{id} and XACKs in one MULTI/EXEC per batch)
# with one and with two Quern instances, beside direct HTTP infer (wrk, 16
# connections) against one instance, in the same run. Redis runs here without
# persistence. The stream is filled before the consumers start; jobs/s is
# measured over the servers' own timestamps (first job started to last job
# finished). Reports jobs/s and Redis command counts per batch.
#   bench/jobs_bench.sh [seconds of HTTP load, default 5] [jobs per stream run, default 10000]
#   QUERN_BENCH_PRESET=ci ...   # use another optimised build (default: release)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
SECS="${1:-5}"
JOBS="${2:-10000}"
command -v wrk >/dev/null || { echo "needs wrk: apt-get install wrk"; exit 1; }
command -v redis-server >/dev/null || { echo "needs redis-server: scripts/setup.sh"; exit 1; }
build/venv/bin/python scripts/gen_models.py --bench bench/models --quiet
PRESET="${QUERN_BENCH_PRESET:-release}"
cmake --preset "$PRESET" >/dev/null
cmake --build --preset "$PRESET" --target quern >/dev/null
WORK=$(mktemp -d)
PIDS=()
trap 'kill "${PIDS[@]}" 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$WORK"' EXIT
mkdir -p "$WORK/repo"
ln -s "$ROOT/bench/models/small_cnn" "$WORK/repo/small_cnn"
RPORT=$(build/venv/bin/python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
redis-server --port "$RPORT" --bind 127.0.0.1 --dir "$WORK" --save "" --appendonly no > "$WORK/redis.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 100); do redis-cli -p "$RPORT" ping >/dev/null 2>&1 && break; sleep 0.1; done

# start_quern NAME [args...]: starts a server, sets HTTP_PORT / METRICS_PORT.
start_quern() {
  local name=$1; shift
  build/$PRESET/src/cli/quern serve --model-repository "$WORK/repo" --allow-links-outside-repository --http-port 0 --grpc-port -1 --metrics-port 0 \
    --host 127.0.0.1 "$@" > "$WORK/$name.log" 2>&1 &
  PIDS+=($!)
  for _ in $(seq 200); do grep -q "quern: serving" "$WORK/$name.log" && break; sleep 0.1; done
  HTTP_PORT=$(grep -o 'HTTP listening on [^ ]*' "$WORK/$name.log" | sed 's/.*://')
  METRICS_PORT=$(grep -o 'metrics listening on [^ ]*' "$WORK/$name.log" | sed 's/.*://')
}

# Direct HTTP infer, the same request body as the jobs carry.
start_quern http
build/venv/bin/python - "$WORK" <<'PY'
import json, sys, numpy as np
x = np.random.default_rng(0).standard_normal((1, 3, 64, 64)).astype(np.float32).tobytes()
h = json.dumps({"inputs": [{"name": "input", "shape": [1, 3, 64, 64], "datatype": "FP32",
                            "parameters": {"binary_data_size": len(x)}}]}).encode()
open(f"{sys.argv[1]}/body", "wb").write(h + x)
open(f"{sys.argv[1]}/len", "w").write(str(len(h)))
PY
cat > "$WORK/infer.lua" <<LUA
wrk.method = "POST"
local f = io.open("$WORK/body", "rb"); wrk.body = f:read("*a"); f:close()
wrk.headers["Inference-Header-Content-Length"] = "$(cat "$WORK/len")"
wrk.headers["Content-Type"] = "application/octet-stream"
LUA
wrk -t 1 -c 16 -d 1s -s "$WORK/infer.lua" "http://127.0.0.1:$HTTP_PORT/v2/models/small_cnn/infer" >/dev/null
HTTP_RPS=$(wrk -t 1 -c 16 -d "${SECS}s" -s "$WORK/infer.lua" "http://127.0.0.1:$HTTP_PORT/v2/models/small_cnn/infer" |
           awk '/Requests\/sec/ {print $2}')
kill "${PIDS[-1]}"; wait "${PIDS[-1]}" 2>/dev/null || true; unset 'PIDS[-1]'
echo "direct HTTP infer, 16 connections, 1 instance: $HTTP_RPS req/s"

URL="redis://127.0.0.1:$RPORT/0"
for n in 1 2; do
  build/venv/bin/python bench/jobs_load.py produce "$RPORT" "$JOBS"
  ports=()
  for i in $(seq "$n"); do
    start_quern "c$n$i" --redis-url "$URL" --consume --consumer-name "c$n$i"
    ports+=("$METRICS_PORT")
  done
  echo "stream, $n instance(s): $(build/venv/bin/python bench/jobs_load.py drain "$RPORT" "$JOBS" "${ports[@]}")"
  for i in $(seq "$n"); do kill "${PIDS[-1]}"; wait "${PIDS[-1]}" 2>/dev/null || true; unset 'PIDS[-1]'; done
done
