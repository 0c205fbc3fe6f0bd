#!/usr/bin/env bash
# The same detector file through each runtime, side by side in one server: examples/models/objects
# (YOLOv12-N, 640) run by ONNX Runtime FP32 (`objects`), by the runtime backend "auto" measured
# fastest (`objects_auto`; QUERN_NO_BF16=1 leaves bf16 out, as a CPU without it), by OpenVINO at its own precision on this CPU
# (`objects_openvino`: bf16 where the CPU has AVX512_BF16 or AMX) and by OpenVINO at f32
# (`objects_openvino_f32`). POST /v1/vision/custom/<model> with a 640x480 JPEG (examples/data/dog.jpg
# scaled, quality 90), wrk at 1 and 16 connections; the models take turns, round after round, so
# that a slower minute of a shared machine falls on all of them. Prints images/s and wrk's median
# latency per run, then the medians over the rounds.
#   bench/runtime_ab.sh [seconds per run, default 5] [rounds, default 3]
#   QUERN_BENCH_PRESET=release ...   # another optimised build (default: ci)
#   QUERN_BENCH_AB_OV_PARAMS="NUM_STREAMS=1 ..."   # more parameters for the OpenVINO variants
#   QUERN_BENCH_AB_MODEL=examples/models/imagenet ...  # another model folder (served at /v2/.../infer
#                                                      # is not measured: vision routes only)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
SECS="${1:-5}"
ROUNDS="${2:-3}"
MODEL_DIR="${QUERN_BENCH_AB_MODEL:-examples/models/objects}"
MODEL="$(basename "$MODEL_DIR")"
command -v wrk >/dev/null || { echo "needs wrk: apt-get install wrk"; exit 1; }
PRESET="${QUERN_BENCH_PRESET:-ci}"
cmake --preset "$PRESET" >/dev/null
cmake --build --preset "$PRESET" --target quern quern_openvino >/dev/null
WORK=$(mktemp -d)
trap 'kill $SERVER 2>/dev/null || true; rm -rf "$WORK"' EXIT

mkdir -p "$WORK/repo"
cp -r "$MODEL_DIR" "$WORK/repo/$MODEL"
# The file pinned to ONNX Runtime FP32 (`$MODEL`), and as backend "auto" chooses (`${MODEL}_auto`:
# with QUERN_NO_BF16=1 in the environment, as on a CPU without bf16).
sed -i -E '/^\s*(backend|platform)\s*:/d' "$WORK/repo/$MODEL/config.pbtxt"
cp -r "$WORK/repo/$MODEL" "$WORK/repo/${MODEL}_auto"
sed -i '1i backend: "onnxruntime"' "$WORK/repo/$MODEL/config.pbtxt"
sed -i -E '/^\s*name\s*:/d' "$WORK/repo/${MODEL}_auto/config.pbtxt"
sed -i "1i name: \"${MODEL}_auto\"\nbackend: \"auto\"" "$WORK/repo/${MODEL}_auto/config.pbtxt"
for variant in openvino openvino_f32; do
  cp -r "$MODEL_DIR" "$WORK/repo/${MODEL}_$variant"
  sed -i -E '/^\s*(backend|platform|name)\s*:/d' "$WORK/repo/${MODEL}_$variant/config.pbtxt"
  sed -i "1i name: \"${MODEL}_$variant\"\nbackend: \"openvino\"" "$WORK/repo/${MODEL}_$variant/config.pbtxt"
done
echo 'parameters { key: "INFERENCE_PRECISION_HINT" value { string_value: "f32" } }' \
  >> "$WORK/repo/${MODEL}_openvino_f32/config.pbtxt"
for kv in ${QUERN_BENCH_AB_OV_PARAMS:-}; do  # more OpenVINO parameters for both, KEY=VALUE
  for variant in openvino openvino_f32; do
    echo "parameters { key: \"${kv%%=*}\" value { string_value: \"${kv#*=}\" } }" \
      >> "$WORK/repo/${MODEL}_$variant/config.pbtxt"
  done
done
build/$PRESET/src/cli/quern serve --model-repository "$WORK/repo" --http-port 0 --metrics-port 0 --grpc-port -1 \
  --host 127.0.0.1 > "$WORK/log" 2>&1 &
SERVER=$!
for _ in $(seq 300); do grep -q "quern: serving" "$WORK/log" && break; sleep 0.2; done
grep -q "quern: serving" "$WORK/log" || { cat "$WORK/log"; exit 1; }
PORT=$(grep -o 'HTTP listening on [^ ]*' "$WORK/log" | sed 's/.*://')
grep "OpenVINO compiled\|runtime chosen" "$WORK/log" || true

build/venv/bin/python - "$WORK/body" "$WORK/type" <<'PY'
import io, sys
from PIL import Image
buf = io.BytesIO()
Image.open("examples/data/dog.jpg").convert("RGB").resize((640, 480), Image.LANCZOS).save(buf, "JPEG", quality=90)
b = "quernbenchboundary"
body = (f"--{b}\r\nContent-Disposition: form-data; name=\"image\"; filename=\"frame.jpg\"\r\n"
        f"Content-Type: image/jpeg\r\n\r\n").encode() + buf.getvalue() + \
       f"\r\n--{b}\r\nContent-Disposition: form-data; name=\"min_confidence\"\r\n\r\n0.4\r\n--{b}--\r\n".encode()
open(sys.argv[1], "wb").write(body)
open(sys.argv[2], "w").write(f"multipart/form-data; boundary={b}")
PY
cat > "$WORK/post.lua" <<LUA
wrk.method = "POST"
local f = io.open("$WORK/body", "rb"); wrk.body = f:read("*a"); f:close()
wrk.headers["Content-Type"] = "$(cat "$WORK/type")"
LUA
for m in "$MODEL" "${MODEL}_auto" "${MODEL}_openvino" "${MODEL}_openvino_f32"; do  # warm-up, and every answer a success
  curl -s -H "Content-Type: $(cat "$WORK/type")" --data-binary "@$WORK/body" \
    "127.0.0.1:$PORT/v1/vision/custom/$m" | grep -q '"success":true' || { echo "$m: no successful answer"; exit 1; }
done
echo "| round | model | connections | images/s | p50 |"
echo "|---:|---|---:|---:|---:|"
for round in $(seq "$ROUNDS"); do
  for c in 1 16; do
    for m in "$MODEL" "${MODEL}_auto" "${MODEL}_openvino" "${MODEL}_openvino_f32"; do
      out=$(wrk -t 1 -c "$c" -d "${SECS}s" --timeout 20s --latency -s "$WORK/post.lua" \
            "http://127.0.0.1:$PORT/v1/vision/custom/$m")
      rps=$(echo "$out" | awk '/Requests\/sec/ {print $2}')
      p50=$(echo "$out" | awk '$1 == "50%" {print $2}')
      if echo "$out" | grep -qE "Non-2xx|Socket errors"; then rps="$rps (errors)"; fi
      echo "| $round | $m | $c | $rps | $p50 |" | tee -a "$WORK/table"
    done
  done
done
echo
echo "medians over $ROUNDS rounds:"
awk -F'|' '{gsub(/ /, "", $3); gsub(/ /, "", $4); print $3, $4, $5}' "$WORK/table" | sort -k1,1 -k2,2n -k3,3n |
  awk '{k = $1 " " $2; v[k] = v[k] " " $3; n[k]++} END {for (k in v) {split(v[k], a, " "); m = a[int((n[k] + 1) / 2)];
       print k, m}}' | sort | awk '{printf "  %-24s %3s connections: %s images/s\n", $1, $2, $3}'
