#!/usr/bin/env python3
"""GPU measurements for docs/benchmarks.md (on any CUDA host; each phase also runs on CPU with the
tiny model as a dry run). Each phase prints ``RESULT {json}`` and appends it to
``$OUT/results.jsonl`` when ``OUT`` is set; ``table`` renders them.

    python bench/gpu.py env
    python bench/gpu.py build --family llama3-8b --path /tmp/models/llama3-8b
    python bench/gpu.py build --family kimi-k2-small-int4 --path /tmp/models/kimi-k2-small-int4  # + its -dequantized twin
    python bench/gpu.py matmul
    python bench/gpu.py prefill   --model M --samples 64 --length 2048          # vLLM alone
    python bench/gpu.py prefill   --model M --rows multiturn [--prefix-caching]  # ... on per-turn rows
    python bench/gpu.py hf        --model M --samples 64 --length 2048 --batch 4 # HF baseline
    python bench/gpu.py generator --model M --samples 64 --length 2048 --batch 8 --speculators 0.3.0
    python bench/gpu.py generator --model M --configs 8x2048,32x2048,64x512,8x4096   # one load, a sweep
    python bench/gpu.py extract   --model M --samples 64 --length 2048 --batch 32 [--backend B] [--format F] [--writer-threads N] [--skip-forward-check] [--no-overlap]
    python bench/gpu.py extract   --model M --rows multiturn --batch 32 [--no-shared-prefix]  # per-turn rows
    python bench/gpu.py forward-check --model M                                  # the extractor's preflight alone
    python bench/gpu.py check     --model M --samples 4 [--bf16-floor]           # extractor (and HF bf16) vs HF fp32
    python bench/gpu.py native    --model M --samples 64 --length 2048           # vLLM's extract_hidden_states
    python bench/gpu.py generate  --model M --samples 256 --length 512 --new-tokens 1024 --backend vllm [--eager]
    python bench/gpu.py extract   --model M --rows-file /tmp/g/rows.jsonl --backend vllm-engine --batch 32
    python bench/gpu.py generate  --model M --samples 256 --length 512 --new-tokens 1024 --backend hidden-states [--cuda-graphs]
    python bench/gpu.py table

Layers: speculators' default for the model (2, N/2, N-3, N-1). Token ids: uniform random, seeded.
``--rows multiturn``: speculators 0.9's rows of multi-turn conversations instead (``multiturn_rows``:
``--conversations`` of one system prompt shared by all and ``--turns`` exchanges, one row per
assistant turn holding the whole history, in conversation order).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gpu_clocks import GpuSampler  # noqa: E402  (this folder, first on the path when run)
from provenance import provenance  # noqa: E402

# what the running script was asked to do (its parsed arguments): each record's provenance settings;
# a script that emits through this module (serve.py, steps.py, timeline.py) fills it from its own
SETTINGS: dict = {}


def emit(phase: str, **values) -> dict:
    record = {"phase": phase, **values, "provenance": provenance(SETTINGS)}
    print("RESULT " + json.dumps(record), flush=True)
    if os.environ.get("OUT"):
        with open(Path(os.environ["OUT"]) / "results.jsonl", "a") as handle:
            handle.write(json.dumps(record) + "\n")
    return record


def model_config(model: str) -> dict:
    config = json.loads((Path(model) / "config.json").read_text())
    return config.get("text_config") or config


def default_layers(model: str) -> list[int]:
    from hidden_states.layer_conventions import default_layer_ids

    # a tiny model's defaults can repeat a layer ([2, 3, 3, 5] for 6), which the extractor's CLI refuses
    return sorted(set(default_layer_ids(int(model_config(model)["num_hidden_layers"]))))


def sequences(model: str, samples: int, length: int, seed: int = 0) -> list[list[int]]:
    vocab = int(model_config(model)["vocab_size"])
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(length)] for _ in range(samples)]


def multiturn_rows(model: str, conversations: int, system: int, user: int, assistant: int, turns: int,
                   seed: int = 0) -> list[list[int]]:
    """Per-turn rows as speculators 0.9 writes them (the prefix stages' shape: 64, 500, 100, 300, 4):
    every conversation begins with the same ``system`` tokens, then ``turns`` exchanges of ``user``
    and ``assistant`` tokens; row k of a conversation is its first k exchanges, in conversation order."""
    vocab = int(model_config(model)["vocab_size"])
    rng = random.Random(seed)
    prompt = [rng.randrange(4, vocab) for _ in range(system)]
    rows = []
    for _ in range(conversations):
        history = list(prompt)
        for _ in range(turns):
            history += [rng.randrange(4, vocab) for _ in range(user + assistant)]
            rows.append(list(history))
    return rows


def workload(args, samples: int | None = None, length: int | None = None, seed: int = 0) -> list[list[int]]:
    """The rows a phase runs: ``--rows multiturn``'s, or ``samples`` x ``length`` random tokens."""
    if args.rows == "multiturn":
        return multiturn_rows(args.model, args.conversations, args.system, args.user, args.assistant, args.turns)
    if args.rows_file:  # rows another phase wrote (generate --backend vllm: prompt + reply)
        return [json.loads(line)["input_ids"] for line in Path(args.rows_file).read_text().splitlines()]
    return sequences(args.model, samples or args.samples, length or args.length, seed)


def params(model: str) -> float:
    """Non-embedding parameters, from the checkpoint's tensors (for the 2 x params FLOP/token roofline).
    A packed (compressed-tensors) weight counts as its ``weight_shape``; its scales are not parameters."""
    from safetensors import safe_open

    total = 0
    for file in Path(model).glob("*.safetensors"):
        with safe_open(file, "pt") as handle:
            for name in handle.keys():
                if "embed_tokens" in name or "lm_head" in name or name.endswith(("weight_packed", "weight_scale")):
                    continue
                if name.endswith("weight_shape"):
                    shape = handle.get_tensor(name).tolist()
                else:
                    shape = handle.get_slice(name).get_shape()
                count = 1
                for dim in shape:
                    count *= dim
                total += count
    return total


def phase_env(args) -> None:
    import torch

    info = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.cuda.is_available()}
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    for name in ("vllm", "transformers", "speculators", "vllm_compat"):
        try:
            module = __import__(name)
            info[name] = getattr(module, "__version__", "?")
        except Exception as exc:  # noqa: BLE001 - reported, not fatal
            info[name] = f"import failed: {type(exc).__name__}: {exc}"
    stat = os.statvfs("/dev/shm")
    info["dev_shm_gib"] = round(stat.f_bavail * stat.f_frsize / 2**30, 1)
    emit("env", **info)


