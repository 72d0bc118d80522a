"""Checks that run before any weight is loaded: each failure is one clear message."""
from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from .errors import InputError, PreflightError, UsageError
from .inputs import InputStream, Sample
from .output import read_json

FIRST_LINES = 64  # samples validated before the model loads (a bounded peek); the rest as they stream


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
    return ModelFacts(str(path.resolve()), num_layers, hidden, vocab, _DTYPE_BYTES.get(dtype, 2),
                      "auto_map" in config, int(heads) if heads else None, int(kv_heads) if kv_heads else None)


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


def human_size(size: float) -> str:
    """``size`` bytes in the unit that shows it best (1.5 GB, 310 MB, 12 kB)."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(size) < 1000 or unit == "TB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    raise AssertionError("unreachable")


def default_layer_ids(num_layers: int) -> list[int]:
    """speculators 0.3/0.4's own default (``VllmHiddenStatesGenerator``), entry for entry: layers
    2, N/2 and N-3 (what EAGLE-3 fuses) and N-1 (the target's last state). Its trainer takes every
    entry but the last as the fused input and the last as the target, so it needs all four even where
    two coincide (N = 6: [2, 3, 3, 5]); each layer is captured once and written as often as listed."""
    if num_layers < 3:
        raise UsageError(f"the model has {num_layers} layers; speculators' default layer ids need at least 3: "
                         f"pass --layer-ids")
    return [2, num_layers // 2, num_layers - 3, num_layers - 1]


def check_layer_ids(layer_ids: list[int], num_layers: int, *, given: bool = True) -> None:
    """Given ids (``--layer-ids``) must be distinct (a repeat is taken for a typo); the default may repeat."""
    duplicates = sorted({i for i in layer_ids if layer_ids.count(i) > 1})
    if duplicates and given:
        raise UsageError(f"--layer-ids: {duplicates} given more than once")
    outside = [i for i in layer_ids if not 0 <= i < num_layers]
    if outside:
        raise UsageError(f"--layer-ids: {outside} outside [0, {num_layers - 1}] (the model has {num_layers} layers)")


def check_first_samples(stream: InputStream, strict_max_len: int | None = None) -> float:
    """Read the first samples ahead and validate them (with ``strict_max_len``: their length too, as
    ``--strict`` asks); return the input's bytes per token (for the size estimate; 0 when unknown)."""
    samples = stream.peek(FIRST_LINES)
    if not samples:
        raise PreflightError(f"{stream.path}: no samples")
    for sample in samples:
        if strict_max_len is not None and len(sample.input_ids) > strict_max_len:
            raise InputError(too_long(str(stream.path), sample, strict_max_len))
    return stream.bytes_read / max(sum(len(s.input_ids) for s in samples), 1)


def too_long(path: str, sample: Sample, max_seq_len: int) -> str:
    return f"{path}:{sample.line}: {len(sample.input_ids)} tokens, more than --max-seq-len {max_seq_len} (--strict)"


def check_disk(output_dir: Path, input_path: str, bytes_per_token: float, facts: ModelFacts,
               layer_ids: list[int], max_seq_len: int) -> int:
    """Estimated output bytes (tokens x layers x hidden x bytes); error when the disk lacks room."""
    if not bytes_per_token:
        return 0
    tokens = Path(input_path).stat().st_size / bytes_per_token
    estimate = int(tokens * len(layer_ids) * facts.hidden_size * facts.dtype_bytes * 1.05)
    free = shutil.disk_usage(output_dir).free
    if estimate > free:
        raise PreflightError(f"--output-dir {output_dir}: about {human_size(estimate)} of hidden states expected, "
                             f"{human_size(free)} free")
    return estimate


def check_vllm(consumer_needed: bool = True) -> str:
    """The vllm-compat audit of the installed vLLM (static, no import): problems stop the run."""
    from vllm_compat.audit import AuditError, audit

    try:
        result = audit()
    except AuditError as exc:
        raise PreflightError(f"vLLM: {exc}") from None
    if consumer_needed and result.consumer is None:
        raise PreflightError("speculators is not installed (the speculators backend needs 0.3.x or 0.4.x)")
    if result.problems:
        lines = "\n".join(f"  {f.id}: {f.verdict}: {f.checked} found {f.found} {f.where}" for f in result.problems)
        raise PreflightError(f"vllm-compat audit of vLLM {result.vllm_version} found problems:\n{lines}\n"
                             f"(run `vllm-compat audit` for the whole picture)")
    return f"vLLM {result.vllm_version}, {result.consumer}: audit ok"
