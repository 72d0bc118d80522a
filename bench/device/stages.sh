#!/usr/bin/env bash
# Device side, after bench/device/install.sh: one stage per device call (each under 10 minutes).
# The whole workflow (prepare here, install there, these stages): bench/device/README.md.
#   bash bench/device/stages.sh build       # Llama-3-8B shape into /tmp/models/llama3-8b, and the host copy bench (CPU)
#   bash bench/device/stages.sh speed       # issue 13 after: host copy, timeline, extractor b8/b32 (+ before), check, prefill
#   bash bench/device/stages.sh speed2      # ... the rest: vllm-native b8/b32, compiled prefill, extractor b32 before, timeline before
#   bash bench/device/stages.sh threads     # issue 13 step 3: the extractor with parent_copy_threads (cap 8) b8/b32, off, cap 16
#   bash bench/device/stages.sh overlap     # issue 13: the extractor with overlapped batches b8/b32, and --no-overlap; prefill
#   bash bench/device/stages.sh engine      # issue 13 step 3: --backend vllm-engine b8/b32 (256 x 2048), check, eager prefill, speculators b8
#   bash bench/device/stages.sh engine2     # ... compiled prefill, vllm-native b8/b32 and check, speculators b32, vLLM's native path alone
#   bash bench/device/stages.sh engine3     # ... vllm-engine with its copies on their own stream: b8/b32 (4 writer threads), check, eager prefill
#   bash bench/device/stages.sh dp          # issue 15: 2 replicas x TP=1 (Ray) against 1 replica, 8B shape (two GPUs, Ray carried)
#   bash bench/device/stages.sh smoke       # tiny models: the e2e suite on CUDA (V1 and V2 runners), TP=2
#   bash bench/device/stages.sh moe         # DeepSeek-V3-shaped MoE: rotary kernel, extractor, check vs HF
#   bash bench/device/stages.sh moe-logits  # ... its capture against vLLM's own log-probs; TP=2 on 2 GPUs
#   bash bench/device/stages.sh kimi-int4   # the same shapes as Kimi-K2-Thinking's INT4 checkpoint: build, extractor, check
#   bash bench/device/stages.sh perf1       # Llama-3-8B shape: roofline, extractor (256 x 2048) and check
#   bash bench/device/stages.sh perf2       # ... generator sweep, vllm-native backend, writer alone
#   bash bench/device/stages.sh retest      # ... fork safety after apply(), the vllm-native backend on CUDA
#   bash bench/device/stages.sh budget      # ... the generator under larger scheduler token budgets
#   bash bench/device/stages.sh baselines   # ... vLLM prefill, HF, vLLM native, generator without transport
#   bash bench/device/stages.sh fwdcheck    # ... the extractor's forward check: its time, run with and without, per kernel
#   bash bench/device/stages.sh timeline    # ... where the generator's time goes, parent and worker spans, batch 8 and 32
#   bash bench/device/stages.sh engine4     # ... vllm-engine and vllm-native step by step against vLLM's prefill (bench/steps.py)
#   bash bench/device/stages.sh engine5     # ... after engine4: vllm-native's states, its stacked format, batch 32, compiled prefill
#   bash bench/device/stages.sh engine6     # ... three engine steps submitted ahead, the run's last files written by 8 threads
#   bash bench/device/stages.sh engine7     # ... batches submitted in groups of one engine step: prefill, vllm-engine b32 (check) and b8
#   bash bench/device/stages.sh engine7-native  # ... then vllm-native (both formats) beside vLLM's native path alone, compiled prefill
#   bash bench/device/stages.sh engine8     # ... vLLM's native path alone and vllm-native step by step, vLLM's files in /dev/shm and on disk
#   bash bench/device/stages.sh engine8b    # ... the native path alone with its files in /dev/shm, vllm-native with one writer thread
#   SITE=/tmp/site-0.34.0 TORCH_SITE=/tmp/torch-site bash bench/device/stages.sh release-one  # a new release, one call:
#                                           versions, the 8B checkpoint, the generator with and without extensible_kv_cache,
#                                           prefill, vllm-engine, vllm-native, speculators 0.4.0
#   ... stages.sh release-8b                # that release's eager prefill beside both generators, vllm-engine, vllm-native; each vs HF
#   ... stages.sh release-tiny              # the e2e suite's generator and backend tests on the tiny models (every family)
#   bash bench/device/stages.sh engine9     # ... vllm-native's new defaults (store on disk, 1 writer thread) against the native path alone, twice
#   bash bench/device/stages.sh own-capture # issue 31 item 3: vllm-engine's own capture (no speculators 0.3/0.4 on the path)
#                                           against vLLM's eager prefill, its files vs HF, speculators' capture beside it
#   bash bench/device/stages.sh fp8         # issue 31 item 2: vllm-engine b32 into speculators-0.5, model dtype vs --state-dtype fp8:
#                                           tokens/s and bytes per token (alternating, twice), each against HF fp32
#   bash bench/device/stages.sh prefix      # issue 31: per-turn rows sharing prefixes: eager prefill without and with vLLM's prefix
#                                           cache, the extractor (vllm-engine) serving rows from longer rows (vs HF), and without
#   SPEC09=DIR bash bench/device/stages.sh serve  # issue 32: speculators 0.9's generate-offline-data (SPEC09: a folder holding
#                                           speculators 0.9 and its requirements) at concurrency 32/64/128 against
#                                           hidden-states serve; ... serve-vllm: against vllm serve as speculators' launcher starts it
#   bash bench/device/stages.sh generate    # issue 33: vLLM's graph-mode generation alone, + extract of its rows (two passes),
#                                           hidden-states generate (one pass); 256 x 512 prompts, 1,024 new tokens each
#   bash bench/device/stages.sh generate-graphs  # issue 33 item 3: the same, hidden-states generate --cuda-graphs (the capture
#                                           inside vLLM's CUDA graphs), its files against HF fp32
#   bash bench/device/stages.sh certificates  # certificates' cost: vllm-engine b8 over 128 x 2048, off/on alternating (3 each,
#                                           bench/certificates.py), then hidden-states verify on the last (certified) run
#   bash bench/device/stages.sh certificates-steps  # the same workload off/on step by step (bench/steps.py), then the
#                                           certified run under py-spy (PYSPY=its binary)
#   bash bench/device/stages.sh certificates-kimi  # the Kimi-K2-shaped INT4 MoE (kimi-int4's checkpoint) through vllm-engine
#                                           with certificates on: its "certificates:" lines, then hidden-states verify
# Results: $OUT/results.jsonl (bench/gpu.py), logs in $OUT.
# CPU dry run of a stage (a tiny model, short sequences; README.md): DRY_RUN=1 (or NO_INSTALL=1, on the
# device once this checkout is installed there) skips the install of
# this checkout into $SITE, and M8 / SPEC / LENGTH / VLLM_COMPAT_CACHE / OUT may be set from outside.
set -uo pipefail
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
LENGTH=${LENGTH:-2048}  # tokens per sequence in the speed stages (64 sequences per run)
# step SECONDS COMMAND...: run COMMAND under `timeout`, unless fewer than SECONDS are left of the
# stage's DEADLINE (seconds since the stage began; the device kills a call at 600 s, and a killed
# call returns no output): a skipped or timed-out step is said, and the stage goes on.
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
# /tmp/steps/NAME, archived as $OUT/steps-NAME.tgz (a call brings back at most 8 files)
timed() {
  local name=$1; shift
  rm -rf "/tmp/steps/$name" && mkdir -p "/tmp/steps/$name"
  BENCH_STEPS_DIR=/tmp/steps/$name PYTHONPATH=$PWD/bench/timeline_hook:$PYTHONPATH bash -c "$*"
  tar czf "$OUT/steps-$name.tgz" -C /tmp/steps "$name"
}
export -f extract timed; export B M8 SPEC LENGTH
# issue 31's rows (bench/gpu.py multiturn_rows): 64 conversations, a 500-token system prompt shared by all,
# 4 exchanges of 100 user + 300 assistant tokens, one row per assistant turn (384,000 row tokens)
MT="--rows multiturn --conversations ${CONVERSATIONS:-64} --system ${SYSTEM_TOKENS:-500} --user ${USER_TOKENS:-100} --assistant ${ASSISTANT_TOKENS:-300} --turns 4"
# the first steps of a release's run (release-one, release-generator): the generator of speculators 0.3.0 and
# its files against HF fp32; from 0.34.0 the same without extensible_kv_cache, the fault it prevents
generator_steps() {
    step 100 "rm -rf /tmp/r03 && extract --batch 32 --samples 64 --work /tmp/r03"
    step 60 "PYTHONPATH=$SPEC:\$PYTHONPATH $B check --model $M8 --samples 4 --work /tmp/r03 2>&1 | grep RESULT; rm -rf /tmp/r03"
    if python3 -c "import sys, vllm; from packaging.version import Version; sys.exit(Version(vllm.__version__) < Version('0.34.0'))"; then
      step 60 "rm -rf /tmp/fault && VLLM_COMPAT_DISABLE=extensible_kv_cache timeout 100 bash -c 'extract --batch 32 --samples 64 --work /tmp/fault' | cut -c1-400; rm -rf /tmp/fault"
    fi
}
# issue 33's workload (G: GSAMPLES prompts of GLENGTH tokens, GNEW new tokens each) and its best two passes: vLLM's
# graph-mode generation alone (its rows in /tmp/g/rows.jsonl, left for the stage), then extract (vllm-engine) of them
G="--model $M8 --samples ${GSAMPLES:-256} --length ${GLENGTH:-512} --new-tokens ${GNEW:-1024}${GFORMAT:+ --format $GFORMAT}"
two_passes() {
    [ -f $M8/config.json ] || step 60 "$B build --family llama3-8b --path $M8 2>&1 | grep RESULT"
    step 120 "$B generate $G --backend vllm --work /tmp/g 2>&1 | grep -E 'RESULT|Error' | tail -2"
    step 150 "$B extract --model $M8 --rows-file /tmp/g/rows.jsonl --backend vllm-engine --batch 32${GFORMAT:+ --format $GFORMAT} --work /tmp/gx 2>&1 | grep -E 'RESULT|Error' | tail -2 | cut -c1-900; rm -rf /tmp/gx"
}
case "${1:?stage}" in
  build)  # after install.sh, in the same call: the 8B checkpoint (~35 s) and the host copy bench (CPU, 2-3 min)
    $B env 2>&1 | grep RESULT
    [ -f $M8/config.json ] || $B build --family llama3-8b --path $M8 2>&1 | grep RESULT
    timeout 300 python3 bench/host_copy.py --batches 8,32 --threads default,1 --calls 6 --jsonl "$OUT/results.jsonl" | tee "$OUT/host-copy.txt"
    ;;
  speed)  # issue 13 step 2, after the change: one call, both batch sizes, most important first
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
  speed2)  # issue 13 step 2, the rest
    [ -f $M8/config.json ] || step 60 "$B build --family llama3-8b --path $M8 2>&1 | grep RESULT"
    step 100 "extract --batch 8 --backend vllm-native --work /tmp/n8"
    step 100 "extract --batch 32 --backend vllm-native --work /tmp/n32"
    step 150 "$B prefill --model $M8 --samples 128 --length $LENGTH --compiled 2>&1 | grep RESULT | tail -1"
    step 100 "VLLM_COMPAT_KEEP_FREED_HOST_MEMORY=0 extract --batch 32 --work /tmp/x32-before"
    step 60 "$B check --model $M8 --samples 4 --work /tmp/n8 2>&1 | grep RESULT"
    step 150 "VLLM_COMPAT_KEEP_FREED_HOST_MEMORY=0 PYTHONPATH=$SPEC:$PYTHONPATH python3 bench/timeline.py --model $M8 --configs 8x$LENGTH,32x$LENGTH \
      --samples 64 --length $LENGTH 2>&1 | grep -vE 'INFO|WARNING|Warning|^ +(class|if|wrapper)' > $OUT/timeline-before.txt; grep -E 'RESULT|untimed|GB/s' $OUT/timeline-before.txt"
    step 90 "$B native --model $M8 --length $LENGTH --work /tmp/native-alone 2>&1 | grep RESULT | tail -1"  # vLLM's path alone, files on disk
    ;;
  threads)  # issue 13 step 3: the generator's process gets torch threads back for its copy (parent_copy_threads)
    [ -f $M8/config.json ] || step 60 "$B build --family llama3-8b --path $M8 2>&1 | grep RESULT"
    # one work folder at a time (4 GB each); the adapter's default cap first, then off (before), then 16
    step 100 "rm -rf /tmp/t8 && extract --batch 8 --work /tmp/t8"
    step 100 "rm -rf /tmp/t8-off && VLLM_COMPAT_PARENT_THREADS=0 extract --batch 8 --work /tmp/t8-off; rm -rf /tmp/t8-off"
    step 100 "rm -rf /tmp/t32 && extract --batch 32 --work /tmp/t32; rm -rf /tmp/t32"
    step 100 "rm -rf /tmp/t8-16 && VLLM_COMPAT_PARENT_THREADS=16 extract --batch 8 --work /tmp/t8-16; rm -rf /tmp/t8-16"
    step 60 "PYTHONPATH=$SPEC:$PYTHONPATH $B check --model $M8 --samples 4 --work /tmp/t8 2>&1 | grep RESULT"  # states unchanged
    ;;
  overlap)  # issue 13: batch N+1's forward runs while batch N's states are copied out (hidden_states/backends/overlap.py)
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
  engine)  # issue 13 step 3: --backend vllm-engine (our loop on vLLM's engine, states streamed per step), 256 x 2048 each
    [ -f $M8/config.json ] || step 60 "$B build --family llama3-8b --path $M8 2>&1 | grep RESULT"
    step 100 "rm -rf /tmp/e8 && extract --backend vllm-engine --batch 8 --samples 256 --work /tmp/e8"
    step 60 "PYTHONPATH=$SPEC:$PYTHONPATH $B check --model $M8 --samples 4 --work /tmp/e8 2>&1 | grep RESULT; rm -rf /tmp/e8"
    step 90 "$B prefill --model $M8 --samples 256 --length $LENGTH 2>&1 | grep RESULT | tail -1"  # vLLM alone, eager, same machine
    step 100 "rm -rf /tmp/e32 && extract --backend vllm-engine --batch 32 --samples 256 --work /tmp/e32; rm -rf /tmp/e32"
    step 100 "rm -rf /tmp/e8w && extract --backend vllm-engine --batch 8 --samples 256 --writer-threads 4 --work /tmp/e8w; rm -rf /tmp/e8w"
    step 100 "rm -rf /tmp/s8 && extract --batch 8 --samples 256 --work /tmp/s8; rm -rf /tmp/s8"  # the speculators backend, same run
    ;;
  engine3)  # issue 13: vllm-engine with its copies on a stream of their own (after engine/engine2)
    [ -f $M8/config.json ] || step 60 "$B build --family llama3-8b --path $M8 2>&1 | grep RESULT"
    step 100 "rm -rf /tmp/f8 && extract --backend vllm-engine --batch 8 --samples 256 --writer-threads 4 --work /tmp/f8"
    step 60 "PYTHONPATH=$SPEC:$PYTHONPATH $B check --model $M8 --samples 4 --work /tmp/f8 2>&1 | grep RESULT; rm -rf /tmp/f8"
    step 90 "$B prefill --model $M8 --samples 256 --length $LENGTH 2>&1 | grep RESULT | tail -1"  # vLLM alone, eager, same machine
    step 100 "rm -rf /tmp/f32 && extract --backend vllm-engine --batch 32 --samples 256 --writer-threads 4 --work /tmp/f32; rm -rf /tmp/f32"
    step 100 "rm -rf /tmp/f8d && extract --backend vllm-engine --batch 8 --samples 256 --work /tmp/f8d; rm -rf /tmp/f8d"
    ;;
  engine4)  # issue 13: where vllm-engine's time goes against vLLM's prefill alone (bench/steps.py), and vllm-native on the engine feed
    [ -f $M8/config.json ] || step 60 "$B build --family llama3-8b --path $M8 2>&1 | grep RESULT"
    step 80 "timed prefill '$B prefill --model $M8 --samples 256 --length $LENGTH 2>&1 | grep RESULT | tail -1'"
    step 100 "timed engine-b8 'rm -rf /tmp/g8 && extract --backend vllm-engine --batch 8 --samples 256 --work /tmp/g8; rm -rf /tmp/g8'"
    step 120 "timed native-b8 'rm -rf /tmp/n8 && extract --backend vllm-native --batch 8 --samples 256 --work /tmp/n8'"
    step 90 "$B native --model $M8 --samples 256 --length $LENGTH --work /tmp/native-alone 2>&1 | grep RESULT | tail -1; rm -rf /tmp/native-alone"
    python3 bench/steps.py /tmp/steps/* 2>&1 | tee "$OUT/steps.txt"
    step 100 "timed engine-b32 'rm -rf /tmp/g32 && extract --backend vllm-engine --batch 32 --samples 256 --work /tmp/g32; rm -rf /tmp/g32'"
    python3 bench/steps.py /tmp/steps/* 2>&1 | tee "$OUT/steps.txt"
    ;;
  engine5)  # issue 13, after engine4 on the same machine: vllm-native's states, the stacked format, batch 32; compiled prefill
    [ -f $M8/config.json ] || step 60 "$B build --family llama3-8b --path $M8 2>&1 | grep RESULT"
    step 80 "timed prefill '$B prefill --model $M8 --samples 256 --length $LENGTH 2>&1 | grep RESULT | tail -1'"
    [ -d /tmp/n8 ] && step 60 "$B check --model $M8 --samples 4 --work /tmp/n8 2>&1 | grep RESULT; rm -rf /tmp/n8"
    step 120 "timed native-b8-stacked 'rm -rf /tmp/n8s && extract --backend vllm-native --batch 8 --samples 256 --format speculators-0.5 --work /tmp/n8s; rm -rf /tmp/n8s'"
    step 120 "timed native-b32 'rm -rf /tmp/n32 && extract --backend vllm-native --batch 32 --samples 256 --work /tmp/n32; rm -rf /tmp/n32'"
    step 130 "$B prefill --model $M8 --samples 256 --length $LENGTH --compiled 2>&1 | grep RESULT | tail -1"
    python3 bench/steps.py /tmp/steps/* 2>&1 | tee "$OUT/steps.txt"
    ;;
  engine6)  # issue 13, after engine4/engine5: three engine steps submitted ahead, the last batch written by 8 threads
    [ -f $M8/config.json ] || step 60 "$B build --family llama3-8b --path $M8 2>&1 | grep RESULT"
    step 80 "timed prefill '$B prefill --model $M8 --samples 256 --length $LENGTH 2>&1 | grep RESULT | tail -1'"
    step 90 "timed engine-b8 'rm -rf /tmp/h8 && extract --backend vllm-engine --batch 8 --samples 256 --work /tmp/h8'"
    step 60 "PYTHONPATH=$SPEC:$PYTHONPATH $B check --model $M8 --samples 4 --work /tmp/h8 2>&1 | grep RESULT; rm -rf /tmp/h8"
    step 90 "timed engine-b32 'rm -rf /tmp/h32 && extract --backend vllm-engine --batch 32 --samples 256 --work /tmp/h32; rm -rf /tmp/h32'"
    step 110 "timed native-b8 'rm -rf /tmp/m8 && extract --backend vllm-native --batch 8 --samples 256 --work /tmp/m8; rm -rf /tmp/m8'"
    python3 bench/steps.py /tmp/steps/* 2>&1 | tee "$OUT/steps.txt"
    ;;
  engine7)  # issue 13, after engine6: a batch submitted in step-sized groups (batch 32's tail one step's files, as batch 8's)
    [ -f $M8/config.json ] || step 60 "$B build --family llama3-8b --path $M8 2>&1 | grep RESULT"
    step 80 "timed prefill '$B prefill --model $M8 --samples 256 --length $LENGTH 2>&1 | grep RESULT | tail -1'"
    step 90 "timed engine-b32 'rm -rf /tmp/h32 && extract --backend vllm-engine --batch 32 --samples 256 --work /tmp/h32'"
    step 60 "PYTHONPATH=$SPEC:$PYTHONPATH $B check --model $M8 --samples 4 --work /tmp/h32 2>&1 | grep RESULT; rm -rf /tmp/h32"
    step 90 "timed engine-b8 'rm -rf /tmp/h8 && extract --backend vllm-engine --batch 8 --samples 256 --work /tmp/h8; rm -rf /tmp/h8'"
    python3 bench/steps.py /tmp/steps/* 2>&1 | tee "$OUT/steps.txt"
    ;;
  engine7-native)  # ... on the same machine after engine7: vLLM's native path alone beside --backend vllm-native
                   # (both formats; speculators-0.5 written by our streaming safetensors writer), compiled prefill
    [ -f $M8/config.json ] || step 60 "$B build --family llama3-8b --path $M8 2>&1 | grep RESULT"
    step 100 "$B native --model $M8 --samples 256 --length $LENGTH --work /tmp/native-alone 2>&1 | grep RESULT | tail -1; rm -rf /tmp/native-alone"
    step 110 "timed native-b8 'rm -rf /tmp/m8 && extract --backend vllm-native --batch 8 --samples 256 --work /tmp/m8; rm -rf /tmp/m8'"
    step 110 "timed native-b8-stacked 'rm -rf /tmp/n8s && extract --backend vllm-native --batch 8 --samples 256 --format speculators-0.5 --work /tmp/n8s; rm -rf /tmp/n8s'"
    step 130 "$B prefill --model $M8 --samples 256 --length $LENGTH --compiled 2>&1 | grep RESULT | tail -1"
    python3 bench/steps.py /tmp/steps/* 2>&1 | tee "$OUT/steps.txt"
    ;;
  engine8)  # issue 13, after engine7 (vllm-native 0.85x of vLLM's native path alone on one machine): where the
            # native path's steps go, alone and under the backend, with vLLM's files on disk and in /dev/shm
    [ -f $M8/config.json ] || step 60 "$B build --family llama3-8b --path $M8 2>&1 | grep RESULT"
    step 110 "timed native-alone '$B native --model $M8 --samples 256 --length $LENGTH --work /tmp/na 2>&1 | grep RESULT | tail -1'; rm -rf /tmp/na"
    step 110 "mkdir -p /dev/shm/nstore && timed native-b8 'rm -rf /tmp/m8 && VLLM_COMPAT_NATIVE_STORE=/dev/shm/nstore extract --backend vllm-native --batch 8 --samples 256 --writer-threads 2 --work /tmp/m8; rm -rf /tmp/m8'"
    step 110 "mkdir -p /tmp/nstore && timed native-b8-store-disk 'rm -rf /tmp/m8 && VLLM_COMPAT_NATIVE_STORE=/tmp/nstore extract --backend vllm-native --batch 8 --samples 256 --writer-threads 2 --work /tmp/m8; rm -rf /tmp/m8'"
    python3 bench/steps.py /tmp/steps/* 2>&1 | tee "$OUT/steps.txt"
    ;;
  engine8b)  # ... the next call: vLLM's native path alone with its files in /dev/shm; the backend with one writer thread
    [ -f $M8/config.json ] || step 60 "$B build --family llama3-8b --path $M8 2>&1 | grep RESULT"
    step 110 "timed native-alone-shm '$B native --model $M8 --samples 256 --length $LENGTH --work /dev/shm/na 2>&1 | grep RESULT | tail -1'; rm -rf /dev/shm/na"
    step 110 "mkdir -p /dev/shm/nstore && timed native-b8-w1 'rm -rf /tmp/m8 && VLLM_COMPAT_NATIVE_STORE=/dev/shm/nstore extract --backend vllm-native --batch 8 --samples 256 --writer-threads 1 --work /tmp/m8; rm -rf /tmp/m8'"
    step 110 "timed native-alone-2 '$B native --model $M8 --samples 256 --length $LENGTH --work /tmp/na 2>&1 | grep RESULT | tail -1'; rm -rf /tmp/na"
    python3 bench/steps.py /tmp/steps/* 2>&1 | tee "$OUT/steps.txt"
    ;;
  engine9)  # issue 13, after engine8 (vllm-native's store back on disk, 1 writer thread): the new defaults against
            # vLLM's native path alone, twice each, alternating (the path is host-bound: runs differ by 6 %)
    [ -f $M8/config.json ] || step 60 "$B build --family llama3-8b --path $M8 2>&1 | grep RESULT"
    for round in 1 2; do
      step 100 "timed native-alone-$round '$B native --model $M8 --samples 256 --length $LENGTH --work /tmp/na 2>&1 | grep RESULT | tail -1'; rm -rf /tmp/na"
      step 100 "timed native-b8-$round 'rm -rf /tmp/m8 && extract --backend vllm-native --batch 8 --samples 256 --work /tmp/m8; rm -rf /tmp/m8'"
    done
    python3 bench/steps.py /tmp/steps/* 2>&1 | tee "$OUT/steps.txt"
    ;;
  serve|serve-vllm)  # issue 32: the same rows (each run its own, never repeated), layers and client call (speculators 0.9's generate-offline-data at
          # concurrency 32, 64, 128, then a second job's first file on the warm server) against hidden-states serve
          # (serve) and, in the next call, against vllm serve with extract_hidden_states as speculators'
          # scripts/launch_vllm.py configures it (serve-vllm); row tokens/s at the client. VLLM_SHIM=1: the shim's
          # worker adapters in vllm serve's processes (the CPU dry run: vLLM's CPU connector needs one)
    [ -n "${SPEC09:-}" ] || { echo "SKIPPED: SPEC09 (a folder holding speculators 0.9 and its requirements) is not set" | tee -a "$OUT/skipped.txt"; exit 0; }
    [ -f $M8/config.json ] || step 60 "$B build --family llama3-8b --path $M8 2>&1 | grep RESULT"
    SERVER=hidden-states; [ "$1" = serve-vllm ] && SERVER=vllm
    step 300 "python3 bench/serve.py --server $SERVER --model $M8 --spec09 $SPEC09 --samples ${SAMPLES:-512} --length $LENGTH \
      --concurrency ${CONCURRENCY:-32,64,128} ${VLLM_SHIM:+--shim} ${ENGINE_TOKENS:+--engine-tokens $ENGINE_TOKENS} ${CLIENT_PYTHON:+--client-python $CLIENT_PYTHON} 2>&1 | grep -E 'RESULT|Error|exited' | cut -c1-800"
    ;;
  prefix)  # issue 31 item 1, one call: vLLM's eager prefill of the per-turn rows in conversation order, without and
           # with its prefix cache (which computes no states for the tokens it caches), then the extractor on the
           # same rows: rows that begin a longer row of their batch are written from its states (batch 32: eight whole
           # conversations a batch), the system prompt's rows taken from vLLM's prefix cache once per submitted group;
           # its files against HF fp32 (rows 0-7: 0-2 served from 3, 4-6 from 7, whose system prompt came from the cache);
           # then --no-shared-prefix
    [ -f $M8/config.json ] || step 60 "$B build --family llama3-8b --path $M8 2>&1 | grep RESULT"
    step 70 "$B prefill --model $M8 $MT 2>&1 | grep RESULT | tail -1"
    step 70 "$B prefill --model $M8 $MT --prefix-caching 2>&1 | grep RESULT | tail -1"
    step 100 "rm -rf /tmp/p32 && extract --backend vllm-engine --batch 32 $MT --work /tmp/p32"
    step 90 "$B check --model $M8 --samples 8 --work /tmp/p32 2>&1 | grep RESULT; rm -rf /tmp/p32"
    # the first run's writer stalled 77 % (2026-12-03, CPUs shared): the same with twice the writer threads
    step 100 "rm -rf /tmp/p32w && extract --backend vllm-engine --batch 32 $MT --writer-threads 8 --work /tmp/p32w; rm -rf /tmp/p32w"
    step 100 "rm -rf /tmp/p32n && extract --backend vllm-engine --batch 32 $MT --no-shared-prefix --work /tmp/p32n; rm -rf /tmp/p32n"
    ;;
  prefix-writer)  # issue 31 item 1 after the sixth session (2.15x with the writer growing one thread per interval,
                  # 2.99x with 8 threads from the start): vLLM's prefix-cached prefill (the ceiling, same call), the
                  # extractor with the doubling writer (the default), then with 16 writer threads from the start
    [ -f $M8/config.json ] || step 60 "$B build --family llama3-8b --path $M8 2>&1 | grep RESULT"
    step 70 "$B prefill --model $M8 $MT 2>&1 | grep RESULT | tail -1"  # the target's denominator, in this call
    step 70 "$B prefill --model $M8 $MT --prefix-caching 2>&1 | grep RESULT | tail -1"
    step 100 "rm -rf /tmp/p32 && extract --backend vllm-engine --batch 32 $MT --work /tmp/p32; rm -rf /tmp/p32"
    step 100 "rm -rf /tmp/p32x && extract --backend vllm-engine --batch 32 $MT --writer-threads 16 --work /tmp/p32x; rm -rf /tmp/p32x"
    ;;
  generate)  # issue 33 item 3, 8B shape: 256 prompts of 512 tokens, 1,024 new tokens each (ignore_eos), one call:
             # vLLM's generation alone in graph mode (and eager), then extract (vllm-engine) of the rows it made:
             # the best two passes; then hidden-states generate on the same prompts (one pass, eager engine backend:
             # generate-graphs runs it with --cuda-graphs). GSAMPLES / GLENGTH / GNEW shrink it for the CPU dry run.
    two_passes
    step 200 "$B generate $G --backend hidden-states --batch ${GSAMPLES:-256} --work /tmp/gh 2>&1 | grep -E 'RESULT|Error' | tail -2 | cut -c1-1200; rm -rf /tmp/gh"
    step 120 "$B generate $G --backend vllm --eager --work /tmp/ge 2>&1 | grep -E 'RESULT|Error' | tail -2; rm -rf /tmp/ge /tmp/g"
    ;;
  generate-graphs)  # issue 33 item 3 (one pass <= 0.75x the best two passes), 8B shape, the generate stage's workload in one
                    # call: vLLM's graph-mode generation alone, extract (vllm-engine) of the rows it made (the best two
                    # passes: the sum), hidden-states generate --cuda-graphs on the same prompts (one pass, the capture's
                    # copies inside vLLM's compiled forward and CUDA graphs), its first rows' files against HF fp32.
                    # GSAMPLES / GLENGTH / GNEW shrink it for the CPU dry run; ONE_PASS=1: the one pass and its
                    # check only (the two passes measured in an earlier call); TWO_PASSES=1: the two passes only;
                    # GFORMAT: the output format of both (default bench/gpu.py's, speculators-0.3)
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
  release-one)  # one call for a release (most important first): the generator with the shim and its files vs HF,
                # from 0.34.0 the same without extensible_kv_cache (the fault), eager prefill, vllm-engine (vs HF),
                # vllm-native, speculators 0.4.0
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
  own-capture)  # issue 31 item 3: --backend vllm-engine without speculators 0.3/0.4 on the path (a speculators 0.9
                # user: SPEC09, a folder holding speculators 0.9, where one was carried; else none), so its own capture,
                # alternating with vLLM's eager prefill over the same 256 x $LENGTH tokens; its files against HF fp32;
                # speculators 0.3.0's capture beside it (VLLM_COMPAT_ENGINE_CAPTURE=speculators, SPEC on the path)
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
  release-generator)  # release-one's first steps alone: the generator (speculators 0.3.0) and its files vs HF, the fault
    generator_steps
    ;;
  release-8b)  # the release's eager prefill beside each way to extract, 128 x 2048 each, each one's files against HF fp32;
               # what no earlier call of the release ran first (RELEASE_8B_ORDER, default engine native s04 s03)
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
  release-tiny)  # the e2e suite on the tiny models: both generators on every family, both engine backends
    # (Model Runner V2 is the only runner from 0.34.0: its runner-v2 cases repeat the default ones there)
    K=${K:-not runner-v2}
    # the whole output into the file as it comes (-v: each test's outcome as it ends; live_failures: each
    # failure's report in $OUT/failures.txt at once), so a stage cut short keeps what ran and why it failed
    # and each CLI run's whole stderr in $OUT/stderr (an engine that fails to start names its cause there)
    step 420 "E2E_STDERR_DIR=$OUT/stderr PYTHONPATH=$PWD/bench/device:\$PYTHONPATH python3 -m pytest -v -rA -p no:cacheprovider -p live_failures -m 'not faults' tests/e2e/test_generator.py tests/e2e/test_backends.py -k '$K' 2>&1 | tee $OUT/tiny-pytest.txt | tail -40"
    ;;
  engine2)  # issue 13: the rest of the same comparison
    [ -f $M8/config.json ] || step 60 "$B build --family llama3-8b --path $M8 2>&1 | grep RESULT"
    step 130 "$B prefill --model $M8 --samples 256 --length $LENGTH --compiled 2>&1 | grep RESULT | tail -1"
    step 100 "rm -rf /tmp/n8 && extract --backend vllm-native --batch 8 --samples 256 --work /tmp/n8"
    step 60 "$B check --model $M8 --samples 4 --work /tmp/n8 2>&1 | grep RESULT; rm -rf /tmp/n8"
    step 100 "rm -rf /tmp/n32 && extract --backend vllm-native --batch 32 --samples 256 --work /tmp/n32; rm -rf /tmp/n32"
    step 100 "rm -rf /tmp/s32 && extract --batch 32 --samples 256 --work /tmp/s32; rm -rf /tmp/s32"
    step 90 "$B native --model $M8 --samples 256 --length $LENGTH --work /tmp/native-alone 2>&1 | grep RESULT | tail -1; rm -rf /tmp/native-alone"
    ;;
  dp)  # issue 15, on nvidia-h200-x2 after install.sh with Ray carried (prepare.py --ray): 2 replicas x TP=1 against 1
    [ "$GPUS" -ge 2 ] || { echo "SKIPPED: dp needs two GPUs, this machine has $GPUS" | tee -a "$OUT/skipped.txt"; exit 0; }
    [ -d /tmp/ray-site/ray ] || { echo "SKIPPED: Ray not installed (prepare.py --ray, carry p4 and p5)" | tee -a "$OUT/skipped.txt"; exit 0; }
    [ -f $M8/config.json ] || step 60 "$B build --family llama3-8b --path $M8 2>&1 | grep RESULT"
    # 256 x 2048 each: one replica (no Ray), then two (a local Ray, one GPU each); the same model, batch, writer
    step 140 "rm -rf /tmp/d1 && extract --batch 8 --samples 256 --work /tmp/d1; rm -rf /tmp/d1"
    step 200 "rm -rf /tmp/d2 && PYTHONPATH=/tmp/ray-site:\$PYTHONPATH extract --batch 8 --samples 256 --data-parallel-size 2 --work /tmp/d2; rm -rf /tmp/d2"
    ;;
  smoke)
    $B env
    timeout 420 python3 -m pytest -x -q tests/e2e/test_generator.py -k "llama" -p no:cacheprovider 2>&1 | tail -25 | tee "$OUT/smoke-pytest.txt"
    if [ "$GPUS" -ge 2 ]; then
      PYTHONPATH=$SPEC:$PYTHONPATH $B extract --model /tmp/vcache/models/llama --samples 16 --length 1000 --batch 8 --tp 2 --gpu-memory-utilization 0.3 --work /tmp/tp2 2>&1 | grep -E "RESULT|Error" | tail -3
      PYTHONPATH=$SPEC:$PYTHONPATH $B check --model /tmp/vcache/models/llama --samples 16 --work /tmp/tp2 2>&1 | grep RESULT
    fi
    ;;
  moe)
    M=/tmp/models/deepseek-v3-small
    $B env
    # this model has plain RoPE: MLA's 3-D q_pe goes through forward_cuda's kernel in eager mode
    python3 bench/rotary_kernel.py 2>&1 | grep -E "^\||Error" | tee "$OUT/rotary-kernel.txt"
    $B build --family deepseek-v3-small --path $M 2>&1 | grep RESULT
    PYTHONPATH=$SPEC:$PYTHONPATH $B extract --model $M --samples 32 --batch 16 --work /tmp/moe1 2>&1 | grep -E "RESULT" | tail -1
    # against HF fp32, beside HF's own bf16 forward against the same: the bf16 floor of this model
    PYTHONPATH=$SPEC:$PYTHONPATH $B check --model $M --samples 4 --work /tmp/moe1 --bf16-floor 2>&1 | grep RESULT
    ;;
  certificates)  # what certificates cost on the GPU (bench/certificates.py): --backend vllm-engine batch 8 over
                 # ${CSAMPLES:-128} x $LENGTH, off/on alternating, ${CREPEATS:-3} runs each, one process (one model load) per run,
                 # its record appended to $OUT/results.jsonl; then hidden-states verify on the last run's files (certified)
    [ -f $M8/config.json ] || step 60 "$B build --family llama3-8b --path $M8 2>&1 | grep RESULT"
    step 300 "PYTHONPATH=$SPEC:\$PYTHONPATH python3 bench/certificates.py --model $M8 --samples ${CSAMPLES:-128} --length $LENGTH \
      --batch 8 --repeats ${CREPEATS:-3} --gpu-memory-utilization 0.85 --out $OUT/results.jsonl 2>&1 | tee $OUT/certificates.txt | cut -c1-900"
    grep -h "certificates:" "$OUT/extract-bench-certificates.log" 2>/dev/null | cut -c1-600 | tee "$OUT/certificates-log.txt"
    step 120 "python3 -m hidden_states verify /tmp/bench-certificates/out 2>&1 | tee $OUT/verify.txt | tail -20 | cut -c1-600"
    ;;
  certificates-steps)  # where certificates' cost goes: the certificates stage's workload (vllm-engine b8 over
                       # ${CSAMPLES:-128} x $LENGTH), off then on, each step timed (bench/steps.py: steps, tokens and
                       # requests per step, the GPU idle between them), then the certified run once more under py-spy
                       # (PYSPY: its binary; the parent's and the engine core's Python stacks, raw, for flame graphs)
    [ -f $M8/config.json ] || step 60 "$B build --family llama3-8b --path $M8 2>&1 | grep RESULT"
    rm -rf /tmp/steps
    step 100 "timed off 'rm -rf /tmp/c0 && extract --backend vllm-engine --batch 8 --samples ${CSAMPLES:-128} --no-certificates --work /tmp/c0; rm -rf /tmp/c0'"
    step 100 "timed on 'rm -rf /tmp/c1 && extract --backend vllm-engine --batch 8 --samples ${CSAMPLES:-128} --work /tmp/c1; rm -rf /tmp/c1'"
    python3 bench/steps.py /tmp/steps/off /tmp/steps/on 2>&1 | tee "$OUT/steps.txt"
    PYSPY=${PYSPY:-$PWD/.gpu-tools/py-spy}
    [ -x "$PYSPY" ] && step 150 "rm -rf /tmp/c2 && $PYSPY record --subprocesses --nonblocking -r 50 --format raw -o $OUT/certified.pyspy.txt -- \
      $B extract --model $M8 --samples ${CSAMPLES:-128} --length $LENGTH --backend vllm-engine --batch 8 --work /tmp/c2 2>&1 | grep -E 'RESULT|Error' | tail -2 | cut -c1-600; rm -rf /tmp/c2"
    ;;
  certificates-kimi)  # the Kimi-K2-shaped INT4 MoE (kimi-int4's checkpoint, built here if absent) through --backend
                      # vllm-engine, certificates on, 32 x $LENGTH batch 16: its "certificates:" lines, then verify
    KIMI=${KIMI:-kimi-k2-small-int4}
    MK=/tmp/models/$KIMI
    [ -f $MK/config.json ] || step 240 "PYTHONPATH=${BUILD_SITE:-/tmp/build-site}:\$PYTHONPATH $B build --family $KIMI --path $MK 2>&1 | grep -E 'RESULT|Error'"
    step 200 "PYTHONPATH=$SPEC:\$PYTHONPATH $B extract --model $MK --backend vllm-engine --samples 32 --length $LENGTH --batch 16 \
      --work /tmp/kimi-cert 2>&1 | grep -E 'RESULT|Error' | tail -1 | cut -c1-1500"
    grep -h "certificates:" "$OUT/extract-kimi-cert.log" 2>/dev/null | cut -c1-600 | tee "$OUT/certificates-kimi.txt"
    step 120 "python3 -m hidden_states verify /tmp/kimi-cert/out 2>&1 | tee $OUT/verify-kimi.txt | tail -20 | cut -c1-600"
    ;;
  kimi-int4)  # issue 16: Kimi-K2 routing and RoPE, INT4 routed experts (compressed-tensors pack-quantized, group 32).
    # The build runs with compressed-tensors 0.17 (its checkpoint converters, BUILD_SITE from install.sh),
    # vLLM with the 0.15.0.1 it pins. KIMI: another family of tiny_model.QUANTIZED, e.g.
    # kimi_k2_int4_dense for the CPU dry run; TP: 2 on nvidia-h200-x2.
    KIMI=${KIMI:-kimi-k2-small-int4}
    MK=/tmp/models/$KIMI
    TP=${TP:-1}
    step 240 "PYTHONPATH=${BUILD_SITE:-/tmp/build-site}:$PYTHONPATH $B build --family $KIMI --path $MK 2>&1 | grep -E 'RESULT|Error'"  # and $MK-dequantized, HF's reference
    step 150 "PYTHONPATH=$SPEC:$PYTHONPATH $B extract --model $MK --samples 32 --length $LENGTH --batch 16 --tp $TP --work /tmp/kimi1 2>&1 | grep -E 'RESULT|Error' | tail -1"
    # against HF fp32 on the dequantized twin, beside HF's own bf16 forward of it: that model's bf16 floor
    step 90 "PYTHONPATH=$SPEC:$PYTHONPATH $B check --model $MK --samples 4 --work /tmp/kimi1 --bf16-floor 2>&1 | grep RESULT"
    ;;
  moe-logits)  # the capture against vLLM's own forward (eager, as the generator runs; then compiled) and HF's
    M=/tmp/models/deepseek-v3-small
    for mode in --eager ""; do
      LOGITS_CHECK_GPU_MEMORY=0.5 timeout 240 python3 bench/logits_check.py --output-dir /tmp/moe1/out --samples 4 --hf $mode 2>&1 | grep -E "^\||^vLLM|Error" | tee -a "$OUT/moe-logits.txt"
    done
    if [ "$GPUS" -ge 2 ]; then
      PYTHONPATH=$SPEC:$PYTHONPATH $B extract --model $M --samples 32 --batch 16 --tp 2 --work /tmp/moe2 2>&1 | grep -E "RESULT" | tail -1
      PYTHONPATH=$SPEC:$PYTHONPATH $B check --model $M --samples 4 --work /tmp/moe2 2>&1 | grep RESULT
    fi
    ;;
  perf1)  # the 8B model: the extractor over 256 x 2048 tokens (8 calls of 32) and its check
    M=/tmp/models/llama3-8b
    $B build --family llama3-8b --path $M 2>&1 | grep RESULT
    $B matmul | grep RESULT
    PYTHONPATH=$SPEC:$PYTHONPATH $B extract --model $M --batch 32 --samples 256 --work /tmp/x256 2>&1 | grep RESULT
    PYTHONPATH=$SPEC:$PYTHONPATH $B check --model $M --samples 4 --work /tmp/x256 --bf16-floor 2>&1 | grep RESULT
    rm -rf /tmp/x256
    ;;
  perf2)  # the generator over batch sizes and lengths (one load), the vllm-native backend, the writer alone
    M=/tmp/models/llama3-8b
    PYTHONPATH=$SPEC:$PYTHONPATH $B generator --model $M --configs 8x2048,32x2048,128x512,32x1024,4x4096 --speculators-version 0.3.0 2>&1 | grep RESULT
    $B extract --model $M --batch 32 --samples 64 --backend vllm-native --work /tmp/native 2>&1 | grep RESULT
    rm -rf /tmp/native
    python3 bench/writer.py --dir /tmp --samples 32 | tee "$OUT/writer.txt"
    ;;
  retest)  # fork safety after apply(); the vllm-native backend on CUDA and its check
    M=/tmp/models/llama3-8b
    python3 bench/fork_safety.py | tee "$OUT/fork-safety.txt"
    $B build --family llama3-8b --path $M 2>&1 | grep RESULT
    $B extract --model $M --batch 32 --samples 64 --backend vllm-native --work /tmp/native 2>&1 | grep RESULT
    $B check --model $M --samples 4 --work /tmp/native 2>&1 | grep RESULT
    ;;
  budget)  # the generator at speculators' scheduler budget (8,192 tokens per step) and larger ones
    M=/tmp/models/llama3-8b
    for budget in 8192 16384 32768; do
      PYTHONPATH=$SPEC:$PYTHONPATH $B generator --model $M --configs 8x2048,32x2048 --token-budget $budget --speculators-version 0.3.0 2>&1 | grep RESULT
    done
    ;;
  baselines)  # the same model and samples through vLLM alone, HF, vLLM's native path, and without the transport
    M=/tmp/models/llama3-8b
    $B prefill --model $M 2>&1 | grep -E "RESULT" | tail -1
    $B hf --model $M --batch 4 2>&1 | grep RESULT
    $B native --model $M 2>&1 | grep -E "RESULT" | tail -1
    PYTHONPATH=$SPEC:$PYTHONPATH VLLM_COMPAT_DISABLE=capture_transport $B generator --model $M --batch 8 --speculators-version 0.3.0 2>&1 | grep RESULT
    ;;
  fwdcheck)  # the extractor's preflight forward check (issue 19): its share of a run, each kernel's error
    M=/tmp/models/llama3-8b
    $B env 2>&1 | grep RESULT
    [ -f $M/config.json ] || $B build --family llama3-8b --path $M 2>&1 | grep RESULT
    for flag in "" --skip-forward-check; do  # the same 32 x 2048 tokens, one model load each
      PYTHONPATH=$SPEC:$PYTHONPATH $B extract --model $M --batch 8 --samples 32 --work /tmp/fwd$flag $flag 2>&1 | grep RESULT
    done
    PYTHONPATH=$SPEC:$PYTHONPATH $B forward-check --model $M 2>&1 | grep -E "RESULT|Error"
    PYTHONPATH=$SPEC:$PYTHONPATH $B check --model $M --samples 4 --work /tmp/fwd 2>&1 | grep RESULT
    ;;
  timeline)  # issue 13 step 1: the generator's time per step and per call (bench/timeline.py), before changes
    M=/tmp/models/llama3-8b
    $B env 2>&1 | grep RESULT
    [ -f $M/config.json ] || $B build --family llama3-8b --path $M 2>&1 | grep RESULT
    PYTHONPATH=$SPEC:$PYTHONPATH timeout 420 python3 bench/timeline.py --model $M --configs 8x2048,32x2048 \
      --samples 64 --length 2048 2>&1 | tee "$OUT/timeline-full.log" | grep -vE "INFO|WARNING|Warning|^ +(class|if|wrapper)" | tee "$OUT/timeline.txt"
    ;;
  fp8)  # issue 31 item 2: FP8 states (quantized in vllm-engine's worker) against the model's bf16, same 64 x $LENGTH
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
esac