def phase_build(args) -> None:
    from hidden_states.fixtures.tiny_model import build

    started = time.monotonic()
    build(args.family, args.path)
    emit("build", family=args.family, seconds=round(time.monotonic() - started, 1),
         params_b=round(params(args.path) / 1e9, 3))


def phase_matmul(args) -> None:
    import torch

    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        a @ b
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1000 / 10
    emit("matmul", tflops=round(2 * n**3 / seconds / 1e12, 1))


def note_timed_span(start: float, seconds: float, tokens: int) -> None:
    """For bench/steps.py (BENCH_STEPS_DIR set): the timed span, on CLOCK_MONOTONIC as its step events."""
    if os.environ.get("BENCH_STEPS_DIR"):
        with open(Path(os.environ["BENCH_STEPS_DIR"]) / f"parent-{os.getpid()}.jsonl", "a") as sink:
            sink.write(json.dumps({"span": [start, start + seconds], "tokens": tokens}) + "\n")


def phase_prefill(args) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    seqs = workload(args)
    longest = max(map(len, seqs))
    started = time.perf_counter()
    llm = LLM(model=args.model, enforce_eager=not args.compiled, max_model_len=longest + 1,
              gpu_memory_utilization=args.gpu_memory_utilization, enable_prefix_caching=args.prefix_caching,
              tensor_parallel_size=args.tp, disable_custom_all_reduce=args.tp > 1)
    load = time.perf_counter() - started
    params_ = SamplingParams(max_tokens=1)
    # the warm-up's random tokens share no block with the rows (its prefix cache holds nothing of theirs)
    llm.generate([TokensPrompt(prompt_token_ids=s) for s in sequences(args.model, 4, longest, seed=1)], params_)
    started, span_start = time.perf_counter(), time.monotonic()
    outputs = llm.generate([TokensPrompt(prompt_token_ids=s) for s in seqs], params_)
    seconds = time.perf_counter() - started
    tokens = sum(map(len, seqs))
    # vLLM's count of prefix-cache hits (None where its request stats are off, as LLM's default leaves them)
    cached = sum(getattr(o, "num_cached_tokens", 0) or 0 for o in outputs) or None
    note_timed_span(span_start, seconds, tokens)
    emit("prefill", model=Path(args.model).name, mode="compiled" if args.compiled else "eager", rows=args.rows,
         prefix_caching=args.prefix_caching, load_seconds=round(load, 1), tp=args.tp, tokens=tokens,
         cached_tokens=cached, seconds=round(seconds, 2), tokens_per_s=round(tokens / seconds))


