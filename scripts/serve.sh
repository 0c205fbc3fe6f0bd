#!/usr/bin/env bash
# Sets up, builds and serves the example model repository.
#   scripts/serve.sh [extra `quern serve` flags]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
scripts/setup.sh
cmake --preset release >/dev/null
cmake --build --preset release --target quern
exec build/release/src/cli/quern serve --model-repository examples/models "$@"
