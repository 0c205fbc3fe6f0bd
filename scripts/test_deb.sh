#!/usr/bin/env bash
# Builds the Debian package of a build (cpack -G DEB), installs it with dpkg on
# this machine, starts the binary the way its systemd unit does (as the user
# quern, with /etc/quern/quern.toml, ready when systemd would be told so),
# serves a request from /var/lib/quern/models, and removes and purges the
# package, checking that its files are gone. Needs root (or sudo).
#   scripts/test_deb.sh [build dir, default build/ci]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
BUILD="${1:-$ROOT/build/ci}"
MODELS="${QUERN_TEST_MODELS:-$BUILD/test_models}"
sudo=""
[ "$(id -u)" = 0 ] || sudo="sudo"
if dpkg -s quern >/dev/null 2>&1; then
  echo "test_deb: a quern package is installed already; not touching it" >&2
  exit 1
fi
WORK="$(mktemp -d /tmp/quern-deb-XXXXXX)"
chmod 755 "$WORK"
server=""
cleanup() {
  [ -n "$server" ] && $sudo kill "$server" 2>/dev/null || true
  dpkg -s quern-pytorch >/dev/null 2>&1 && $sudo dpkg --purge quern-pytorch >/dev/null 2>&1 || true
  dpkg -s quern >/dev/null 2>&1 && $sudo dpkg --purge quern >/dev/null 2>&1 || true
  $sudo rm -rf /var/lib/quern/models/add_sub /var/lib/quern/models/add_sub_ov /var/lib/quern/models/pair
  rm -rf "$WORK"
}
trap cleanup EXIT

echo "== cpack -G DEB"
(cd "$BUILD" && cpack -G DEB -B "$WORK" >/dev/null)
deb=$(ls "$WORK"/quern_*.deb)
echo "== dpkg -i $(basename "$deb")"
$sudo dpkg -i "$deb" >/dev/null
for f in /usr/bin/quern /usr/bin/quern-perf /usr/bin/quern-quantize /usr/lib/libquern.so.0 /usr/lib/quern/libonnxruntime.so.1 \
         /usr/lib/systemd/system/quern.service /etc/quern/quern.toml /usr/include/quern/engine.h \
         /usr/share/doc/quern/copyright /usr/share/doc/quern/LICENSE /usr/share/doc/quern/NOTICE \
         /usr/share/doc/quern/onnxruntime/LICENSE /usr/share/doc/quern/onnxruntime/ThirdPartyNotices.txt; do
  [ -e "$f" ] || { echo "test_deb: $f is missing after installing" >&2; exit 1; }
done
grep -q '^License: Apache-2.0$' /usr/share/doc/quern/copyright &&
  grep -q '^Files: usr/lib/quern/libonnxruntime.so' /usr/share/doc/quern/copyright ||
  { echo "test_deb: the copyright file does not state the licences" >&2; exit 1; }
getent passwd quern >/dev/null || { echo "test_deb: no user quern" >&2; exit 1; }
[ "$(stat -c %U /var/lib/quern/models)" = quern ] || { echo "test_deb: /var/lib/quern/models is not quern's" >&2; exit 1; }
# Registered faces survive a restart, and nothing listens beyond this machine until keys are set.
[ "$(stat -c %U /var/lib/quern/data)" = quern ] || { echo "test_deb: /var/lib/quern/data is not quern's" >&2; exit 1; }
grep -qx 'data-dir = "/var/lib/quern/data"' /etc/quern/quern.toml || { echo "test_deb: no data-dir in the settings" >&2; exit 1; }
grep -qx 'host = "127.0.0.1"' /etc/quern/quern.toml || { echo "test_deb: the settings listen beyond this machine" >&2; exit 1; }

# OpenVINO, where the build found it: its plugin and runtime in the package, serving add_sub_ov.
openvino=0
if [ -f "$BUILD/src/backends/libquern_openvino.so" ]; then
  openvino=1
  for f in /usr/lib/quern/libquern_openvino.so /usr/lib/quern/openvino/libopenvino_intel_cpu_plugin.so \
           /usr/lib/quern/openvino/libtbb.so.12 /usr/share/doc/quern/openvino/LICENSE; do
    [ -e "$f" ] || { echo "test_deb: $f is missing after installing (OpenVINO)" >&2; exit 1; }
  done
  grep -q '^Files: usr/lib/quern/openvino/\*' /usr/share/doc/quern/copyright ||
    { echo "test_deb: the copyright file does not state OpenVINO's licence" >&2; exit 1; }
  $sudo cp -r "$MODELS/add_sub" /var/lib/quern/models/add_sub_ov
  printf 'backend: "openvino"\n' | $sudo tee /var/lib/quern/models/add_sub_ov/config.pbtxt >/dev/null
  $sudo chown -R quern:quern /var/lib/quern/models/add_sub_ov
fi

torch=0
if [ -f "$BUILD/src/backends/libquern_pytorch.so" ]; then
  torch=1
  echo "== quern-pytorch (scripts/build_pytorch_deb.sh): the LibTorch plugin as a package of its own"
  ! dpkg -s quern-pytorch >/dev/null 2>&1 || { echo "test_deb: quern-pytorch is installed already" >&2; exit 1; }
  ptdeb=$(scripts/build_pytorch_deb.sh "$BUILD" "$WORK")
  control=$(dpkg -I "$ptdeb")
  grep -q "Depends: quern (= .*libtorch" <<<"$control" || { echo "test_deb: $control" >&2; exit 1; }
  $sudo dpkg -i "$ptdeb" >/dev/null
  [ -f /usr/lib/quern/libquern_pytorch.so ] || { echo "test_deb: no plugin after installing quern-pytorch" >&2; exit 1; }
  /usr/bin/python3 tests/python/make_torch_models.py "$WORK/pt" >/dev/null
  $sudo cp -r "$WORK/pt/pair" /var/lib/quern/models/
  $sudo chown -R quern:quern /var/lib/quern/models/pair