def phase_hf(args) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    layers = default_layers(args.model)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16, attn_implementation="sdpa").to(device)
    seqs = sequences(args.model, args.samples, args.length)

    def run(batch_seqs):
        with torch.no_grad():
            out = model(torch.tensor(batch_seqs, device=device), output_hidden_states=True)
            kept = [out.hidden_states[layer + 1].to("cpu") for layer in layers]
        if device == "cuda":
            torch.cuda.synchronize()
        return kept

    run(seqs[: args.batch])
    started = time.perf_counter()
    for i in range(0, len(seqs), args.batch):
        run(seqs[i:i + args.batch])
    seconds = time.perf_counter() - started
    emit("hf", model=Path(args.model).name, batch=args.batch, tokens=len(seqs) * args.length,
         seconds=round(seconds, 2), tokens_per_s=round(len(seqs) * args.length / seconds))


def load_generator(args, configs: list[tuple[int, int]]):
    """speculators' generator on ``args.model`` for the longest configured length, and its load time."""
    from speculators.data_generation.vllm_hidden_states_generator import VllmHiddenStatesGenerator

    started = time.perf_counter()
    generator = VllmHiddenStatesGenerator(args.model, layer_ids=default_layers(args.model),
                                          max_model_len=max(length for _, length in configs) + 1,
                                          gpu_memory_utilization=args.gpu_memory_utilization,
                                          tensor_parallel_size=args.tp)
    return generator, time.perf_counter() - started


def sweep(spec: str) -> list[tuple[int, int]]:
    """``--configs "8x2048,32x512"`` -> [(batch, length), ...]; ``""`` -> ``[]``."""
    return [tuple(int(n) for n in item.split("x")) for item in spec.split(",") if item.strip()]


