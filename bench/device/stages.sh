#!/usr/bin/env bash
# One benchmark stage on a CUDA host: installs this checkout next to the vLLM release in $SITE (unless
# DRY_RUN / NO_INSTALL), then runs the stage's steps, each under `timeout`, skipping a step that would not
# fit before DEADLINE. What each stage measures and the figure it feeds: bench/README.md; the bundled
# workflow for a host without network: bench/device/README.md.
#   SITE=DIR [TORCH_SITE=DIR] [M8=MODEL] [SPEC=DIR] [OUT=DIR] bash bench/device/stages.sh STAGE
# Stages (Llama-3-8B shape unless said; every one builds the checkpoint into $M8 first if absent):
#   build                         the 8B checkpoint, and the host copy bench (CPU)
#   backends-vs-prefill           vllm-engine b8/b32 (+ check vs HF), eager prefill, 4 writer threads, speculators b8
#   backends-vs-compiled-prefill  compiled prefill, vllm-native b8/b32 (+ check), speculators b32, vLLM's native path
#   steps-vs-prefill              the eager prefill, vllm-engine b32 (+ check) and b8, step by step (bench/steps.py)
#   native-formats-steps          vLLM's native path alone, vllm-native b8 in both formats, step by step
#   native-store-shm-vs-disk      vLLM's native path alone, vllm-native b8 with vLLM's files in /dev/shm and on disk
#   native-path-shm-one-writer    the native path alone in /dev/shm, vllm-native b8 with one writer thread
#   native-vs-native-path         vllm-native against vLLM's native path alone, alternating, twice each
#   overlap                       overlapped batches against --no-overlap, b8/b32; eager and compiled prefill
#   parent-copy-threads           the speculators generator's parent copy threads: default cap, off, 16
#   generator-host-memory         the speculators generator with and without the freed host memory kept
#   generator-timeline            where the speculators generator's time goes (bench/timeline.py)
#   generator-sweep               the generator over batch sizes and lengths, vllm-native, the writer alone
#   generator-token-budget        the generator under larger scheduler token budgets
#   baselines                     vLLM prefill, HF, vLLM's native path, the generator without the transport
#   extract-8b-roofline           the matmul roofline, the extractor b32 over 256 x 2048, its check
#   forward-check                 the extractor's preflight forward check: its share of a run, per kernel
#   fork-safety                   CUDA in a child forked after apply(); vllm-native on CUDA and its check
#   certificates                  certificates off/on alternating (bench/certificates.py), then verify
#   certificates-steps            the same off/on step by step, then the certified run under py-spy (PYSPY)
#   certificates-kimi             the Kimi-K2-shaped INT4 MoE with certificates on, then verify
#   own-capture                   vllm-engine's own capture (no speculators 0.3/0.4) against eager prefill
#   fp8                           --state-dtype fp8 against the model's bf16: tokens/s, bytes/token, vs HF
#   hs-connector                  hs-connectors' FP8 connector inside vLLM: what it writes (scripts/hs_connector_run.py)
#   prefix, prefix-writer         per-turn rows sharing prefixes: prefill with/without prefix cache, extractor
#   serve, serve-vllm             speculators 0.9's client against hidden-states serve / vllm serve (SPEC09)
#   generate, generate-graphs     one pass (hidden-states generate) against vLLM's generation + extract
#   generate-alternating          one pass against its two passes, alternating, GREPEATS (3) each in one call
#   release-quick                 a new release in one call: versions, generator (+ the fault), backends
#   release-generator             release-quick's generator steps alone
#   release-backends              a release's eager prefill beside each way to extract, each vs HF
#   release-tiny                  the e2e suite's generator and backend tests on the tiny models (K selects)
#   smoke                         the tiny models' e2e generator tests on CUDA; TP=2 with two GPUs
#   moe, moe-logits               the DeepSeek-V3-shaped MoE: rotary kernel, extractor, vs HF / vLLM's logits
#   kimi-int4                     Kimi-K2-shaped INT4 MoE: build, extractor, check
#   data-parallel                 2 replicas x TP=1 (Ray) against 1 replica (two GPUs)
# Results: $OUT/results.jsonl (bench/gpu.py: each record with its provenance), logs in $OUT.
# CPU dry run of a stage (a tiny model, short sequences; bench/device/README.md): DRY_RUN=1 (or NO_INSTALL=1
# where this checkout is installed in $SITE already) skips the install, and M8 / SPEC / LENGTH /
# VLLM_COMPAT_CACHE / OUT may be set from outside.
set -uo pipefail
# the stage asked for must be one of this file's (a misspelt or retired name would otherwise run nothing)
STAGES=$(sed -n 's/^  \([a-z0-9|-]*\))  #.*/\1/p' "${BASH_SOURCE[0]}" | tr '|\n' '  ')
[[ " $STAGES " == *" ${1:?stage} "* ]] || { echo "stages.sh: no stage '$1'; the stages: $STAGES" >&2; exit 2; }
SITE=${SITE:-/tmp/site}
# a torch other than the image's (install.sh's torch bundle), behind the release's own site
TORCH_SITE=${TORCH_SITE:-}
export PYTHONPATH=$SITE${TORCH_SITE:+:$TORCH_SITE}${PYTHONPATH:+:$PYTHONPATH} VLLM_COMPAT_CACHE=${VLLM_COMPAT_CACHE:-/tmp/vcache} HF_HUB_OFFLINE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 VLLM_ALLREDUCE_USE_SYMM_MEM=0
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export BENCH_LOG_DIR=${BENCH_LOG_DIR:-$OUT}  # bench/gpu.py extract keeps each run's whole log there
# this checkout's vllm-compat, with its vLLM plugin entry point, next to vLLM: once per checkout and site
# (stages in other GPU lanes import from the same site: a reinstall under them would pull their files away)
if [ -z "${DRY_RUN:-}${NO_INSTALL:-}" ]; then
  (
    flock 9
    stamp=$(find pyproject.toml vllm_compat hidden_states -type f ! -path '*__pycache__*' -print0 | sort -z | xargs -0 sha256sum | sha256sum | cut -c1-16)
    if [ "$(cat "$SITE/.vllm-compat-stamp" 2>/dev/null)" != "$stamp" ]; then
      python3 -m pip install -q --no-deps --no-build-isolation --no-index --upgrade --target "$SITE" . 2>&1 | grep -v WARNING
      echo "$stamp" > "$SITE/.vllm-compat-stamp"
    fi
  ) 9> "$SITE.install-lock"
