#!/usr/bin/env bash
# The camera end to end: one frame in flight through POST /v1/vision/detection, against the raw
# runtime's best single-frame time measured right before it (engine_bench --raw-per-concurrency
# --submitters 1: raw ONNX Runtime's best layout for one request), for each frame size, ROUNDS
# times alternating. Prints the server's per-stage breakdown (decode, resize, queue, infer, post,
# from quern_vision_stage_seconds_total) and two ratios of raw to Quern's time per frame: decode
# counted on neither side (Quern's time per frame less its decode and resize) and on both (the raw
# run plus Quern's own decode and resize). The model is served pinned to ONNX Runtime, so that both
# sides run the same runtime.
#   bench/camera_e2e.sh [MODEL_DIR, default examples/models/objects] [seconds, default 8] [rounds, default 2]
#   QUERN_BENCH_VISION_PHOTO=... the photograph scaled to each size (default examples/data/dog.jpg)
#   QUERN_BENCH_VISION_SIZES="640x480 1920x1080 3840x2160"
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
MODEL_DIR="${1:-examples/models/objects}"
SECS="${2:-8}"
ROUNDS="${3:-2}"
PHOTO="${QUERN_BENCH_VISION_PHOTO:-examples/data/dog.jpg}"
SIZES="${QUERN_BENCH_VISION_SIZES:-640x480 1920x1080 3840x2160}"
command -v wrk >/dev/null || { echo "needs wrk: apt-get install wrk"; exit 1; }
# The server on every core, as raw's best single-frame layout runs (a wide session on both).
export QUERN_BENCH_SERVER_CPUS="${QUERN_BENCH_SERVER_CPUS:-0-$(($(nproc) - 1))}"
source bench/serve_lib.sh
source bench/vision_stages.sh
cmake --build --preset "$PRESET" --target engine_bench >/dev/null
NAME=$(basename "$MODEL_DIR")
mkdir -p "$WORK/repo"
cp -r "$MODEL_DIR" "$WORK/repo/$NAME"
sed -i -E 's/^(backend|platform)[[:space:]]*:.*$//' "$WORK/repo/$NAME/config.pbtxt"
echo 'backend: "onnxruntime"' >> "$WORK/repo/$NAME/config.pbtxt"
start_server "$WORK/repo" --detection-model "$NAME"
for size in $SIZES; do
  build/venv/bin/python - "$PHOTO" "$size" "$WORK/$size" <<'PY'
import io, sys
from PIL import Image
w, h = (int(v) for v in sys.argv[2].split("x"))
buf = io.BytesIO()
Image.open(sys.argv[1]).convert("RGB").resize((w, h), Image.LANCZOS).save(buf, "JPEG", quality=90)
b = "quernbenchboundary"
body = (f"--{b}\r\nContent-Disposition: form-data; name=\"image\"; filename=\"frame.jpg\"\r\n"
        f"Content-Type: image/jpeg\r\n\r\n").encode() + buf.getvalue() + f"\r\n--{b}--\r\n".encode()
open(sys.argv[3] + ".body", "wb").write(body)
PY
  cat > "$WORK/$size.lua" <<LUA
wrk.method = "POST"
local f = io.open("$WORK/$size.body", "rb"); wrk.body = f:read("*a"); f:close()
wrk.headers["Content-Type"] = "multipart/form-data; boundary=quernbenchboundary"
LUA
done
echo "$MODEL_DIR (ONNX Runtime), one frame in flight, $SECS s per run; ms per frame"
echo "round size       raw      quern   | decode resize  queue   infer   post  | raw/(quern-decode-resize)  (raw+decode+resize)/quern"
for ((r = 1; r <= ROUNDS; r++)); do
  for size in $SIZES; do
    raw_rate=$(build/$PRESET/bench/engine_bench --model "$MODEL_DIR/1/model.onnx" --seconds "$SECS" --warmup 2 \
      --max-batch 1 --submitters 1 --raw-per-concurrency 2>/dev/null | tail -1 | awk '{print $3}')
    read -r n0 d0 z0 q0 i0 p0 _ < <(vision_stages)
    out=$(wrk -t 1 -c 1 -d "${SECS}s" --timeout 20s -s "$WORK/$size.lua" "http://127.0.0.1:$PORT/v1/vision/detection")
    read -r n1 d1 z1 q1 i1 p1 _ < <(vision_stages)
    rps=$(echo "$out" | awk '/Requests\/sec/ {print $2}')
    awk -v r="$r" -v s="$size" -v raw="$raw_rate" -v rps="$rps" -v n="$n0 $n1" -v d="$d0 $d1" -v z="$z0 $z1" \
        -v q="$q0 $q1" -v i="$i0 $i1" -v p="$p0 $p1" 'function per(x,  a) { split(x, a, " "); return (a[2] - a[1]) * 1000 / cnt }
      BEGIN {
        split(n, c, " "); cnt = c[2] - c[1]; if (cnt < 1) cnt = 1
        rawms = 1000 / raw; qms = 1000 / rps
        dd = per(d); zz = per(z)
        printf "%5s %-10s %7.1f %7.1f   | %6.2f %6.2f %6.2f %7.2f %6.2f | %25.3f  %27.3f\n", r, s, rawms, qms, dd, zz,
               per(q), per(i), per(p), rawms / (qms - dd - zz), (rawms + dd + zz) / qms }'
  done
done
