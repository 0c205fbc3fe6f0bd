#!/usr/bin/env bash
# Vision benchmark: decode + resize per image on one core (image_bench), then
# end-to-end CodeProject.AI detection (POST /v1/vision/detection, multipart)
# against a real `quern serve` with wrk at concurrency 1-16, for 640x480,
# 1920x1080 and 3840x2160 JPEGs. The model is bench/models/detect_640: a
# 640x640 YOLOv8-layout detector with a small-YOLO-sized backbone (~1 GFLOP).
# The per-image breakdown (decode, resize, queue, infer, post) comes from the
# server's quern_vision_stage_seconds_total counters over each run.
# "cpu" is the server's CPU time (user + system, /proc) per answered image.
#   bench/vision_bench.sh [seconds per run, default 5] [connections, default "1 2 4 8 16"]
#   QUERN_BENCH_PRESET=ci ...   # use another optimised build (default: release)
#   QUERN_BENCH_VISION_MODEL=detect_v5n ...  # another bench model (default: detect_640), or a
#                                            # model folder: QUERN_BENCH_VISION_MODEL=examples/models/objects
#   QUERN_BENCH_VISION_PHOTO=examples/data/dog.jpg ...  # frames scaled from this photograph (JPEG
#                                            # quality 90) instead of the synthetic ones
#   QUERN_BENCH_VISION_SIZES="640x480 1920x1080" ...    # frame sizes (default: also 3840x2160)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
SECS="${1:-5}"
CONNS="${2:-1 2 4 8 16}"
MODEL="${QUERN_BENCH_VISION_MODEL:-detect_640}"
MODEL_DIR="bench/models/$MODEL"
case "$MODEL" in */*) MODEL_DIR="$MODEL"; MODEL="$(basename "$MODEL")" ;; esac
SIZES="${QUERN_BENCH_VISION_SIZES:-640x480 1920x1080 3840x2160}"
command -v wrk >/dev/null || { echo "needs wrk: apt-get install wrk"; exit 1; }
build/venv/bin/python scripts/gen_models.py --bench bench/models --quiet
PRESET="${QUERN_BENCH_PRESET:-release}"
cmake --preset "$PRESET" >/dev/null
cmake --build --preset "$PRESET" --target quern image_bench engine_bench >/dev/null
WORK=$(mktemp -d)
trap 'kill $SERVER 2>/dev/null || true; rm -rf "$WORK"' EXIT

echo "== decode + resize into 640x640 FP32 (letterbox), one core, median of 30"
build/$PRESET/bench/image_bench --iterations 30 --out-dir "$WORK"

echo
echo "== the model alone: raw ONNX Runtime ceiling X* and Engine-direct (engine_bench, random tensors)"
# (a model exported at a fixed batch of 1, as the default detector is, runs at batch 1)
MAXB=$(sed -n 's/^max_batch_size:[[:space:]]*\([0-9]*\).*/\1/p' "$MODEL_DIR/config.pbtxt" 2>/dev/null | head -1)
MAXB=${MAXB:-8}
RAWB="1 2 4"
[ "$MAXB" -le 1 ] && RAWB="1"
# shellcheck disable=SC2086
build/$PRESET/bench/engine_bench --model "$MODEL_DIR/1/model.onnx" --seconds "$SECS" --max-batch "$MAXB" \
  --raw-batches $RAWB --submitters 16 --gain-submitters 0 | grep -E "ceiling|^ *16 "

mkdir -p "$WORK/repo"
ln -s "$(cd "$MODEL_DIR" && pwd)" "$WORK/repo/$MODEL"
build/$PRESET/src/cli/quern serve --model-repository "$WORK/repo" --allow-links-outside-repository --http-port 0 --metrics-port 0 --grpc-port -1 \
  --host 127.0.0.1 > "$WORK/log" 2>&1 &
SERVER=$!
for _ in $(seq 100); do grep -q "metrics listening" "$WORK/log" && break; sleep 0.2; done
PORT=$(grep -o 'HTTP listening on [^ ]*' "$WORK/log" | sed 's/.*://')
MPORT=$(grep -o 'metrics listening on [^ ]*' "$WORK/log" | sed 's/.*://')

# stage sums (seconds) and timed image count, space separated
source bench/vision_stages.sh
stages() { vision_stages "$MPORT"; }

# the server's user + system CPU time, in clock ticks
cpu_ticks() { awk '{print $14 + $15}' "/proc/$SERVER/stat"; }