fi
SPEC=${SPEC:-/tmp/vcache/speculators/0.3.0}
GPUS=$(python3 -c 'import torch; print(torch.cuda.device_count())')
B="python3 bench/gpu.py"
M8=${M8:-/tmp/models/llama3-8b}
LENGTH=${LENGTH:-2048}  # tokens per random row (the extract helper: 64 rows per run)
# step SECONDS COMMAND...: run COMMAND under `timeout`, unless fewer than SECONDS are left of the
# stage's DEADLINE (seconds since the stage began; default 560, for a runner that stops a command at
# 600 s and returns nothing from it; raise it where nothing does): a skipped or timed-out step is said
# in $OUT/skipped.txt, and the stage goes on.
DEADLINE=${DEADLINE:-560}
step() {
  local need=$1; shift
  local left=$((DEADLINE - SECONDS))
  if [ "$left" -lt "$need" ]; then echo "SKIPPED (${left}s left, needs ${need}s): $*" | tee -a "$OUT/skipped.txt"; return 0; fi
  echo "## [${SECONDS}s] $*"
  timeout "$left" bash -c "$*" || echo "STEP FAILED or timed out (rc $?): $*" | tee -a "$OUT/skipped.txt"
}
# extract ARGS...: the extractor over 64 x $LENGTH random tokens of the 8B shape, its RESULT line
extract() { PYTHONPATH=$SPEC:$PYTHONPATH $B extract --model $M8 --samples 64 --length $LENGTH "$@" 2>&1 | grep -E "RESULT|Error|torch threads" | tail -3; }
# timed NAME COMMAND...: COMMAND with bench/steps.py's step events on (bench/timeline_hook), into
# /tmp/steps/NAME, archived as $OUT/steps-NAME.tgz (one file per run)
timed() {
  local name=$1; shift
  rm -rf "/tmp/steps/$name" && mkdir -p "/tmp/steps/$name"
  BENCH_STEPS_DIR=/tmp/steps/$name PYTHONPATH=$PWD/bench/timeline_hook:$PYTHONPATH bash -c "$*"
  tar czf "$OUT/steps-$name.tgz" -C /tmp/steps "$name"
}
export -f extract timed; export B M8 SPEC LENGTH
# per-turn rows as speculators 0.9 writes them (bench/gpu.py multiturn_rows): 64 conversations, a 500-token system prompt shared by all,
# 4 exchanges of 100 user + 300 assistant tokens, one row per assistant turn (384,000 row tokens)
MT="--rows multiturn --conversations ${CONVERSATIONS:-64} --system ${SYSTEM_TOKENS:-500} --user ${USER_TOKENS:-100} --assistant ${ASSISTANT_TOKENS:-300} --turns 4"
# the first steps of a release's run (release-quick, release-generator): the generator of speculators 0.3.0 and
# its files against HF fp32; from 0.34.0 the same without extensible_kv_cache, the fault it prevents
generator_steps() {
    step 100 "rm -rf /tmp/r03 && extract --batch 32 --samples 64 --work /tmp/r03"
    step 60 "PYTHONPATH=$SPEC:\$PYTHONPATH $B check --model $M8 --samples 4 --work /tmp/r03 2>&1 | grep RESULT; rm -rf /tmp/r03"
    if python3 -c "import sys, vllm; from packaging.version import Version; sys.exit(Version(vllm.__version__) < Version('0.34.0'))"; then
      step 60 "rm -rf /tmp/fault && VLLM_COMPAT_DISABLE=extensible_kv_cache timeout 100 bash -c 'extract --batch 32 --samples 64 --work /tmp/fault' | cut -c1-400; rm -rf /tmp/fault"
    fi
}
# the generate stages' workload (G: GSAMPLES prompts of GLENGTH tokens, GNEW new tokens each) and its best two passes: vLLM's
# graph-mode generation alone (its rows in /tmp/g/rows.jsonl, left for the stage), then extract (vllm-engine) of them
G="--model $M8 --samples ${GSAMPLES:-256} --length ${GLENGTH:-512} --new-tokens ${GNEW:-1024}${GFORMAT:+ --format $GFORMAT}"
two_passes() {
    [ -f $M8/config.json ] || step 60 "$B build --family llama3-8b --path $M8 2>&1 | grep RESULT"
    step 120 "$B generate $G --backend vllm --work /tmp/g 2>&1 | grep -E 'RESULT|Error' | tail -2"
    step 150 "$B extract --model $M8 --rows-file /tmp/g/rows.jsonl --backend vllm-engine --batch 32${GFORMAT:+ --format $GFORMAT} --work /tmp/gx 2>&1 | grep -E 'RESULT|Error' | tail -2 | cut -c1-900; rm -rf /tmp/gx"
}
case "${1:?stage}" in
  build)  # the 8B checkpoint (~35 s) and the host copy bench (bench/host_copy.py, CPU, 2-3 min)
    $B env 2>&1 | grep RESULT
    [ -f $M8/config.json ] || $B build --family llama3-8b --path $M8 2>&1 | grep RESULT
    timeout 300 python3 bench/host_copy.py --batches 8,32 --threads default,1 --calls 6 --jsonl "$OUT/results.jsonl" | tee "$OUT/host-copy.txt"
    ;;
  backends-vs-prefill)  # --backend vllm-engine b8 (its files vs HF fp32) and b32, vLLM's eager prefill alone, vllm-engine b8
    # with 4 writer threads, the speculators backend b8; 256 x 2048 each
    [ -f $M8/config.json ] || step 60 "$B build --family llama3-8b --path $M8 2>&1 | grep RESULT"
    step 100 "rm -rf /tmp/e8 && extract --backend vllm-engine --batch 8 --samples 256 --work /tmp/e8"
    step 60 "PYTHONPATH=$SPEC:$PYTHONPATH $B check --model $M8 --samples 4 --work /tmp/e8 2>&1 | grep RESULT; rm -rf /tmp/e8"
    step 90 "$B prefill --model $M8 --samples 256 --length $LENGTH 2>&1 | grep RESULT | tail -1"  # vLLM alone, eager, same machine
    step 100 "rm -rf /tmp/e32 && extract --backend vllm-engine --batch 32 --samples 256 --work /tmp/e32; rm -rf /tmp/e32"
    step 100 "rm -rf /tmp/e8w && extract --backend vllm-engine --batch 8 --samples 256 --writer-threads 4 --work /tmp/e8w; rm -rf /tmp/e8w"
    step 100 "rm -rf /tmp/s8 && extract --batch 8 --samples 256 --work /tmp/s8; rm -rf /tmp/s8"  # the speculators backend, same run
    ;;
  backends-vs-compiled-prefill)  # vLLM's compiled prefill, --backend vllm-native b8 (its files vs HF fp32) and b32, the speculators
    # backend b32, vLLM's native extract_hidden_states path alone; 256 x 2048 each
    [ -f $M8/config.json ] || step 60 "$B build --family llama3-8b --path $M8 2>&1 | grep RESULT"
    step 130 "$B prefill --model $M8 --samples 256 --length $LENGTH --compiled 2>&1 | grep RESULT | tail -1"
    step 100 "rm -rf /tmp/n8 && extract --backend vllm-native --batch 8 --samples 256 --work /tmp/n8"
    step 60 "$B check --model $M8 --samples 4 --work /tmp/n8 2>&1 | grep RESULT; rm -rf /tmp/n8"
    step 100 "rm -rf /tmp/n32 && extract --backend vllm-native --batch 32 --samples 256 --work /tmp/n32; rm -rf /tmp/n32"
    step 100 "rm -rf /tmp/s32 && extract --batch 32 --samples 256 --work /tmp/s32; rm -rf /tmp/s32"
    step 90 "$B native --model $M8 --samples 256 --length $LENGTH --work /tmp/native-alone 2>&1 | grep RESULT | tail -1; rm -rf /tmp/native-alone"
    ;;
  steps-vs-prefill)  # where vllm-engine's time goes against vLLM's prefill alone, step by step (bench/steps.py): the
    # eager prefill, vllm-engine b32 (its files vs HF fp32) and b8; 256 x 2048 each
    [ -f $M8/config.json ] || step 60 "$B build --family llama3-8b --path $M8 2>&1 | grep RESULT"
    step 80 "timed prefill '$B prefill --model $M8 --samples 256 --length $LENGTH 2>&1 | grep RESULT | tail -1'"
    step 90 "timed engine-b32 'rm -rf /tmp/h32 && extract --backend vllm-engine --batch 32 --samples 256 --work /tmp/h32'"
    step 60 "PYTHONPATH=$SPEC:$PYTHONPATH $B check --model $M8 --samples 4 --work /tmp/h32 2>&1 | grep RESULT; rm -rf /tmp/h32"
    step 90 "timed engine-b8 'rm -rf /tmp/h8 && extract --backend vllm-engine --batch 8 --samples 256 --work /tmp/h8; rm -rf /tmp/h8'"
    python3 bench/steps.py /tmp/steps/* 2>&1 | tee "$OUT/steps.txt"
    ;;
  native-formats-steps)  # vLLM's native path alone beside --backend vllm-native b8 in both formats (speculators-0.5
    # written by the streaming safetensors writer), vLLM's compiled prefill; step by step
    [ -f $M8/config.json ] || step 60 "$B build --family llama3-8b --path $M8 2>&1 | grep RESULT"
    step 100 "$B native --model $M8 --samples 256 --length $LENGTH --work /tmp/native-alone 2>&1 | grep RESULT | tail -1; rm -rf /tmp/native-alone"
    step 110 "timed native-b8 'rm -rf /tmp/m8 && extract --backend vllm-native --batch 8 --samples 256 --work /tmp/m8; rm -rf /tmp/m8'"
    step 110 "timed native-b8-stacked 'rm -rf /tmp/n8s && extract --backend vllm-native --batch 8 --samples 256 --format speculators-0.5 --work /tmp/n8s; rm -rf /tmp/n8s'"
    step 130 "$B prefill --model $M8 --samples 256 --length $LENGTH --compiled 2>&1 | grep RESULT | tail -1"
    python3 bench/steps.py /tmp/steps/* 2>&1 | tee "$OUT/steps.txt"
    ;;
  native-store-shm-vs-disk)  # where vLLM's native path's steps go, alone and under --backend vllm-native b8 (2 writer threads)
    # with vLLM's files in /dev/shm and on disk (VLLM_COMPAT_NATIVE_STORE); step by step
    [ -f $M8/config.json ] || step 60 "$B build --family llama3-8b --path $M8 2>&1 | grep RESULT"
    step 110 "timed native-alone '$B native --model $M8 --samples 256 --length $LENGTH --work /tmp/na 2>&1 | grep RESULT | tail -1'; rm -rf /tmp/na"
    step 110 "mkdir -p /dev/shm/nstore && timed native-b8 'rm -rf /tmp/m8 && VLLM_COMPAT_NATIVE_STORE=/dev/shm/nstore extract --backend vllm-native --batch 8 --samples 256 --writer-threads 2 --work /tmp/m8; rm -rf /tmp/m8'"
    step 110 "mkdir -p /tmp/nstore && timed native-b8-store-disk 'rm -rf /tmp/m8 && VLLM_COMPAT_NATIVE_STORE=/tmp/nstore extract --backend vllm-native --batch 8 --samples 256 --writer-threads 2 --work /tmp/m8; rm -rf /tmp/m8'"
    python3 bench/steps.py /tmp/steps/* 2>&1 | tee "$OUT/steps.txt"
    ;;
  native-path-shm-one-writer)  # vLLM's native path alone with its files in /dev/shm, --backend vllm-native b8 with one writer
    # thread, the native path alone again (on disk); step by step
    [ -f $M8/config.json ] || step 60 "$B build --family llama3-8b --path $M8 2>&1 | grep RESULT"
    step 110 "timed native-alone-shm '$B native --model $M8 --samples 256 --length $LENGTH --work /dev/shm/na 2>&1 | grep RESULT | tail -1'; rm -rf /dev/shm/na"
    step 110 "mkdir -p /dev/shm/nstore && timed native-b8-w1 'rm -rf /tmp/m8 && VLLM_COMPAT_NATIVE_STORE=/dev/shm/nstore extract --backend vllm-native --batch 8 --samples 256 --writer-threads 1 --work /tmp/m8; rm -rf /tmp/m8'"
    step 110 "timed native-alone-2 '$B native --model $M8 --samples 256 --length $LENGTH --work /tmp/na 2>&1 | grep RESULT | tail -1'; rm -rf /tmp/na"
    python3 bench/steps.py /tmp/steps/* 2>&1 | tee "$OUT/steps.txt"
    ;;
  native-vs-native-path)  # --backend vllm-native (its defaults) against vLLM's native path alone, alternating, twice each
    # (the path is host-bound: runs differ by 6 %)
    [ -f $M8/config.json ] || step 60 "$B build --family llama3-8b --path $M8 2>&1 | grep RESULT"
    for round in 1 2; do
      step 100 "timed native-alone-$round '$B native --model $M8 --samples 256 --length $LENGTH --work /tmp/na 2>&1 | grep RESULT | tail -1'; rm -rf /tmp/na"
      step 100 "timed native-b8-$round 'rm -rf /tmp/m8 && extract --backend vllm-native --batch 8 --samples 256 --work /tmp/m8; rm -rf /tmp/m8'"
    done
    python3 bench/steps.py /tmp/steps/* 2>&1 | tee "$OUT/steps.txt"
    ;;
  overlap)  # batch N+1's forward while batch N's states are copied out (hidden_states/backends/overlap.py)
    # against --no-overlap, b8 and b32, 128 x 2048 each; vLLM's eager and compiled prefill
    [ -f $M8/config.json ] || step 60 "$B build --family llama3-8b --path $M8 2>&1 | grep RESULT"
    # 128 x 2048 per run (one model load each), after and before (--no-overlap), most important first
    step 100 "rm -rf /tmp/o8 && extract --batch 8 --samples 128 --work /tmp/o8"
    step 100 "rm -rf /tmp/o8n && extract --batch 8 --samples 128 --no-overlap --work /tmp/o8n; rm -rf /tmp/o8n"
    step 100 "rm -rf /tmp/o32 && extract --batch 32 --samples 128 --work /tmp/o32; rm -rf /tmp/o32"
    step 60 "PYTHONPATH=$SPEC:$PYTHONPATH $B check --model $M8 --samples 4 --work /tmp/o8 2>&1 | grep RESULT"  # states vs HF fp32
    step 70 "$B prefill --model $M8 --samples 128 --length $LENGTH 2>&1 | grep RESULT | tail -1"  # vLLM alone, eager, same machine
    step 100 "rm -rf /tmp/o32n && extract --batch 32 --samples 128 --no-overlap --work /tmp/o32n; rm -rf /tmp/o32n"
    step 120 "$B prefill --model $M8 --samples 128 --length $LENGTH --compiled 2>&1 | grep RESULT | tail -1"
    ;;
  parent-copy-threads)  # the speculators generator's process with torch threads for its copy (parent_copy_threads):
    # the default cap b8 and b32, off (VLLM_COMPAT_PARENT_THREADS=0), 16; the b8 files vs HF fp32
    [ -f $M8/config.json ] || step 60 "$B build --family llama3-8b --path $M8 2>&1 | grep RESULT"
    # one work folder at a time (4 GB each); the adapter's default cap first, then off (before), then 16
    step 100 "rm -rf /tmp/t8 && extract --batch 8 --work /tmp/t8"
    step 100 "rm -rf /tmp/t8-off && VLLM_COMPAT_PARENT_THREADS=0 extract --batch 8 --work /tmp/t8-off; rm -rf /tmp/t8-off"
    step 100 "rm -rf /tmp/t32 && extract --batch 32 --work /tmp/t32; rm -rf /tmp/t32"
    step 100 "rm -rf /tmp/t8-16 && VLLM_COMPAT_PARENT_THREADS=16 extract --batch 8 --work /tmp/t8-16; rm -rf /tmp/t8-16"
    step 60 "PYTHONPATH=$SPEC:$PYTHONPATH $B check --model $M8 --samples 4 --work /tmp/t8 2>&1 | grep RESULT"  # states unchanged
    ;;
  generator-host-memory)  # the speculators generator with the freed host memory kept (the default) and without
    # (VLLM_COMPAT_KEEP_FREED_HOST_MEMORY=0): the timeline b8/b32, the extractor b8/b32, prefill, check
    [ -f $M8/config.json ] || step 60 "$B build --family llama3-8b --path $M8 2>&1 | grep RESULT"
    # the generator's breakdown with the transport's allocator setting; parent copy GB/s and faults
    step 150 "PYTHONPATH=$SPEC:$PYTHONPATH python3 bench/timeline.py --model $M8 --configs 8x$LENGTH,32x$LENGTH --samples 64 --length $LENGTH \
      2>&1 | tee $OUT/timeline-full.log | grep -vE 'INFO|WARNING|Warning|^ +(class|if|wrapper)' > $OUT/timeline.txt; grep -E 'RESULT|untimed|GB/s' $OUT/timeline.txt"
    step 100 "extract --batch 8 --work /tmp/x8"
    step 100 "extract --batch 32 --work /tmp/x32"
    step 70 "$B prefill --model $M8 --length $LENGTH 2>&1 | grep RESULT | tail -1"  # vLLM alone, eager, same run
    step 60 "PYTHONPATH=$SPEC:$PYTHONPATH $B check --model $M8 --samples 4 --work /tmp/x8 2>&1 | grep RESULT"
    step 100 "VLLM_COMPAT_KEEP_FREED_HOST_MEMORY=0 extract --batch 8 --work /tmp/x8-before"  # before, same run
    ;;
  generator-timeline)  # where the speculators generator's time goes, per step and per call (bench/timeline.py), b8 and b32
    M=/tmp/models/llama3-8b
    $B env 2>&1 | grep RESULT
    [ -f $M/config.json ] || $B build --family llama3-8b --path $M 2>&1 | grep RESULT
    PYTHONPATH=$SPEC:$PYTHONPATH timeout 420 python3 bench/timeline.py --model $M --configs 8x2048,32x2048 \
      --samples 64 --length 2048 2>&1 | tee "$OUT/timeline-full.log" | grep -vE "INFO|WARNING|Warning|^ +(class|if|wrapper)" | tee "$OUT/timeline.txt"
    ;;
  generator-sweep)  # the speculators generator over batch sizes and lengths (one load), vllm-native, the writer alone
    M=/tmp/models/llama3-8b
    PYTHONPATH=$SPEC:$PYTHONPATH $B generator --model $M --configs 8x2048,32x2048,128x512,32x1024,4x4096 --speculators-version 0.3.0 2>&1 | grep RESULT
    $B extract --model $M --batch 32 --samples 64 --backend vllm-native --work /tmp/native 2>&1 | grep RESULT
    rm -rf /tmp/native
    python3 bench/writer.py --dir /tmp --samples 32 | tee "$OUT/writer.txt"
    ;;
  generator-token-budget)  # the speculators generator at its scheduler budget (8,192 tokens per step) and larger ones
    M=/tmp/models/llama3-8b
    for budget in 8192 16384 32768; do
      PYTHONPATH=$SPEC:$PYTHONPATH $B generator --model $M --configs 8x2048,32x2048 --token-budget $budget --speculators-version 0.3.0 2>&1 | grep RESULT
    done
    ;;
  baselines)  # the same model and rows through vLLM alone, HF, vLLM's native path, and the generator without the transport
    M=/tmp/models/llama3-8b
    $B prefill --model $M 2>&1 | grep -E "RESULT" | tail -1
    $B hf --model $M --batch 4 2>&1 | grep RESULT
    $B native --model $M 2>&1 | grep -E "RESULT" | tail -1
    PYTHONPATH=$SPEC:$PYTHONPATH VLLM_COMPAT_DISABLE=capture_transport $B generator --model $M --batch 8 --speculators-version 0.3.0 2>&1 | grep RESULT
    ;;
  extract-8b-roofline)  # the 8B model: the matmul roofline, the extractor over 256 x 2048 tokens (b32) and its check
    M=/tmp/models/llama3-8b
    $B build --family llama3-8b --path $M 2>&1 | grep RESULT
    $B matmul | grep RESULT
    PYTHONPATH=$SPEC:$PYTHONPATH $B extract --model $M --batch 32 --samples 256 --work /tmp/x256 2>&1 | grep RESULT
    PYTHONPATH=$SPEC:$PYTHONPATH $B check --model $M --samples 4 --work /tmp/x256 --bf16-floor 2>&1 | grep RESULT
    rm -rf /tmp/x256
    ;;
  forward-check)  # the extractor's preflight forward check: its share of a run (with and without), each kernel's error
    M=/tmp/models/llama3-8b
    $B env 2>&1 | grep RESULT
    [ -f $M/config.json ] || $B build --family llama3-8b --path $M 2>&1 | grep RESULT
    for flag in "" --skip-forward-check; do  # the same 32 x 2048 tokens, one model load each
      PYTHONPATH=$SPEC:$PYTHONPATH $B extract --model $M --batch 8 --samples 32 --work /tmp/fwd$flag $flag 2>&1 | grep RESULT
    done
    PYTHONPATH=$SPEC:$PYTHONPATH $B forward-check --model $M 2>&1 | grep -E "RESULT|Error"
    PYTHONPATH=$SPEC:$PYTHONPATH $B check --model $M --samples 4 --work /tmp/fwd 2>&1 | grep RESULT
    ;;
  fork-safety)  # fork safety after apply(); the vllm-native backend on CUDA and its check
    M=/tmp/models/llama3-8b
    python3 bench/fork_safety.py | tee "$OUT/fork-safety.txt"
    $B build --family llama3-8b --path $M 2>&1 | grep RESULT
    $B extract --model $M --batch 32 --samples 64 --backend vllm-native --work /tmp/native 2>&1 | grep RESULT
    $B check --model $M --samples 4 --work /tmp/native 2>&1 | grep RESULT
    ;;
  certificates)  # what certificates cost (bench/certificates.py): --backend vllm-engine b8 over
    # ${CSAMPLES:-128} x $LENGTH, off/on alternating, ${CREPEATS:-3} runs each, one process (one model load) per run
    # (CPREFILL=1: vLLM's eager prefill of the same rows before each pair, for extract's ratio to it),
    # its record appended to $OUT/results.jsonl; then hidden-states verify on the last run's files (certified)
    [ -f $M8/config.json ] || step 60 "$B build --family llama3-8b --path $M8 2>&1 | grep RESULT"
    step 300 "PYTHONPATH=$SPEC:\$PYTHONPATH python3 bench/certificates.py --model $M8 --samples ${CSAMPLES:-128} --length $LENGTH \
      --batch 8 --repeats ${CREPEATS:-3} ${CPREFILL:+--with-prefill} --gpu-memory-utilization 0.85 --out $OUT/results.jsonl 2>&1 | tee $OUT/certificates.txt | cut -c1-900"
    grep -h "certificates:" "$OUT/extract-bench-certificates.log" 2>/dev/null | cut -c1-600 | tee "$OUT/certificates-log.txt"
    step 120 "python3 -m hidden_states verify /tmp/bench-certificates/out 2>&1 | tee $OUT/verify.txt | tail -20 | cut -c1-600"
    ;;
  certificates-steps)  # where certificates' cost goes: the certificates stage's workload, off then on, each step
    # timed (bench/steps.py: steps, tokens and requests per step, the GPU idle between them), then the
    # certified run once more under py-spy (PYSPY: its binary; raw stacks for flame graphs)
    [ -f $M8/config.json ] || step 60 "$B build --family llama3-8b --path $M8 2>&1 | grep RESULT"
    rm -rf /tmp/steps
    step 100 "timed off 'rm -rf /tmp/c0 && extract --backend vllm-engine --batch 8 --samples ${CSAMPLES:-128} --no-certificates --work /tmp/c0; rm -rf /tmp/c0'"
    step 100 "timed on 'rm -rf /tmp/c1 && extract --backend vllm-engine --batch 8 --samples ${CSAMPLES:-128} --work /tmp/c1; rm -rf /tmp/c1'"
    python3 bench/steps.py /tmp/steps/off /tmp/steps/on 2>&1 | tee "$OUT/steps.txt"
    PYSPY=${PYSPY:-$PWD/.gpu-tools/py-spy}
    [ -x "$PYSPY" ] && step 150 "rm -rf /tmp/c2 && $PYSPY record --subprocesses --nonblocking -r 50 --format raw -o $OUT/certified.pyspy.txt -- \
      $B extract --model $M8 --samples ${CSAMPLES:-128} --length $LENGTH --backend vllm-engine --batch 8 --work /tmp/c2 2>&1 | grep -E 'RESULT|Error' | tail -2 | cut -c1-600; rm -rf /tmp/c2"
    ;;
  certificates-kimi)  # the Kimi-K2-shaped INT4 MoE (kimi-int4's checkpoint, built here if absent) through
    # --backend vllm-engine, certificates on, 32 x $LENGTH b16: its "certificates:" lines, then verify
    KIMI=${KIMI:-kimi-k2-small-int4}
    MK=/tmp/models/$KIMI
    [ -f $MK/config.json ] || step 240 "PYTHONPATH=${BUILD_SITE:-/tmp/build-site}:\$PYTHONPATH $B build --family $KIMI --path $MK 2>&1 | grep -E 'RESULT|Error'"
    step 200 "PYTHONPATH=$SPEC:\$PYTHONPATH $B extract --model $MK --backend vllm-engine --samples 32 --length $LENGTH --batch 16 \
      --work /tmp/kimi-cert 2>&1 | grep -E 'RESULT|Error' | tail -1 | cut -c1-1500"
    grep -h "certificates:" "$OUT/extract-kimi-cert.log" 2>/dev/null | cut -c1-600 | tee "$OUT/certificates-kimi.txt"
    step 120 "python3 -m hidden_states verify /tmp/kimi-cert/out 2>&1 | tee $OUT/verify-kimi.txt | tail -20 | cut -c1-600"
    ;;
  own-capture)  # --backend vllm-engine with no speculators 0.3/0.4 on the path (its own capture; SPEC09: a folder
    # holding speculators 0.9, where carried), alternating with vLLM's eager prefill over 256 x $LENGTH; its files
    # vs HF fp32; speculators 0.3.0's capture beside it (VLLM_COMPAT_ENGINE_CAPTURE=speculators)
    [ -f $M8/config.json ] || step 60 "$B build --family llama3-8b --path $M8 2>&1 | grep RESULT"
    OWN_PATH=${SPEC09:+$SPEC09:}$PYTHONPATH
    capture() { python3 -c "import json, sys; c = json.load(open(sys.argv[1])); print('capture:', c.get('capture'), '-', c.get('capture_chosen_because'))" "$1/out/data_config.json"; }
    export -f capture; export OWN_PATH
    for round in 1 2; do
      step 70 "$B prefill --model $M8 --samples 256 --length $LENGTH 2>&1 | grep RESULT | tail -1"
      step 90 "rm -rf /tmp/o8 && PYTHONPATH=$OWN_PATH $B extract --model $M8 --backend vllm-engine --batch 8 --samples 256 --length $LENGTH --work /tmp/o8 2>&1 | grep -E 'RESULT|Error' | tail -2 | cut -c1-600; capture /tmp/o8"
      [ $round = 1 ] && step 60 "PYTHONPATH=$OWN_PATH $B check --model $M8 --samples 4 --work /tmp/o8 2>&1 | grep RESULT"
      rm -rf /tmp/o8
    done
    step 90 "rm -rf /tmp/o32 && PYTHONPATH=$OWN_PATH $B extract --model $M8 --backend vllm-engine --batch 32 --samples 256 --length $LENGTH --work /tmp/o32 2>&1 | grep -E 'RESULT|Error' | tail -2 | cut -c1-600; capture /tmp/o32; rm -rf /tmp/o32"
    step 90 "rm -rf /tmp/s8 && VLLM_COMPAT_ENGINE_CAPTURE=speculators extract --backend vllm-engine --batch 8 --samples 256 --work /tmp/s8 | cut -c1-600; capture /tmp/s8; rm -rf /tmp/s8"
    ;;
  fp8)  # FP8 states (quantized in vllm-engine's worker) against the model's bf16, 64 x $LENGTH b32 into
    # speculators-0.5: tokens/s, bytes per token, each against HF fp32; FP8_DTYPES=fp8: the FP8 run alone
    $B env 2>&1 | grep RESULT
    [ -f $M8/config.json ] || step 120 "$B build --family llama3-8b --path $M8 2>&1 | grep RESULT"
    # FP8_DTYPES=fp8: only the FP8 files and their check (bf16's error against HF is every other stage's)
    for dtype in ${FP8_DTYPES:-model fp8}; do
      step 150 "extract --backend vllm-engine --batch 32 --format speculators-0.5 --state-dtype $dtype --work /tmp/fp8-$dtype"
    done
    for dtype in ${FP8_DTYPES:-model fp8}; do  # HF fp32 on the GPU against each (FP8 dequantized as its trainer does)
      step 90 "PYTHONPATH=$SPEC:\$PYTHONPATH $B check --model $M8 --samples 4 --work /tmp/fp8-$dtype 2>&1 | grep RESULT"
    done
    for dtype in model fp8; do  # the pair again, while time is left: the second of each is the steadier
      step 150 "extract --backend vllm-engine --batch 32 --format speculators-0.5 --state-dtype $dtype --work /tmp/fp8-$dtype"
    done
    ;;
  hs-connector)  # speculators 0.9's FP8 hidden-states connector (hs-connectors' FP8HiddenStatesConnector) inside
    # vLLM (scripts/hs_connector_run.py, 3 prompts on the 8B shape): what it writes, FP8 with one scale per token or
    # the states unquantized (the audit's "_write_tensors overrides nothing" on 0.17-0.20), each tensor's dtype and shape
    SPEC09=${SPEC09:-/tmp/vcache/speculators/0.9.0}
    [ -d "$SPEC09/hs_connectors" ] || { echo "SKIPPED: no hs_connectors in SPEC09 ($SPEC09)" | tee -a "$OUT/skipped.txt"; exit 0; }
    [ -f $M8/config.json ] || step 60 "$B build --family llama3-8b --path $M8 2>&1 | grep RESULT"
    step 150 "PYTHONPATH=\$PYTHONPATH:$SPEC09 python3 scripts/hs_connector_run.py --model $M8 --gpu-memory-utilization 0.5 \
      --store /tmp/hs-connector --results $OUT/results.jsonl 2>&1 | tee $OUT/hs-connector.txt | grep -E '^\\{|Error' | cut -c1-1500"
    ls -l /tmp/hs-connector > "$OUT/hs-connector-files.txt" 2>&1; rm -rf /tmp/hs-connector
    ;;
  prefix)  # per-turn rows sharing prefixes (MT): vLLM's eager prefill without and with its prefix cache, the
    # extractor (vllm-engine b32) serving rows from longer rows and the system prompt from the cache (its files
    # vs HF fp32: rows 0-7), with 8 writer threads, and with --no-shared-prefix
    [ -f $M8/config.json ] || step 60 "$B build --family llama3-8b --path $M8 2>&1 | grep RESULT"
    step 70 "$B prefill --model $M8 $MT 2>&1 | grep RESULT | tail -1"
    step 70 "$B prefill --model $M8 $MT --prefix-caching 2>&1 | grep RESULT | tail -1"
    step 100 "rm -rf /tmp/p32 && extract --backend vllm-engine --batch 32 $MT --work /tmp/p32"
    step 90 "$B check --model $M8 --samples 8 --work /tmp/p32 2>&1 | grep RESULT; rm -rf /tmp/p32"
    # the first run's writer stalled 77 % (2026-12-03, CPUs shared): the same with twice the writer threads
    step 100 "rm -rf /tmp/p32w && extract --backend vllm-engine --batch 32 $MT --writer-threads 8 --work /tmp/p32w; rm -rf /tmp/p32w"
    step 100 "rm -rf /tmp/p32n && extract --backend vllm-engine --batch 32 $MT --no-shared-prefix --work /tmp/p32n; rm -rf /tmp/p32n"
    ;;
  prefix-writer)  # the same rows: vLLM's prefix-cached prefill (the ceiling, same call), the extractor with
    # the writer doubling its threads per starved interval (the default), then with 16 writer threads
    [ -f $M8/config.json ] || step 60 "$B build --family llama3-8b --path $M8 2>&1 | grep RESULT"
    step 70 "$B prefill --model $M8 $MT 2>&1 | grep RESULT | tail -1"  # the target's denominator, in this call
    step 70 "$B prefill --model $M8 $MT --prefix-caching 2>&1 | grep RESULT | tail -1"
    step 100 "rm -rf /tmp/p32 && extract --backend vllm-engine --batch 32 $MT --work /tmp/p32; rm -rf /tmp/p32"
    step 100 "rm -rf /tmp/p32x && extract --backend vllm-engine --batch 32 $MT --writer-threads 16 --work /tmp/p32x; rm -rf /tmp/p32x"
    ;;
  serve|serve-vllm)  # speculators 0.9's client (generate-offline-data) at concurrency 32, 64, 128 over rows of their
    # own, then a second job's first file on the warm server, against hidden-states serve (serve) or vllm serve
    # with extract_hidden_states as speculators' scripts/launch_vllm.py configures it (serve-vllm); row tokens/s at
    # the client. VLLM_SHIM=1: the shim's worker adapters in vllm serve's processes (CPU dry run only)
    [ -n "${SPEC09:-}" ] || { echo "SKIPPED: SPEC09 (a folder holding speculators 0.9 and its requirements) is not set" | tee -a "$OUT/skipped.txt"; exit 0; }
    [ -f $M8/config.json ] || step 60 "$B build --family llama3-8b --path $M8 2>&1 | grep RESULT"
    SERVER=hidden-states; [ "$1" = serve-vllm ] && SERVER=vllm
    step 300 "python3 bench/serve.py --server $SERVER --model $M8 --spec09 $SPEC09 --samples ${SAMPLES:-512} --length $LENGTH \
      --concurrency ${CONCURRENCY:-32,64,128} ${VLLM_SHIM:+--shim} ${ENGINE_TOKENS:+--engine-tokens $ENGINE_TOKENS} ${CLIENT_PYTHON:+--client-python $CLIENT_PYTHON} 2>&1 | grep -E 'RESULT|Error|exited' | cut -c1-800"
    ;;
  generate)  # 256 prompts of 512 tokens, 1,024 new tokens each (ignore_eos): vLLM's graph-mode generation alone,
    # extract (vllm-engine) of its rows (the best two passes), hidden-states generate on the same prompts (one
    # pass, eager), vLLM's generation eager. GSAMPLES / GLENGTH / GNEW shrink it for the CPU dry run
    two_passes
    step 200 "$B generate $G --backend hidden-states --batch ${GSAMPLES:-256} --work /tmp/gh 2>&1 | grep -E 'RESULT|Error' | tail -2 | cut -c1-1200; rm -rf /tmp/gh"
    step 120 "$B generate $G --backend vllm --eager --work /tmp/ge 2>&1 | grep -E 'RESULT|Error' | tail -2; rm -rf /tmp/ge /tmp/g"
    ;;
  generate-alternating)  # the generate workload's one pass (hidden-states generate, eager) against its best two
    # passes (vLLM's graph-mode generation, then extract of its rows), alternating, GREPEATS (3) times each in one
    # call: the ratio the benchmarks page may quote (both sides measured in one run, at least three each)
    [ -f $M8/config.json ] || step 60 "$B build --family llama3-8b --path $M8 2>&1 | grep RESULT"
    for _ in $(seq 1 "${GREPEATS:-3}"); do
      step 200 "$B generate $G --backend hidden-states --batch ${GSAMPLES:-256} --work /tmp/gh 2>&1 | grep -E 'RESULT|Error' | tail -2 | cut -c1-1200; rm -rf /tmp/gh"
      two_passes
      rm -rf /tmp/g
    done
    ;;
  generate-graphs)  # the generate workload with hidden-states generate --cuda-graphs (the capture inside vLLM's
    # CUDA graphs), its first GCHECK rows' files vs HF fp32. ONE_PASS=1: the one pass and its check only;
    # TWO_PASSES=1: the two passes only; GFORMAT: the output format of both
    if [ -n "${ONE_PASS:-}" ]; then
      [ -f $M8/config.json ] || step 60 "$B build --family llama3-8b --path $M8 2>&1 | grep RESULT"
    else
      two_passes
      [ -n "${TWO_PASSES:-}" ] && exit 0
    fi
    rm -rf /tmp/g
    step 200 "$B generate $G --backend hidden-states --cuda-graphs --batch ${GSAMPLES:-256} --work /tmp/gg 2>&1 | grep -E 'RESULT|Error' | tail -2 | cut -c1-1200"
    step 90 "$B check --model $M8 --samples ${GCHECK:-4} --work /tmp/gg 2>&1 | grep -E 'RESULT|Error' | tail -2; rm -rf /tmp/gg"
    ;;
  release-quick)  # one call for a release, most important first: versions, the speculators 0.3.0 generator and its
    # files vs HF, from 0.34.0 the same without extensible_kv_cache (the fault), eager prefill, vllm-engine (vs
    # HF), vllm-native, speculators 0.4.0's generator; 64 x 2048 each
    $B env 2>&1 | grep -E "RESULT|Error"
    python3 -c "import torch, vllm, transformers; print('torch', torch.__version__, torch.version.cuda, 'vllm', vllm.__version__, 'transformers', transformers.__version__, 'nccl', torch.cuda.nccl.version())"
    [ -f $M8/config.json ] || step 60 "$B build --family llama3-8b --path $M8 2>&1 | grep RESULT"
    S04=${SPEC%/*}/0.4.0
    generator_steps
    step 60 "$B prefill --model $M8 --samples 64 --length $LENGTH 2>&1 | grep RESULT | tail -1"
    step 80 "rm -rf /tmp/e8 && extract --backend vllm-engine --batch 8 --samples 64 --work /tmp/e8 | cut -c1-600"
    step 60 "$B check --model $M8 --samples 4 --work /tmp/e8 2>&1 | grep RESULT; rm -rf /tmp/e8"
    step 90 "rm -rf /tmp/n8 && extract --backend vllm-native --batch 8 --samples 64 --work /tmp/n8 | cut -c1-600; rm -rf /tmp/n8"
    step 80 "rm -rf /tmp/s04 && SPEC=$S04 extract --batch 32 --samples 64 --work /tmp/s04 | cut -c1-600; rm -rf /tmp/s04"
    ;;
  release-generator)  # release-quick's first steps alone: the generator (speculators 0.3.0), its files vs HF, the fault
    generator_steps
    ;;
  release-backends)  # the release's eager prefill beside each way to extract, 128 x 2048 each, each one's files vs HF
    # fp32, in RELEASE_8B_ORDER (default engine native s04 s03): what a release still lacks first
    [ -f $M8/config.json ] || step 60 "$B build --family llama3-8b --path $M8 2>&1 | grep RESULT"
    S04=${SPEC%/*}/0.4.0
    step 80 "$B prefill --model $M8 --samples 128 --length $LENGTH 2>&1 | grep RESULT | tail -1"
    for way in ${RELEASE_8B_ORDER:-engine native s04 s03}; do
      case $way in
        engine) step 90 "rm -rf /tmp/e8 && extract --backend vllm-engine --batch 8 --samples 128 --work /tmp/e8"
                step 60 "$B check --model $M8 --samples 4 --work /tmp/e8 2>&1 | grep RESULT; rm -rf /tmp/e8" ;;
        native) step 100 "rm -rf /tmp/n8 && extract --backend vllm-native --batch 8 --samples 128 --work /tmp/n8"
                step 60 "$B check --model $M8 --samples 4 --work /tmp/n8 2>&1 | grep RESULT; rm -rf /tmp/n8" ;;
        s04) step 90 "rm -rf /tmp/s04 && SPEC=$S04 extract --batch 8 --samples 128 --work /tmp/s04"
             step 60 "PYTHONPATH=$S04:\$PYTHONPATH $B check --model $M8 --samples 4 --work /tmp/s04 2>&1 | grep RESULT; rm -rf /tmp/s04" ;;
        s03) step 90 "rm -rf /tmp/s03 && extract --batch 8 --samples 128 --work /tmp/s03; rm -rf /tmp/s03" ;;
      esac
    done
    ;;
  release-tiny)  # the e2e suite on the tiny models: both generators on every family, both engine backends (K selects)
    # (Model Runner V2 is the only runner from 0.34.0: its runner-v2 cases repeat the default ones there)
    K=${K:-not runner-v2}
    # the whole output into the file as it comes (-v: each test's outcome as it ends; live_failures: each
    # failure's report in $OUT/failures.txt at once), so a stage cut short keeps what ran and why it failed
    # and each CLI run's whole stderr in $OUT/stderr (an engine that fails to start names its cause there)
    step 420 "E2E_STDERR_DIR=$OUT/stderr PYTHONPATH=$PWD/bench/device:\$PYTHONPATH python3 -m pytest -v -rA -p no:cacheprovider -p live_failures -m 'not faults' tests/e2e/test_generator.py tests/e2e/test_backends.py -k '$K' 2>&1 | tee $OUT/tiny-pytest.txt | tail -40"
    ;;
  smoke)  # the tiny models' e2e generator tests on CUDA; with two GPUs, the extractor at TP=2 and its check
    $B env
    timeout 420 python3 -m pytest -x -q tests/e2e/test_generator.py -k "llama" -p no:cacheprovider 2>&1 | tail -25 | tee "$OUT/smoke-pytest.txt"
    if [ "$GPUS" -ge 2 ]; then
      PYTHONPATH=$SPEC:$PYTHONPATH $B extract --model /tmp/vcache/models/llama --samples 16 --length 1000 --batch 8 --tp 2 --gpu-memory-utilization 0.3 --work /tmp/tp2 2>&1 | grep -E "RESULT|Error" | tail -3
      PYTHONPATH=$SPEC:$PYTHONPATH $B check --model /tmp/vcache/models/llama --samples 16 --work /tmp/tp2 2>&1 | grep RESULT
    fi
    ;;
  moe)  # the DeepSeek-V3-shaped MoE: the rotary kernel, the extractor, its files vs HF fp32 with HF's bf16 floor
    M=/tmp/models/deepseek-v3-small
    $B env
    # this model has plain RoPE: MLA's 3-D q_pe goes through forward_cuda's kernel in eager mode
    python3 bench/rotary_kernel.py 2>&1 | grep -E "^\||Error" | tee "$OUT/rotary-kernel.txt"
    $B build --family deepseek-v3-small --path $M 2>&1 | grep RESULT
    PYTHONPATH=$SPEC:$PYTHONPATH $B extract --model $M --samples 32 --batch 16 --work /tmp/moe1 2>&1 | grep -E "RESULT" | tail -1
    # against HF fp32, beside HF's own bf16 forward against the same: the bf16 floor of this model
    PYTHONPATH=$SPEC:$PYTHONPATH $B check --model $M --samples 4 --work /tmp/moe1 --bf16-floor 2>&1 | grep RESULT
    ;;
  moe-logits)  # the MoE's capture against vLLM's own forward (eager, then compiled) and HF's; TP=2 on two GPUs
    M=/tmp/models/deepseek-v3-small
    for mode in --eager ""; do
      LOGITS_CHECK_GPU_MEMORY=0.5 timeout 240 python3 bench/logits_check.py --output-dir /tmp/moe1/out --samples 4 --hf $mode 2>&1 | grep -E "^\||^vLLM|Error" | tee -a "$OUT/moe-logits.txt"
    done
    if [ "$GPUS" -ge 2 ]; then
      PYTHONPATH=$SPEC:$PYTHONPATH $B extract --model $M --samples 32 --batch 16 --tp 2 --work /tmp/moe2 2>&1 | grep -E "RESULT" | tail -1
      PYTHONPATH=$SPEC:$PYTHONPATH $B check --model $M --samples 4 --work /tmp/moe2 2>&1 | grep RESULT
    fi
    ;;
  kimi-int4)  # Kimi-K2 routing and RoPE, INT4 routed experts (compressed-tensors pack-quantized, group 32).
    # The build runs with compressed-tensors 0.17 (its checkpoint converters, BUILD_SITE from install.sh),
    # vLLM with the 0.15.0.1 it pins. KIMI: another family of tiny_model.QUANTIZED, e.g.
    # kimi_k2_int4_dense for the CPU dry run; TP: 2 on two GPUs.
    KIMI=${KIMI:-kimi-k2-small-int4}
    MK=/tmp/models/$KIMI
    TP=${TP:-1}
    step 240 "PYTHONPATH=${BUILD_SITE:-/tmp/build-site}:$PYTHONPATH $B build --family $KIMI --path $MK 2>&1 | grep -E 'RESULT|Error'"  # and $MK-dequantized, HF's reference
    step 150 "PYTHONPATH=$SPEC:$PYTHONPATH $B extract --model $MK --samples 32 --length $LENGTH --batch 16 --tp $TP --work /tmp/kimi1 2>&1 | grep -E 'RESULT|Error' | tail -1"
    # against HF fp32 on the dequantized twin, beside HF's own bf16 forward of it: that model's bf16 floor
    step 90 "PYTHONPATH=$SPEC:$PYTHONPATH $B check --model $MK --samples 4 --work /tmp/kimi1 --bf16-floor 2>&1 | grep RESULT"
    ;;
  data-parallel)  # two GPUs, Ray carried (prepare.py --ray): 2 replicas x TP=1 against 1 replica, 256 x 2048 each
    [ "$GPUS" -ge 2 ] || { echo "SKIPPED: data-parallel needs two GPUs, this machine has $GPUS" | tee -a "$OUT/skipped.txt"; exit 0; }
    [ -d /tmp/ray-site/ray ] || { echo "SKIPPED: Ray not installed (prepare.py --ray, carry p4 and p5)" | tee -a "$OUT/skipped.txt"; exit 0; }
    [ -f $M8/config.json ] || step 60 "$B build --family llama3-8b --path $M8 2>&1 | grep RESULT"
    # 256 x 2048 each: one replica (no Ray), then two (a local Ray, one GPU each); the same model, batch, writer
    step 140 "rm -rf /tmp/d1 && extract --batch 8 --samples 256 --work /tmp/d1; rm -rf /tmp/d1"
    step 200 "rm -rf /tmp/d2 && PYTHONPATH=/tmp/ray-site:\$PYTHONPATH extract --batch 8 --samples 256 --data-parallel-size 2 --work /tmp/d2; rm -rf /tmp/d2"
    ;;
esac