def phase_generator(args) -> None:
    """The unmodified generator through the shim; one model load, then each ``--configs`` entry
    (batch x length, about ``--samples`` x ``--length`` tokens each) timed on its own."""
    import vllm_compat

    report = vllm_compat.apply()  # before speculators is imported (load_generator imports it)
    configs = sweep(args.configs) or [(args.batch, args.length)]
    if args.token_budget:  # an experiment on speculators' own scheduler limit, not a shim setting
        import speculators.data_generation.vllm_hidden_states_generator as module

        module.MIN_MAX_BATCHED_TOKENS = args.token_budget
    generator, load = load_generator(args, configs)
    for batch, length in configs:
        generator.generate(sequences(args.model, batch, length, seed=1))  # grows the transport's segment
        count = max(batch, args.samples * args.length // length // batch * batch)
        seqs = sequences(args.model, count, length)
        started = time.perf_counter()
        tokens = 0
        for i in range(0, len(seqs), batch):
            results = generator.generate(seqs[i:i + batch])
            tokens += sum(r["input_ids"].numel() for r in results)
        seconds = time.perf_counter() - started
        emit("generator", model=Path(args.model).name, speculators=args.speculators_version, batch=batch,
             length=length, tp=args.tp, tokens=tokens, seconds=round(seconds, 2),
             tokens_per_s=round(tokens / seconds), load_seconds=round(load, 1),
             token_budget=generator.vllm_config.scheduler_config.max_num_batched_tokens,
             disabled=os.environ.get("VLLM_COMPAT_DISABLE", ""), keep_freed_host_memory=keep_freed_host_memory(),
             applied=report.applied)
    generator.executor.shutdown()


def phase_native(args) -> None:
    """vLLM's own path: speculative method extract_hidden_states + ExampleHiddenStatesConnector,
    which writes one safetensors file per request. vLLM's layer id L is the *input* of layer L,
    so speculators' layers [2, N/2, N-3, N-1] are vLLM's [3, N/2+1, N-2, N]."""
    import shutil

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    store = Path(args.work) / "native"
    shutil.rmtree(store, ignore_errors=True)
    store.mkdir(parents=True)
    vllm_ids = [layer + 1 for layer in default_layers(args.model)]
    llm = LLM(model=args.model, enforce_eager=True, max_model_len=args.length + 1,
              gpu_memory_utilization=args.gpu_memory_utilization, enable_prefix_caching=False,
              tensor_parallel_size=args.tp, disable_custom_all_reduce=args.tp > 1,
              speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                  "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": vllm_ids}}},
              kv_transfer_config={"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
                                  "kv_connector_extra_config": {"shared_storage_path": str(store)}})
    params_ = SamplingParams(max_tokens=1)
    llm.generate([TokensPrompt(prompt_token_ids=s) for s in sequences(args.model, 2, args.length, seed=1)], params_)
    seqs = sequences(args.model, args.samples, args.length)
    started, span_start = time.perf_counter(), time.monotonic()
    outs = llm.generate([TokensPrompt(prompt_token_ids=s) for s in seqs], params_)
    seconds = time.perf_counter() - started
    note_timed_span(span_start, seconds, len(seqs) * args.length)
    paths = [(o.kv_transfer_params or {}).get("hidden_states_path") for o in outs]
    emit("native", model=Path(args.model).name, tp=args.tp, tokens=len(seqs) * args.length, seconds=round(seconds, 2),
         tokens_per_s=round(len(seqs) * args.length / seconds), files=sum(1 for p in paths if p),
         vllm_layer_ids=vllm_ids)


def keep_freed_host_memory() -> bool:
    """Whether vllm_compat's transport lets the generator's process reuse freed memory (on unless
    ``VLLM_COMPAT_KEEP_FREED_HOST_MEMORY=0``): the before / after switch of the generator-host-memory stage."""
    return os.environ.get("VLLM_COMPAT_KEEP_FREED_HOST_MEMORY", "1") != "0"


def write_jsonl(path: Path, seqs) -> None:
    path.write_text("".join(json.dumps({"input_ids": s}) + "\n" for s in seqs))


def format_layers(args) -> list[int]:
    """The default layers (speculators 0.3's count) as ``--format`` counts them."""
    from hidden_states import layer_conventions

    return layer_conventions.from_extractor(args.format, default_layers(args.model))


def saved_samples(work: Path, count: int) -> list[dict]:
    """The first ``count`` samples of an extraction in ``work/out``, either layout: ``input_ids`` and
    the per-layer states in the extractor's layer order (speculators-0.5's FP8 ones dequantized to
    float32, the values its trainer reads)."""
    import torch

    from hidden_states import fp8_states

    if (work / "out" / "hidden_states").is_dir():
        from safetensors.torch import load_file

        files = sorted((work / "out" / "hidden_states").glob("hs_*.safetensors"), key=lambda p: int(p.stem[3:]))
        samples = []
        for path in files[:count]:
            tensors = load_file(str(path))
            states = tensors["hidden_states"]
            if fp8_states.SCALES in tensors:
                states = fp8_states.dequantize(states, tensors[fp8_states.SCALES])
            samples.append({"input_ids": tensors["token_ids"], "hidden_states": list(states.unbind(dim=1)),
                            "file_dtype": str(tensors["hidden_states"].dtype)})
        return samples
    files = sorted((work / "out").glob("data_*.pt"), key=lambda p: int(p.stem.split("_")[1]))[:count]
    return [{**torch.load(f, weights_only=True), "file_dtype": None} for f in files]