echo
echo "== end to end: POST /v1/vision/detection ($MODEL), wrk, $SECS s per run"
echo "(infer: the compute time of the batch the image ran in)"
echo "(cpu: the server's CPU ms per image; stages: the CPU ms of decode + resize + post on the vision threads,"
echo " and their share of cpu)"
echo "image      conns  images/s   p50       p99       | ms per image: decode resize  queue   infer   post |  cpu  | stages"
for size in $SIZES; do
  build/venv/bin/python - "$WORK/$size.jpg" "$WORK/$size.body" "$WORK/$size.type" "$size" \
    "${QUERN_BENCH_VISION_PHOTO:-}" <<'PY'
import io, sys
jpeg = open(sys.argv[1], "rb").read()
if sys.argv[5]:  # a photograph scaled to the frame size
    from PIL import Image
    w, h = (int(v) for v in sys.argv[4].split("x"))
    buf = io.BytesIO()
    Image.open(sys.argv[5]).convert("RGB").resize((w, h), Image.LANCZOS).save(buf, "JPEG", quality=90)
    jpeg = buf.getvalue()
    open(sys.argv[1], "wb").write(jpeg)
b = "quernbenchboundary"
body = (f"--{b}\r\nContent-Disposition: form-data; name=\"image\"; filename=\"frame.jpg\"\r\n"
        f"Content-Type: image/jpeg\r\n\r\n").encode() + jpeg + \
       f"\r\n--{b}\r\nContent-Disposition: form-data; name=\"min_confidence\"\r\n\r\n0.4\r\n--{b}--\r\n".encode()
open(sys.argv[2], "wb").write(body)
open(sys.argv[3], "w").write(f"multipart/form-data; boundary={b}")
PY
  cat > "$WORK/$size.lua" <<LUA
wrk.method = "POST"
local f = io.open("$WORK/$size.body", "rb"); wrk.body = f:read("*a"); f:close()
wrk.headers["Content-Type"] = "$(cat "$WORK/$size.type")"
LUA
  for c in $CONNS; do
    read -r n0 d0 r0 q0 i0 p0 c0 < <(stages)
    cpu0=$(cpu_ticks)
    out=$(wrk -t 1 -c "$c" -d "${SECS}s" --timeout 20s --latency -s "$WORK/$size.lua" \
          "http://127.0.0.1:$PORT/v1/vision/detection")
    read -r n1 d1 r1 q1 i1 p1 c1 < <(stages)
    cpu1=$(cpu_ticks)
    rps=$(echo "$out" | awk '/Requests\/sec/ {print $2}')
    p50=$(echo "$out" | awk '$1 == "50%" {print $2}')
    p99=$(echo "$out" | awk '$1 == "99%" {print $2}')
    errors=$(echo "$out" | grep -E "Non-2xx|Socket errors" || true)
    awk -v s="$size" -v c="$c" -v rps="$rps" -v p50="$p50" -v p99="$p99" -v n="$((n1 - n0))" \
        -v d="$(awk -v a="$d1" -v b="$d0" 'BEGIN {print a - b}')" -v r="$(awk -v a="$r1" -v b="$r0" 'BEGIN {print a - b}')" \
        -v q="$(awk -v a="$q1" -v b="$q0" 'BEGIN {print a - b}')" -v i="$(awk -v a="$i1" -v b="$i0" 'BEGIN {print a - b}')" \
        -v p="$(awk -v a="$p1" -v b="$p0" 'BEGIN {print a - b}')" -v e="$errors" \
        -v sc="$(awk -v a="$c1" -v b="$c0" 'BEGIN {print a - b}')" \
        -v cpu="$(( (cpu1 - cpu0) * 1000 / $(getconf CLK_TCK) ))" 'BEGIN {
      if (n < 1) n = 1
      printf "%-10s %5s  %8s  %-9s %-9s | %13.2f %6.2f %6.2f %7.2f %6.2f | %5.2f | %5.2f %4.1f%% %s\n", s, c, rps,
             p50, p99, d * 1000 / n, r * 1000 / n, q * 1000 / n, i * 1000 / n, p * 1000 / n, cpu / n,
             sc * 1000 / n, (cpu > 0 ? 100 * sc * 1000 / cpu : 0), e }'
  done
done
if ! grep -q '"success":true' <(curl -s -F "image=@$WORK/640x480.jpg" "127.0.0.1:$PORT/v1/vision/detection"); then
  echo "warning: the detection answer was not successful"
fi
