#!/usr/bin/env bash
# Sets up what building and serving needs (scripts/setup.sh --serve: no test-only packages), builds
# the server alone and serves the example model repository.
#   scripts/serve.sh [extra `quern serve` flags]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
scripts/setup.sh --serve
cmake --preset release >/dev/null
cmake --build --preset release --target quern
exec build/release/src/cli/quern serve --model-repository examples/models "$@"
