#!/usr/bin/env bash
# HTTP jobs with results in Redis, two builds side by side: small_cnn jobs
# (batch 1, binary tensors, 48 KiB) posted by wrk (16 connections) to
# POST /v2/models/small_cnn/jobs for a few seconds, then every accepted job
# waited for; jobs/s = jobs done / (last finished - first submitted), from
# the results' own timestamps in Redis; CPU per job = the CPU time the
# servers and Redis used from the first post until every job had ended,
# over the jobs done (Redis's includes this script's polls for the end,
# the same for both builds). Each round runs BASE then NEW on one
# instance, then NEW on two instances (wrk posts to the first; both take
# jobs from the stream). Redis runs here without persistence.
#   bench/http_jobs_ab.sh BASE_BINARY NEW_BINARY [seconds of load, 3] [rounds, 3]
#   QUERN_JOBS_MODEL=identity ...   # 16-byte jobs ([1, 4] FP32) instead
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
BASE="$(realpath "$1")" NEW="$(realpath "$2")" SECS="${3:-3}" ROUNDS="${4:-3}"
command -v wrk >/dev/null || { echo "needs wrk: apt-get install wrk"; exit 1; }
build/venv/bin/python scripts/gen_models.py --bench bench/models --quiet
WORK=$(mktemp -d)
PIDS=()
trap 'kill "${PIDS[@]}" 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$WORK"' EXIT
mkdir -p "$WORK/repo"
MODEL="${QUERN_JOBS_MODEL:-small_cnn}"
ln -s "$ROOT/bench/models/$MODEL" "$WORK/repo/$MODEL"
RPORT=$(build/venv/bin/python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
redis-server --port "$RPORT" --bind 127.0.0.1 --dir "$WORK" --save "" --appendonly no > "$WORK/redis.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 100); do redis-cli -p "$RPORT" ping >/dev/null 2>&1 && break; sleep 0.1; done
build/venv/bin/python - "$WORK" "$MODEL" <<'PY'
import json, sys, numpy as np
name, shape = ("x", [1, 4]) if sys.argv[2] == "identity" else ("input", [1, 3, 64, 64])
x = np.random.default_rng(0).standard_normal(shape).astype(np.float32).tobytes()
h = json.dumps({"inputs": [{"name": name, "shape": shape, "datatype": "FP32",
                            "parameters": {"binary_data_size": len(x)}}]}).encode()
open(f"{sys.argv[1]}/body", "wb").write(h + x)
open(f"{sys.argv[1]}/len", "w").write(str(len(h)))
PY
cat > "$WORK/jobs.lua" <<LUA
wrk.method = "POST"
local f = io.open("$WORK/body", "rb"); wrk.body = f:read("*a"); f:close()
wrk.headers["Inference-Header-Content-Length"] = "$(cat "$WORK/len")"
wrk.headers["Content-Type"] = "application/octet-stream"
accepted = 0
response = function(status, headers, body) if status == 202 then accepted = accepted + 1 end end
LUA

# start NAME BINARY: a server on the repository with Redis; sets PORT.
start() {
  "$2" serve --model-repository "$WORK/repo" --allow-links-outside-repository --http-port 0 --grpc-port -1 \
    --metrics-port 0 --host 127.0.0.1 --redis-url "redis://127.0.0.1:$RPORT/0" > "$WORK/$1.log" 2>&1 &
  PIDS+=($!)
  for _ in $(seq 200); do grep -q "quern: serving" "$WORK/$1.log" && break; sleep 0.1; done
  PORT=$(grep -o 'HTTP listening on [^ ]*' "$WORK/$1.log" | sed 's/.*://')
}

# cpu_ticks PID...: the CPU time (user + system, in clock ticks) they used so far.
cpu_ticks() {
  local t=0 pid
  for pid in "$@"; do t=$((t + $(awk '{print $14 + $15}' "/proc/$pid/stat"))); done
  echo "$t"
}

# run LABEL SERVER_PID...: posts jobs for SECS to PORT, waits for them, prints the line.
run() {
  local label=$1; shift
  redis-cli -p "$RPORT" flushall >/dev/null
  local out non2xx q0 r0
  q0=$(cpu_ticks "$@"); r0=$(cpu_ticks "${PIDS[0]}")
  out=$(wrk -t 1 -c 16 -d "${SECS}s" -s "$WORK/jobs.lua" "http://127.0.0.1:$PORT/v2/models/$MODEL/jobs")
  non2xx=$(echo "$out" | awk '/Non-2xx/ {print $5}')
  build/venv/bin/python - "$RPORT" "$label" "${non2xx:-0}" "$q0" "$r0" "$(getconf CLK_TCK)" "${PIDS[0]}" "$@" <<'PY'
import json, sys, time
import redis
r = redis.Redis(port=int(sys.argv[1]))
label, refused = sys.argv[2], int(sys.argv[3])
q0, r0, tck, redis_pid, servers = int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]), sys.argv[7], sys.argv[8:]
def ticks(pids):
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total
deadline = time.time() + 120
while True:
    keys = [k for k in r.scan_iter("results:*", count=10000) if b":bin:" not in k]
    docs = [json.loads(v) for v in r.mget(keys)] if keys else []
    waiting = sum(1 for d in docs if d["status"] in ("queued", "running"))
    if waiting == 0 or time.time() > deadline:
        break
    time.sleep(0.2)
q_us = (ticks(servers) - q0) / tck * 1e6
r_us = (ticks([redis_pid]) - r0) / tck * 1e6
done = [d for d in docs if d["status"] == "done"]
span = (max(d["finished_ms"] for d in done) - min(d["submitted_ms"] for d in done)) / 1000
print(f"{label:28s} {len(done):6d} jobs done, {refused} refused, {len(docs) - len(done) - waiting} failed, "
      f"{waiting} unfinished: {len(done) / span:8.0f} jobs/s; CPU per job: Quern {q_us / len(done):5.0f} us, "
      f"Redis {r_us / len(done):4.0f} us")
PY
}

for round in $(seq "$ROUNDS"); do
  start base "$BASE"; run "round $round base, 1 instance" "${PIDS[-1]}"; kill "${PIDS[-1]}"; wait "${PIDS[-1]}" 2>/dev/null || true; unset 'PIDS[-1]'
  start new "$NEW"; run "round $round new, 1 instance" "${PIDS[-1]}"; kill "${PIDS[-1]}"; wait "${PIDS[-1]}" 2>/dev/null || true; unset 'PIDS[-1]'
  start new2 "$NEW"; first=$PORT; start new3 "$NEW"; PORT=$first
  run "round $round new, 2 instances" "${PIDS[-2]}" "${PIDS[-1]}"
  for _ in 1 2; do kill "${PIDS[-1]}"; wait "${PIDS[-1]}" 2>/dev/null || true; unset 'PIDS[-1]'; done
done