fi

echo "== starting quern as quern.service does (ExecStart, User=quern), a model in /var/lib/quern/models"
$sudo cp -r "$MODELS/add_sub" /var/lib/quern/models/
$sudo chown -R quern:quern /var/lib/quern/models/add_sub
exec_start=$(sed -n 's/^ExecStart=//p' /usr/lib/systemd/system/quern.service)
user=$(sed -n 's/^User=//p' /usr/lib/systemd/system/quern.service)
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
notify="$WORK/notify"
# systemd's side of Type=notify: a datagram socket the service writes READY=1 to.
python3 - "$notify" > "$WORK/ready" <<'PY' &
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
s.bind(sys.argv[1])
import os; os.chmod(sys.argv[1], 0o777)
s.settimeout(120)
print(s.recv(4096).decode(), flush=True)
PY
listener=$!
for _ in $(seq 50); do [ -S "$notify" ] && break; sleep 0.1; done
# The configured ports (8000-8002) may be taken on a test machine: the flags move them.
$sudo env NOTIFY_SOCKET="$notify" runuser -u "$user" -- $exec_start --http-port "$port" --grpc-port -1 --metrics-port 0 \
  > "$WORK/log" 2>&1 &
server=$!
wait "$listener" || { echo "test_deb: the server never said it was ready"; cat "$WORK/log"; exit 1; } >&2
grep -q "READY=1" "$WORK/ready" || { echo "test_deb: readiness message: $(cat "$WORK/ready")" >&2; exit 1; }
answer=$(curl -s "127.0.0.1:$port/v2/models/add_sub/infer" -d '{"inputs": [
  {"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]},
  {"name": "INPUT1", "shape": [1, 4], "datatype": "FP32", "data": [10, 20, 30, 40]}]}')
echo "$answer" | grep -q '"data":\[11.0,22.0,33.0,44.0\]' || { echo "test_deb: answer $answer" >&2; exit 1; }
if [ "$openvino" = 1 ]; then
  answer=$(curl -s "127.0.0.1:$port/v2/models/add_sub_ov/infer" -d '{"inputs": [
    {"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]},
    {"name": "INPUT1", "shape": [1, 4], "datatype": "FP32", "data": [10, 20, 30, 40]}]}')
  echo "$answer" | grep -q '"data":\[11.0,22.0,33.0,44.0\]' ||
    { echo "test_deb: add_sub_ov answered $answer" >&2; cat "$WORK/log" >&2; exit 1; }
  grep -q "OpenVINO plugin /usr/lib/quern/libquern_openvino.so" "$WORK/log" ||
    { echo "test_deb: the packaged OpenVINO plugin was not the one loaded:" >&2; cat "$WORK/log" >&2; exit 1; }
fi
if [ "$torch" = 1 ]; then
  answer=$(curl -s "127.0.0.1:$port/v2/models/pair/infer" -d '{"inputs":[
    {"name":"a","datatype":"FP32","shape":[1,2],"data":[0.5,-1.5]},
    {"name":"b","datatype":"INT64","shape":[1,2],"data":[1,2]}]}')
  case "$answer" in
    *'"data":[1.5,0.5]'*'"data":[3,6]'*) ;;
    *) echo "test_deb: pair answered $answer" >&2; cat "$WORK/log" >&2; exit 1 ;;
  esac
  grep -q "LibTorch plugin /usr/lib/quern/libquern_pytorch.so" "$WORK/log" ||
    { echo "test_deb: the packaged plugin was not the one loaded:" >&2; cat "$WORK/log" >&2; exit 1; }
fi
pgrep -x -u quern quern >/dev/null || { echo "test_deb: no quern process runs as the user quern" >&2; exit 1; }
$sudo kill "$server"
wait "$server" 2>/dev/null || true
server=""
for _ in $(seq 100); do pgrep -x -u quern quern >/dev/null || break; sleep 0.1; done
! pgrep -x -u quern quern >/dev/null || { echo "test_deb: the server outlived SIGTERM" >&2; exit 1; }

echo "== dpkg -r and --purge"
$sudo rm -rf /var/lib/quern/models/add_sub /var/lib/quern/models/add_sub_ov /var/lib/quern/models/pair
if [ "$torch" = 1 ]; then
  ! $sudo dpkg -r quern >/dev/null 2>&1 || { echo "test_deb: quern was removed while quern-pytorch needs it" >&2; exit 1; }
  $sudo dpkg -r quern-pytorch >/dev/null
  [ ! -e /usr/lib/quern/libquern_pytorch.so ] || { echo "test_deb: the plugin outlived dpkg -r quern-pytorch" >&2; exit 1; }
fi
$sudo dpkg -r quern >/dev/null
for f in /usr/bin/quern /usr/bin/quern-perf /usr/bin/quern-quantize /usr/lib/libquern.so.0 /usr/lib/quern /usr/lib/systemd/system/quern.service \
         /usr/include/quern; do
  [ ! -e "$f" ] || { echo "test_deb: $f is still there after dpkg -r" >&2; exit 1; }
done
[ -e /etc/quern/quern.toml ] || { echo "test_deb: dpkg -r removed the settings (only --purge should)" >&2; exit 1; }
$sudo dpkg --purge quern >/dev/null
[ ! -e /etc/quern ] || { echo "test_deb: /etc/quern is still there after --purge" >&2; exit 1; }
echo "== the package installs, serves and goes cleanly"
