# Sourced by the vision benchmarks (vision_bench.sh, camera_e2e.sh).
# vision_stages [METRICS_PORT]: the vision pipeline's timed images and its stage sums in seconds
# (decode resize queue infer post), and the stages' CPU seconds, on one line.
vision_stages() {
  curl -s "127.0.0.1:${1:-$METRICS_PORT}/metrics" | awk '
    /^quern_vision_timed_images_total / {n = $2}
    /^quern_vision_stage_seconds_total/ {split($1, a, "\""); s[a[2]] = $2}
    /^quern_vision_stage_cpu_seconds_total/ {c += $2}
    END {printf "%s %s %s %s %s %s %s\n", n, s["decode"] + 0, s["resize"] + 0, s["queue"] + 0, s["infer"] + 0,
         s["post"] + 0, c + 0}'
}
