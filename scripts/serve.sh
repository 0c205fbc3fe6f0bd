#!/usr/bin/env bash
# Sets up what building and serving needs (scripts/setup.sh --serve: no test-only packages), builds
# the server alone and serves the example model repository.
#   scripts/serve.sh [extra `quern serve` flags]
# objects_fast (NanoDet-m) needs a 144 MB download that --serve leaves out: until a full
# scripts/setup.sh has fetched it, every other example is served (from build/serve-models, a
# folder of links to them).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
scripts/setup.sh --serve
cmake --preset release >/dev/null
cmake --build --preset release --target quern
repo=(--model-repository examples/models)
if [ ! -f examples/models/objects_fast/1/model.onnx ]; then
  rm -rf build/serve-models
  mkdir -p build/serve-models
  for m in examples/models/*/; do
    m=$(basename "$m")
    [ "$m" = objects_fast ] || ln -s "$ROOT/examples/models/$m" "build/serve-models/$m"
  done
  repo=(--model-repository build/serve-models --allow-links-outside-repository)
fi
exec build/release/src/cli/quern serve "${repo[@]}" "$@"