def phase_extract(args) -> None:
    import shutil

    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    seqs = workload(args)
    write_jsonl(work / "data.jsonl", seqs)
    command = [sys.executable, "-m", "hidden_states", "extract", "--model-path", args.model,
               "--prepared-data", str(work / "data.jsonl"), "--output-dir", str(work / "out"),
               "--batch-size", str(args.batch), "--max-seq-len", str(max(map(len, seqs))), "--tp-size", str(args.tp),
               "--gpu-memory-utilization", str(args.gpu_memory_utilization), "--progress-interval", "30",
               "--format", args.format, "--layer-ids", *map(str, format_layers(args)), "--backend", args.backend,
               "--state-dtype", args.state_dtype] \
        + (["--writer-threads", str(args.writer_threads)] if args.writer_threads else []) \
        + (["--skip-forward-check"] if args.skip_forward_check else []) \
        + (["--no-certificates"] if args.no_certificates else []) \
        + (["--no-overlap"] if args.no_overlap else []) \
        + (["--no-shared-prefix"] if args.no_shared_prefix else []) \
        + (["--data-parallel-size", str(args.data_parallel_size)] if args.data_parallel_size > 1 else [])
    proc = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if os.environ.get("BENCH_LOG_DIR"):  # the whole log, workers' tracebacks included (RESULT keeps the tail)
        full = work / "out" / "hidden-states.log"  # the terminal's share is filtered (--log-level)
        Path(os.environ["BENCH_LOG_DIR"], f"extract-{work.name}.log").write_text(
            full.read_text(errors="replace") if full.exists() else proc.stderr)
    summary = next((l for l in proc.stderr.splitlines() if "] done:" in l), None)
    # "forward check ok: N kernel self-tests on the model's own layouts in X s", between the load and the run
    forward = next((l for l in proc.stderr.splitlines() if "] forward check" in l), "")
    forward_seconds = re.search(r"in ([\d.]+) s", forward)
    if proc.returncode != 0 or summary is None:
        emit("extract", error=(proc.stderr[-3000:]), returncode=proc.returncode)
        return
    numbers = dict(tokens=r"([\d,]+) tokens in", seconds=r"in ([\d.]+) s", rate=r"\(([\d,]+) tok/s",
                   load=r"model load ([\d.]+) s", shutdown=r"shutdown ([\d.]+) s", mb=r"([\d,.]+) MB written", stall=r"stall [\d.]+ s \(([\d.]+) %\)")
    found = {k: float(re.search(p, summary).group(1).replace(",", "")) for k, p in numbers.items()}
    # "shared prefixes: R of N rows served from a longer row's states, C tokens computed for T row tokens"
    shared = next((l for l in proc.stderr.splitlines() if "] shared prefixes:" in l), "")
    computed = re.search(r"([\d,]+) tokens computed", shared)
    certified = next((l for l in proc.stderr.splitlines() if "] certificates: " in l and "rows certified" in l), "")
    emit("extract", model=Path(args.model).name, backend=args.backend, format=args.format, state_dtype=args.state_dtype,
         certificates=certified.split("] ", 1)[-1] or "off",
         batch=args.batch, tp=args.tp, bytes_per_token=round(found["mb"] * 1e6 / found["tokens"]),
         overlap=not args.no_overlap, data_parallel_size=args.data_parallel_size, rows=args.rows,
         shared_prefix=not args.no_shared_prefix, shared=shared.split("] ", 1)[-1],
         computed_tokens=int(computed.group(1).replace(",", "")) if computed else int(found["tokens"]),
         tokens=int(found["tokens"]),
         seconds=found["seconds"], tokens_per_s=round(found["rate"]), load_seconds=found["load"],
         shutdown_seconds=found["shutdown"],
         gb_written=round(found["mb"] / 1000, 2), writer_stall_percent=found["stall"],
         forward_check_seconds=float(forward_seconds.group(1)) if forward_seconds else None,
         forward_check=forward.split("] ", 1)[-1], keep_freed_host_memory=keep_freed_host_memory(), summary=summary)


PLAIN_TEMPLATE = "{% for message in messages %}{{ message['content'] }} {% endfor %}"


def with_chat_template(model: str, work: Path) -> str:
    """``model`` as a folder of links to its files beside a plain chat template (the bench checkpoints
    have none; the checkpoint itself is left as it is)."""
    linked = work / "model"
    linked.mkdir()
    for path in Path(model).iterdir():
        (linked / path.name).symlink_to(path.resolve())
    if not (linked / "chat_template.jinja").exists():
        (linked / "chat_template.jinja").write_text(PLAIN_TEMPLATE)
    return str(linked)


