#!/usr/bin/env bash
# GPU host side, in the background: install bundles and run stages one after another, so that copying
# the next bundle's parts (receive.sh) overlaps the GPU work of the one before.
#   bash bench/device/queue.sh torch-2.14.0 vllm-0.34.0 0.34.0:release-quick vllm-0.33.0 0.33.0:release-quick
# returns at once; the queue runs from its own copy of this checkout (/tmp/repo: the checkout may change
# under it), logs to /tmp/queue.log, and each stage writes /tmp/out/R-STAGE/.
#   OUT=DIR bash bench/device/queue.sh --harvest   # at any time: the log's tail, /tmp/out as DIR/out.tgz
# Items, each lane in the order given:
#   torch-T, vllm-R   install lane: wait for receive.sh's mark that every part is here, then install.sh
#   8b                GPU lane: the Llama-3-8B-shaped checkpoint into /tmp/models/llama3-8b (the image's torch)
#   R:STAGE           GPU lane: once vllm-R is installed, stages.sh STAGE (SITE=/tmp/site-R; TORCH_SITE=/tmp/torch-site
#                     where the torch there is the one R pins: torch_site.sh)
#   //                the GPU items after it form another GPU lane, run beside the others (the tiny-model
#                     suites take 0.02 of the GPU's memory: several fit beside an 8B stage)
#   VAR=VALUE         sets VAR for the items after it in its lane (e.g. K=... before R:release-tiny;
#                     TAG=...: the stage's folder is /tmp/out/R-STAGE-TAG)
# The environment passes through (DEADLINE, K, VLLM_* ...).
set -uo pipefail
W=${W:-/tmp/vw}
if [ "${1:-}" = "--harvest" ]; then
  tail -n "${TAIL:-25}" /tmp/queue.log
  tar czf "${OUT:?}/out.tgz" -C /tmp out queue.log 2>/dev/null
  exit 0
fi
if [ -z "${QUEUE_CHILD:-}" ]; then
  rm -rf /tmp/repo && mkdir -p /tmp/repo /tmp/out
  tar cf - --exclude=./.gpu --exclude=./.cache --exclude=./.git . | tar xf - -C /tmp/repo
  # two lanes: bundles install one after another on the CPUs while the GPU lane runs its stages in order
  installs=() gpu1=() gpu2=() gpu3=() gpu4=() lane=1
  for item in "$@"; do
    case "$item" in
      *=*) declare -n items=gpu$lane; items+=("$item") ;;
      torch-*|vllm-*|triton-*|ray) installs+=("$item") ;;
      //) lane=$((lane + 1)); [ $lane -le 4 ] || { echo "queue.sh: at most 4 GPU lanes" >&2; exit 2; } ;;
      *) declare -n items=gpu$lane; items+=("$item") ;;
    esac
  done
  cd /tmp/repo
  started=""
  for name in installs gpu1 gpu2 gpu3 gpu4; do
    declare -n items=$name
    [ ${#items[@]} -gt 0 ] || continue
    QUEUE_CHILD=$name setsid nohup bash bench/device/queue.sh "${items[@]}" >> /tmp/queue.log 2>&1 < /dev/null &
    started+="$name: ${items[*]}; "
  done
  echo "queue started: $started"
  exit 0
fi
say() { echo "[$QUEUE_CHILD $(date +%H:%M:%S)] $*"; }
for item in "$@"; do
  case "$item" in
    *=*) export "$item"; say "set $item" ;;
    *:*)
      release=${item%%:*} stage=${item#*:}
      until [ -f "$W/vllm-$release/.installed" ] || [ -f "$W/vllm-$release/.failed" ]; do sleep 2; done
      [ -f "$W/vllm-$release/.installed" ] || { say "SKIPPED $item: vLLM $release did not install"; continue; }
      # the carried torch only for a release that pins it: a release on the image's torch that found
      # another torch on its path failed to import (torch_site.sh says why)
      torch_site=$(bash bench/device/torch_site.sh "/tmp/site-$release" /tmp/torch-site)
      say "start $item"
      out=$release-$stage${TAG:+-$TAG}  # TAG=...: two lanes running one stage keep apart
      OUT=/tmp/out/$out SITE=/tmp/site-$release TORCH_SITE=$torch_site bash bench/device/stages.sh "$stage" 2>&1 \
        | tee "/tmp/out/$out.log" | grep -E "^## |RESULT|SKIPPED|FAILED|passed|failed|Error" | cut -c1-600
      say "done $item" ;;
    8b)
      say "build the 8B checkpoint"
      python3 bench/gpu.py build --family llama3-8b --path /tmp/models/llama3-8b --results /tmp/out/build.jsonl 2>&1 | grep -E "RESULT|Error" | cut -c1-300 ;;
    *)
      say "waiting for every part of $item"
      until [ -f "$W/$item/.complete" ]; do sleep 2; done
      say "install $item"
      if bash bench/device/install.sh "$item"; then touch "$W/$item/.installed"; else touch "$W/$item/.failed"; say "INSTALL FAILED: $item"; fi ;;
  esac
done
say "lane finished"
