# Sourced by the benchmarks that load one `quern serve`
# (deadline_bench.sh, latency_target_bench.sh, request_cost.sh, grpc_bench.sh,
# overload_bench.sh, camera_e2e.sh). Generates the benchmark
# models, builds `quern` with QUERN_BENCH_PRESET (default release), and sets:
#   SERVER_CPUS, CLIENT_CPUS   QUERN_BENCH_SERVER_CPUS (default CPU 0) and
#                              QUERN_BENCH_CLIENT_CPUS (default the others)
#   PRESET, QUERN              the build and its binary
#   WORK                       a temporary folder, removed on exit
#   PORT, GRPC_PORT, METRICS_PORT   free ports on 127.0.0.1
# start_server REPO [FLAGS...] starts the server on SERVER_CPUS (SERVER is its
# pid, its log $WORK/log) and waits until it serves, with the flags of
# QUERN_BENCH_SERVE_ARGS after its own; stop_server stops it.
NCPU=$(nproc)
SERVER_CPUS="${QUERN_BENCH_SERVER_CPUS:-0}"
CLIENT_CPUS="${QUERN_BENCH_CLIENT_CPUS:-1-$((NCPU - 1))}"
if [ "$NCPU" -lt 2 ]; then SERVER_CPUS=0; CLIENT_CPUS=0; fi
build/venv/bin/python scripts/gen_models.py --bench bench/models --quiet
PRESET="${QUERN_BENCH_PRESET:-release}"
cmake --preset "$PRESET" >/dev/null
cmake --build --preset "$PRESET" --target quern >/dev/null
QUERN="build/$PRESET/src/cli/quern"
WORK=$(mktemp -d)
SERVER=""
trap 'kill $SERVER 2>/dev/null || true; rm -rf "$WORK"' EXIT
ulimit -n 65536 2>/dev/null || ulimit -n "$(ulimit -Hn)"  # open loops: a connection per request in flight
# free_ports N: N free TCP ports on 127.0.0.1, on one line.
free_ports() {
  build/venv/bin/python -c '
import socket, sys
s = [socket.socket() for _ in range(int(sys.argv[1]))]
for x in s: x.bind(("127.0.0.1", 0))
print(*[x.getsockname()[1] for x in s])' "$1"
}
read -r PORT GRPC_PORT METRICS_PORT <<< "$(free_ports 3)"

start_server() {
  local repo="$1"
  shift
  # shellcheck disable=SC2086
  taskset -c "$SERVER_CPUS" "$QUERN" serve --model-repository "$repo" "$@" ${QUERN_BENCH_SERVE_ARGS:-} --http-port "$PORT" \
    --grpc-port "$GRPC_PORT" --metrics-port "$METRICS_PORT" --host 127.0.0.1 > "$WORK/log" 2>&1 &
  SERVER=$!
  for _ in $(seq 150); do grep -q "metrics listening" "$WORK/log" && return; sleep 0.2; done
  echo "quern did not start:"; cat "$WORK/log"; exit 1
}
# proto_url http|grpc|stream [HTTP_PORT GRPC_PORT]: sets url and extra (quern perf's flags) to reach
# the server's port for it (default: PORT and GRPC_PORT).
proto_url() {
  local http_port="${2:-$PORT}" grpc_port="${3:-$GRPC_PORT}"
  case "$1" in
    http) url="http://127.0.0.1:$http_port" extra="" ;;
    grpc) url="grpc://127.0.0.1:$grpc_port" extra="" ;;
    stream) url="grpc://127.0.0.1:$grpc_port" extra="--grpc-stream" ;;
  esac
}
stop_server() {
  kill "$SERVER" 2>/dev/null || true
  wait "$SERVER" 2>/dev/null || true
}