def chat_prompts(args, model: str) -> list[str]:
    """``--samples`` user turns of ``--length`` random tokens, as text (the bench checkpoints' word-level
    tokenizer reads a word per token back)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    return [" ".join(tokenizer.convert_ids_to_tokens(ids)) for ids in sequences(model, args.samples, args.length)]


def phase_generate(args) -> None:
    """One pass against two: ``--samples`` prompts of ``--length`` tokens, ``--new-tokens`` each (``ignore_eos``), one call.
    ``--backend vllm``: vLLM's ``LLM.generate`` alone (CUDA graphs unless ``--eager``); the rows (prompt +
    reply) go to ``--work``/rows.jsonl for ``extract --rows-file``. ``--backend hidden-states``: ``hidden-states
    generate`` on the same prompts (the rows' states captured while generating; ``--cuda-graphs``: vLLM
    compiled, with CUDA graphs, the capture inside them), its files in ``--work``/out for ``check``."""
    import shutil

    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    longest = args.length + args.new_tokens + 8
    if args.backend == "hidden-states":
        model = with_chat_template(args.model, work)
        texts = chat_prompts(args, model)
        data = work / "conversations.jsonl"
        data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": t}]}) + "\n" for t in texts))
        command = [sys.executable, "-m", "hidden_states", "generate", "--model-path", model, "--data", str(data),
                   "--output-dir", str(work / "out"), "--batch-size", str(args.batch), "--max-seq-len", str(longest),
                   "--max-new-tokens", str(args.new_tokens), "--ignore-eos", "--temperature", "0",
                   "--tp-size", str(args.tp), "--gpu-memory-utilization", str(args.gpu_memory_utilization),
                   "--progress-interval", "30", "--format", args.format,
                   "--layer-ids", *map(str, format_layers(args)), *(["--cuda-graphs"] if args.cuda_graphs else [])]
        with GpuSampler() as gpu:
            proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT)
            lines, done_at = [], None
            for line in proc.stderr:
                lines.append(line)
                if done_at is None and "] done:" in line:
                    done_at = time.monotonic()
            proc.wait()
        stderr = "".join(lines)
        full = work / "out" / "hidden-states.log"  # vLLM's own lines too (its KV cache, warnings)
        full_log = full.read_text(errors="replace") if full.exists() else stderr
        if os.environ.get("BENCH_LOG_DIR"):
            Path(os.environ["BENCH_LOG_DIR"], f"generate-{work.name}.log").write_text(full_log)
        kv_cache = re.search(r"KV cache size: ([\d,]+) tokens", full_log)
        config = work / "out" / "data_config.json"  # where the states' segment lived (/dev/shm or a disk)
        segment = json.loads(config.read_text()).get("states_segment") if config.exists() else None
        summary = next((l for l in stderr.splitlines() if "] done:" in l), None)
        generated = next((l for l in stderr.splitlines() if "] generate:" in l), "")
        if proc.returncode != 0 or summary is None:
            emit("generate", backend=args.backend, error=stderr[-3000:], returncode=proc.returncode)
            return
        seconds = float(re.search(r"in ([\d.]+) s", summary).group(1))
        new = int(re.search(r"([\d,]+) tokens generated", generated).group(1).replace(",", ""))
        emit("generate", model=Path(args.model).name, backend=args.backend, format=args.format,
             mode="cuda graphs (--cuda-graphs)" if args.cuda_graphs else "eager (engine backends)",
             samples=args.samples, prompt_tokens=args.length, new_tokens=new, seconds=seconds,
             generated_tokens_per_s=round(new / seconds), generate=generated.split("] ", 1)[-1], summary=summary,
             kv_cache_tokens=int(kv_cache.group(1).replace(",", "")) if kv_cache else None,
             streamed_files=os.environ.get("VLLM_COMPAT_STREAM_FILES", "1") != "0", states_segment=segment,
             gpu=gpu.summary(done_at - seconds, done_at))
        return
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    started = time.perf_counter()
    llm = LLM(model=args.model, enforce_eager=args.eager, max_model_len=longest, tensor_parallel_size=args.tp,
              gpu_memory_utilization=args.gpu_memory_utilization, disable_custom_all_reduce=args.tp > 1)
    load = time.perf_counter() - started
    sampling = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    # the ids the chat template renders for those texts (the plain template: the words themselves)
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in sequences(args.model, args.samples, args.length)]
    llm.generate(prompts[:2], SamplingParams(max_tokens=4))  # warm-up
    with GpuSampler() as gpu:
        since = time.monotonic()
        started = time.perf_counter()
        outputs = llm.generate(prompts, sampling)
        seconds = time.perf_counter() - started
        until = time.monotonic()
    rows = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outputs]
    write_jsonl(work / "rows.jsonl", rows)
    new = sum(len(o.outputs[0].token_ids) for o in outputs)
    emit("generate", model=Path(args.model).name, backend="vllm", mode="eager" if args.eager else "cuda graphs",
         samples=args.samples, prompt_tokens=args.length, new_tokens=new, load_seconds=round(load, 1),
         seconds=round(seconds, 2), generated_tokens_per_s=round(new / seconds), rows=str(work / "rows.jsonl"),
         gpu=gpu.summary(since, until))


def phase_forward_check(args) -> None:
    """The extractor's preflight (``hidden_states.forward_check`` through the backend) on its own:
    every kernel self-test with its error, and the check's time on a cold and on a warm call."""
    from hidden_states import backends

    backend = backends.create(args.backend, backends.BackendSettings(
        model_path=args.model, layer_ids=default_layers(args.model), max_seq_len=args.length, tp_size=args.tp,
        gpu_memory_utilization=args.gpu_memory_utilization,
        num_layers=int(model_config(args.model)["num_hidden_layers"])))
    started = time.perf_counter()
    try:
        backend.start()
        load = time.perf_counter() - started
        probe = sequences(args.model, 1, 16, seed=2)[0]  # the extractor's probe is 16 tokens too
        for call in ("cold", "warm"):
            started = time.perf_counter()
            checks = backend.check_forward(probe)
            seconds = time.perf_counter() - started
            emit("forward_check", model=Path(args.model).name, backend=args.backend, tp=args.tp, call=call,
                 seconds=round(seconds, 3), load_seconds=round(load, 1), all_ok=all(c.ok for c in checks),
                 checks=[{"module": c.module, "layout": c.layout, "relative_error": c.error, "ok": c.ok,
                          "untested": c.untested} for c in checks])
    finally:
        backend.close()


