#!/usr/bin/env bash
# Device side: reassemble the parts prepared by bench/device/prepare.py and install into /tmp/site.
# Each of three calls copies its carried part into /tmp/vw (`cp -r .gpu/pN/. /tmp/vw/`); the call
# that has all parts runs this. /tmp survives between calls while the machine stays warm.
set -euo pipefail
W=${1:-/tmp/vw}
SITE=${SITE:-/tmp/site}
SPEC=${SPEC:-/tmp/vcache/speculators}
BUILD_SITE=${BUILD_SITE:-/tmp/build-site}
cd "$W"
for i in 0 1 2; do [ -f "vllm.tar.xz.$i" ] || [ "$i" = 2 ] || { echo "MISSING $W/vllm.tar.xz.$i"; exit 2; }; done
cat vllm.tar.xz.[0-9] > vllm.tar.xz  # the parts, not the .sha256 beside them
echo "$(cat vllm.tar.xz.sha256)  vllm.tar.xz" | sha256sum -c -
rm -rf "$SITE" && mkdir -p "$SITE"
tar xJf vllm.tar.xz -C "$SITE"
python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" wheels/*.whl
# compressed-tensors 0.17 builds the INT4 checkpoint (stages.sh kimi-int4); vLLM keeps its pinned 0.15
rm -rf "$BUILD_SITE" && python3 -m pip install -q --no-index --no-deps --no-compile --target "$BUILD_SITE" build-only/*.whl
for wheel in speculators/*.whl; do
  version=$(basename "$wheel" | cut -d- -f2)
  rm -rf "$SPEC/$version" && python3 -m pip install -q --no-index --no-deps --no-compile --target "$SPEC/$version" "$wheel"
  echo "$version" > "$SPEC/$version/.complete"
done
# Ray (prepare.py --ray; the data-parallel stage): its two parts, when carried, into $RAY_SITE
RAY_SITE=${RAY_SITE:-/tmp/ray-site}
if [ -f ray.whl.0 ] && [ -f ray.whl.1 ]; then
  wheel=$(cat ray.whl.name)
  cat ray.whl.0 ray.whl.1 > "$wheel"
  echo "$(cat ray.whl.sha256)  $wheel" | sha256sum -c -
  rm -rf "$RAY_SITE" && python3 -m pip install -q --no-index --no-deps --no-compile --target "$RAY_SITE" "$wheel" msgpack-*.whl
fi
echo "installed into $SITE: $(du -sh "$SITE" | cut -f1)"
