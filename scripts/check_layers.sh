#!/usr/bin/env bash
# Checks that every include in src/ points inwards: each folder of src/ may
# include only the folders listed for it below (and the public API,
# include/quern/), so the core never learns about the edges.
#
#   core < image, protocol, scheduler, metrics < engine < backends, pipeline
#        < store < auth < frontends < server < cli, embed
#
# Besides: frontends/http/kserve_handler.h (the KServe REST handler) is for
# frontends/http and the server that wires it, not for other front ends
# (their HTTP helpers are in frontends/http/http_util.h).
#
# KNOWN lists the wrong-way includes left to mend, each as "file include":
# one there no longer is, or a new one, fails the check.
#   scripts/check_layers.sh              # checks src/
#   scripts/check_layers.sh --self-test  # shows that a wrong-way include fails it
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

declare -A ALLOWED=(
  [core]="core"
  [image]="core image"
  [protocol]="core protocol"
  [scheduler]="core scheduler"
  [metrics]="core metrics"
  [engine]="core scheduler engine"
  [backends]="core image scheduler metrics engine backends"
  [pipeline]="core image metrics pipeline"
  [store]="core image protocol metrics pipeline store"
  [auth]="core auth"
  [frontends]="core image protocol metrics pipeline store auth frontends"
  [server]="core image protocol scheduler metrics engine backends pipeline store auth frontends server"
  [python]="core python"
  [tools]="core tools"
  [cli]="core image protocol scheduler metrics engine backends pipeline store auth frontends server cli"
  [embed]="core image protocol scheduler metrics engine backends pipeline store auth frontends server embed"
)
# Wrong-way includes not mended yet.
KNOWN=()

# check SRC_DIR: prints each wrong-way include; fails if there is one.
check() {
  local src=$1 bad=0 file folder inc target found known
  declare -A seen_known=()
  while IFS= read -r line; do
    file=${line%%:*}
    inc=$(sed -E 's/^[^:]*:[0-9]+:[[:space:]]*#include "([^"]+)".*/\1/' <<<"$line")
    [[ $inc == */* ]] || continue  # a header beside the file
    target=${inc%%/*}
    folder=${file#"$src"/}
    folder=${folder%%/*}
    [ "$target" = quern ] && continue  # the public API
    local rel="src/${file#"$src"/}"
    known=0
    for k in "${KNOWN[@]}"; do
      if [ "$k" = "$rel $inc" ]; then known=1; seen_known[$k]=1; fi
    done
    [ $known = 1 ] && continue
    if [ -z "${ALLOWED[$folder]+x}" ]; then
      echo "check_layers: $rel: folder src/$folder has no layer in scripts/check_layers.sh" >&2
      bad=1
      continue
    fi
    found=0
    for a in ${ALLOWED[$folder]}; do [ "$a" = "$target" ] && found=1; done
    if [ $found = 0 ]; then
      echo "check_layers: ${line#"$src"/} -- src/$folder may include only: ${ALLOWED[$folder]} (and quern/)" >&2
      bad=1
    elif [ "$inc" = frontends/http/kserve_handler.h ] && [[ $rel != src/frontends/http/* ]] &&
         [[ $rel != src/server/* ]]; then
      echo "check_layers: ${line#"$src"/} -- the KServe handler is for frontends/http and the server;" \
           "HTTP helpers are in frontends/http/http_util.h" >&2
      bad=1
    fi
  done < <(grep -rnE '^[[:space:]]*#include "' "$src" --include='*.h' --include='*.cc' --include='*.in' || true)
  for k in "${KNOWN[@]}"; do
    if [ -z "${seen_known[$k]+x}" ]; then
      echo "check_layers: '$k' is mended: take it out of KNOWN in scripts/check_layers.sh" >&2
      bad=1
    fi
  done
  return $bad
}

if [ "${1:-}" = --self-test ]; then
  scratch=$(mktemp -d)
  trap 'rm -rf "$scratch"' EXIT
  cp -r "$ROOT/src" "$scratch/src"
  check "$scratch/src" || { echo "check_layers --self-test: the tree as it is fails" >&2; exit 1; }
  printf '#include "frontends/http/http_server.h"\n' >> "$scratch/src/core/status.cc"
  if check "$scratch/src" 2>/dev/null; then
    echo "check_layers --self-test: core including a front end was not caught" >&2
    exit 1
  fi
  cp "$ROOT/src/core/status.cc" "$scratch/src/core/status.cc"
  printf '#include "frontends/http/kserve_handler.h"\n' >> "$scratch/src/frontends/jobs/job_handler.cc"
  if check "$scratch/src" 2>/dev/null; then
    echo "check_layers --self-test: a front end including the KServe handler was not caught" >&2
    exit 1
  fi
  echo "check_layers --self-test: wrong-way includes are caught"
  exit 0
fi
check "$ROOT/src" && echo "check_layers: every include in src/ points inwards"