def phase_check(args) -> None:
    """The extractor's files for a few samples against HF transformers in fp32 on the GPU. With
    ``--bf16-floor``, HF's own bf16 forward against its fp32 one too: how far bf16 rounding alone
    carries a layer of this (random-weight) model, the yardstick for the extractor's numbers. An
    INT4 checkpoint of ``tiny_model`` is compared with HF on its dequantized twin, both ways."""
    import torch

    from hidden_states.fixtures.reference import decoder_layer_outputs, load_model, relative_errors
    from hidden_states.fixtures.tiny_model import reference_checkpoint

    saved = saved_samples(Path(args.work), args.samples)
    ids = [s["input_ids"].tolist() for s in saved]
    layers = default_layers(args.model)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    checkpoint = reference_checkpoint(args.model)
    hf = load_model(checkpoint, dtype="float32", device=device)
    reference = decoder_layer_outputs(hf, ids, layers)
    del hf
    candidates = {"extractor": [s["hidden_states"] for s in saved]}
    if args.bf16_floor:
        candidates["hf_bf16"] = decoder_layer_outputs(load_model(checkpoint, dtype="bfloat16", device=device), ids, layers)
    for name, states in candidates.items():
        per_layer = [torch.cat([relative_errors(got[j], ref[j]) for got, ref in zip(states, reference)])
                     for j in range(len(layers))]
        emit("check", model=Path(args.model).name, reference=checkpoint.name, candidate=name, samples=len(saved),
             tokens=sum(len(i) for i in ids), layers=layers,
             state_dtype=(saved[0]["file_dtype"] or str(states[0][0].dtype)) if name == "extractor"
             else "torch.bfloat16 (HF forward)",
             max_relative_error=[round(float(e.max()), 4) for e in per_layer],
             mean_relative_error=[round(float(e.mean()), 4) for e in per_layer],
             p99_relative_error=[round(float(e.quantile(0.99)), 4) for e in per_layer],
             share_over_15_percent=[round(float((e > 0.15).float().mean()), 4) for e in per_layer])


