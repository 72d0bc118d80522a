#!/usr/bin/env bash
# GPU host side: join and install the bundles bench/device/prepare.py made, once every part of each has
# been copied into /tmp/vw/<bundle>/ (receive.sh, once a part).
#   bash bench/device/install.sh torch-2.14.0 vllm-0.34.0 [triton-2.14.0] [ray]
# Where things go (stages.sh reads the same variables):
#   torch-T, triton-T -> $TORCH_SITE (/tmp/torch-site): a torch other than the image's, its NCCL, torchvision
#   vllm-R            -> $SITE (/tmp/site-R): vLLM and the requirements the image lacks, with datasets
#                        (--format speculators-0.5); speculators into $SPEC_ROOT/<version> (/tmp/vcache/speculators):
#                        0.3.0 and 0.4.0 alone, 0.9.0 with what it needs beyond the site and the image, stamped
#                        as scripts/vllm_venv.py --speculators-only 0.9.0 --with-requirements-of "$(which python3)"
#                        stamps it, so the tests that ask for that folder find it ready (no index here)
#   ray               -> $RAY_SITE (/tmp/ray-site)
set -euo pipefail
W=${W:-/tmp/vw}
TORCH_SITE=${TORCH_SITE:-/tmp/torch-site}
SPEC_ROOT=${SPEC_ROOT:-/tmp/vcache/speculators}
RAY_SITE=${RAY_SITE:-/tmp/ray-site}
pip_into() { local dest=$1; shift; python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$dest" "$@" 2>&1 | grep -v -e WARNING -e "^ *$" || true; }
for name in "$@"; do
  dir=$W/$name
  [ -f "$dir/$name.parts" ] || { echo "MISSING $dir/$name.parts (the last part of $name was not copied)"; exit 2; }
  count=$(cat "$dir/$name.parts")
  for i in $(seq -f %02g 1 "$count"); do [ -f "$dir/$name.tar.$i" ] || { echo "MISSING $dir/$name.tar.$i"; exit 2; }; done
  cat "$dir/$name".tar.[0-9][0-9] > "$dir/$name.tar"
  echo "$(cat "$dir/$name.sha256")  $dir/$name.tar" | sha256sum -c - >/dev/null
  rm -f "$dir/$name".tar.[0-9][0-9]
  rm -rf "$dir/x" && mkdir -p "$dir/x" && tar xf "$dir/$name.tar" -C "$dir/x" && rm -f "$dir/$name.tar"
  case "$name" in
    torch-*|triton-*) pip_into "$TORCH_SITE" "$dir"/x/wheels/*.whl; echo "$name -> $TORCH_SITE" ;;
    ray) pip_into "$RAY_SITE" "$dir"/x/wheels/*.whl; echo "ray -> $RAY_SITE" ;;
    vllm-*)
      site=${SITE:-/tmp/site-${name#vllm-}}
      rm -rf "$site" && mkdir -p "$site"
      pip_into "$site" "$dir"/x/wheels/*.whl
      # pip --target runs no .pth file, a site directory does: nvidia-cutlass-dsl puts its packages on
      # the path with one, which vLLM's warm-up imports (0.34.0: `No module named 'cutlass'` without it)
      printf 'import os, site\nsite.addsitedir(os.path.dirname(os.path.abspath(__file__)))\n' > "$site/sitecustomize.py"
      for wheel in "$dir"/x/speculators/*.whl; do
        version=$(basename "$wheel" | cut -d- -f2)
        [ -f "$SPEC_ROOT/$version/.complete" ] && continue
        rm -rf "${SPEC_ROOT:?}/$version" && pip_into "$SPEC_ROOT/$version" "$wheel" && echo "$version" > "$SPEC_ROOT/$version/.complete"
      done
      # the stamp's key: the version and the interpreter whose requirements the folder completes
      # (the tests pass their sys.executable: python3 -m pytest's, this python3's)
      for folder in "$dir"/x/speculators-with-requirements/*/; do
        [ -d "$folder" ] || continue
        version=$(basename "$folder"); key="$version $(python3 -c 'import sys; print(sys.executable)')"
        [ "$(cat "$SPEC_ROOT/$version/.complete" 2>/dev/null)" = "$key" ] && continue
        rm -rf "${SPEC_ROOT:?}/$version" && pip_into "$SPEC_ROOT/$version" "$folder"*.whl && echo "$key" > "$SPEC_ROOT/$version/.complete"
      done
      # datasets runs on the image's pyarrow, pandas and fsspec: say their versions (an import error here
      # means --format speculators-0.5 cannot write its index)
      PYTHONPATH=$site python3 -c "import datasets, pyarrow, fsspec; print('datasets', datasets.__version__, 'pyarrow', pyarrow.__version__, 'fsspec', fsspec.__version__)" 2>&1 | tail -1 || true
      echo "$name -> $site ($(du -sh "$site" | cut -f1))" ;;
    *) echo "unknown bundle $name"; exit 2 ;;
  esac
  rm -rf "$dir/x"
done
