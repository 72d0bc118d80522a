#!/usr/bin/env bash
# GPU host side: the torch site a release's stages put on the path (queue.sh passes it to stages.sh as
# TORCH_SITE): the carried torch's site when its torch is the one the release's vLLM pins, else nothing
# (the image's torch).
#   bash bench/device/torch_site.sh /tmp/site-0.20.0 [/tmp/torch-site]
# Why per release: install.sh puts a carried torch into one site for the whole machine, and a release
# on the image's torch must not import it. vLLM 0.20.0 (pins torch 2.11.0, the image's) run beside
# 0.34.0's torch 2.14.0 failed to import: its _C.abi3.so needs 2.11's
# c10::cuda::c10_cuda_check_implementation(int, char const*, char const*, unsigned int, bool), which
# 2.14 declares with a sixth parameter (bench/device/README.md).
set -uo pipefail
[ $# -ge 1 ] && [ -d "$1" ] || { echo "torch_site.sh: no release site '${1:-}' (usage: torch_site.sh RELEASE_SITE [TORCH_SITE])" >&2; exit 2; }
site=$1 torch_site=${2:-/tmp/torch-site}
pin=$(sed -n 's/^Requires-Dist: torch *== *\([^ ;,]*\).*/\1/p' "$site"/vllm-*.dist-info/METADATA 2>/dev/null | head -1)
held=$(for d in "$torch_site"/torch-*.dist-info; do [ -d "$d" ] && basename "$d" .dist-info; done | sed -n 's/^torch-//p' | head -1)
if [ -n "$pin" ] && [ "$pin" = "${held%%+*}" ]; then
  echo "$torch_site"
elif [ -n "$held" ]; then
  echo "torch_site.sh: $site pins torch ${pin:-none}, $torch_site holds $held: the image's torch" >&2
fi
exit 0