def phase_table(args) -> None:
    rows = [json.loads(l) for l in Path(args.results).read_text().splitlines() if l.strip()]
    for row in rows:
        print(row)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("phase", choices=["env", "build", "matmul", "prefill", "hf", "generator", "extract",
                                          "forward-check", "check", "native", "generate", "table"])
    parser.add_argument("--model")
    parser.add_argument("--family")
    parser.add_argument("--path")
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.8)
    parser.add_argument("--speculators-version", default=os.environ.get("SPECULATORS_VERSION", ""))
    parser.add_argument("--work", default="/tmp/bench-extract")
    parser.add_argument("--writer-threads", type=int, help="extract: --writer-threads (default: the extractor's for the backend)")
    parser.add_argument("--backend", default="speculators",
                        choices=["speculators", "vllm-native", "vllm-engine", "vllm", "hidden-states"],
                        help="extract: the extractor's backend; generate: vllm (LLM.generate alone) or hidden-states")
    parser.add_argument("--new-tokens", type=int, default=1024, help="generate: tokens per reply (ignore_eos)")
    parser.add_argument("--eager", action="store_true", help="generate --backend vllm: no CUDA graphs")
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="generate --backend hidden-states: vLLM compiled, with CUDA graphs, the capture inside them")
    parser.add_argument("--rows-file", help="prefill, extract: the rows of a JSONL of input_ids (generate's rows.jsonl)")
    parser.add_argument("--configs", default="", help="generator: batch x length list, e.g. 8x2048,32x512")
    parser.add_argument("--token-budget", type=int, default=0,
                        help="generator: speculators' MIN_MAX_BATCHED_TOKENS (scheduler tokens per step)")
    parser.add_argument("--bf16-floor", action="store_true", help="check: also HF bf16 against HF fp32")
    parser.add_argument("--skip-forward-check", action="store_true", help="extract: pass --skip-forward-check")
    parser.add_argument("--no-overlap", action="store_true", help="extract: pass --no-overlap (one batch at a time)")
    parser.add_argument("--no-certificates", action="store_true", help="extract: pass --no-certificates")
    parser.add_argument("--data-parallel-size", type=int, default=1, help="extract: replicas (Ray), each --tp GPUs")
    parser.add_argument("--format", default="speculators-0.3", help="extract: the output format (check reads either)")
    parser.add_argument("--state-dtype", default="model", choices=["model", "fp8"], help="extract: --state-dtype")
    parser.add_argument("--compiled", action="store_true", help="prefill: vLLM's compiled mode (default: eager)")
    parser.add_argument("--prefix-caching", action="store_true", help="prefill: vLLM's prefix cache on (default: off)")
    parser.add_argument("--no-shared-prefix", action="store_true", help="extract: pass --no-shared-prefix")
    parser.add_argument("--rows", choices=["random", "multiturn"], default="random",
                        help="prefill, extract: --samples x --length random tokens, or multiturn_rows")
    parser.add_argument("--conversations", type=int, default=64, help="multiturn: conversations")
    parser.add_argument("--system", type=int, default=500, help="multiturn: system prompt tokens, shared by all")
    parser.add_argument("--user", type=int, default=100, help="multiturn: tokens of a user turn")
    parser.add_argument("--assistant", type=int, default=300, help="multiturn: tokens of an assistant turn")
    parser.add_argument("--turns", type=int, default=4, help="multiturn: exchanges per conversation (rows each)")
    parser.add_argument("--results", default=os.path.join(os.environ.get("OUT", "."), "results.jsonl"))
    args = parser.parse_args(argv)
    SETTINGS.update(vars(args))
    try:
        globals()[f"phase_{args.phase.replace('-', '_')}"](args)
    except Exception as exc:  # one phase failing must not hide the others' results
        import traceback

        traceback.print_exc()
        emit(args.phase, error=f"{type(exc).__name__}: {exc}"[:2000])
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
