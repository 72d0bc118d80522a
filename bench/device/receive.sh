#!/usr/bin/env bash
# GPU host side, once per part that arrived in this checkout's .gpu/BUNDLE/pN: copy part N of BUNDLE into
# /tmp/vw/BUNDLE/, and once every part is there, mark the bundle complete (queue.sh waits for that mark
# before it installs).
#   bash bench/device/receive.sh vllm-0.34.0 3
# Run it once per part, one at a time, so a part copied earlier is whole when a later run looks.
set -euo pipefail
bundle=${1:?bundle} part=${2:?part number}
dir=${W:-/tmp/vw}/$bundle
mkdir -p "$dir"
cp ".gpu/$bundle/p$part"/* "$dir/"
if [ -f "$dir/$bundle.parts" ]; then
  missing=$(for i in $(seq -f %02g 1 "$(cat "$dir/$bundle.parts")"); do [ -f "$dir/$bundle.tar.$i" ] || echo -n "$i "; done)
  if [ -z "$missing" ]; then touch "$dir/.complete"; echo "$bundle: every part here"; else echo "$bundle: parts still missing: $missing"; fi
fi
