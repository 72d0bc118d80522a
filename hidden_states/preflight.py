"""Checks that run before any weight is loaded: each failure is one clear message."""
from __future__ import annotations

import itertools
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from .errors import PreflightError, UsageError
from .inputs import read_samples

FIRST_LINES = 64  # samples validated up front; the rest are validated as they stream


@dataclass(frozen=True)
class ModelFacts:
    path: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    dtype_bytes: int
    remote_code: bool


_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def model_facts(model_path: str) -> ModelFacts:
    path = Path(model_path)
    if not path.is_dir():
        raise UsageError(f"--model-path {model_path}: no such directory (a local checkpoint is needed)")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise UsageError(f"--model-path {model_path}: no config.json there")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise PreflightError(f"{config_file}: unreadable ({exc})") from None
    text = config.get("text_config") or config
    try:
        num_layers = int(text["num_hidden_layers"])
        hidden = int(text["hidden_size"])
        vocab = int(text.get("vocab_size") or config["vocab_size"])
    except (KeyError, TypeError, ValueError) as exc:
        raise PreflightError(f"{config_file}: cannot read {exc} (num_hidden_layers, hidden_size, vocab_size)") from None
    dtype = str(text.get("torch_dtype") or text.get("dtype") or config.get("torch_dtype") or "bfloat16")
    return ModelFacts(str(path.resolve()), num_layers, hidden, vocab, _DTYPE_BYTES.get(dtype, 2),
                      "auto_map" in config)


def default_layer_ids(num_layers: int) -> list[int]:
    """speculators' default: layers 2, N/2, N-3 (EAGLE-3 fusion) and N-1 (the target's last state);
    for very small models, where those coincide, each layer once."""
    return sorted({2, num_layers // 2, num_layers - 3, num_layers - 1})


def check_layer_ids(layer_ids: list[int], num_layers: int) -> None:
    duplicates = sorted({i for i in layer_ids if layer_ids.count(i) > 1})
    if duplicates:
        raise UsageError(f"--layer-ids: {duplicates} given more than once")
    outside = [i for i in layer_ids if not 0 <= i < num_layers]
    if outside:
        raise UsageError(f"--layer-ids: {outside} outside [0, {num_layers - 1}] (the model has {num_layers} layers)")


def check_input(path: str, vocab_size: int) -> float:
    """Validate the first samples; return the input's bytes per token (for the size estimate)."""
    samples = list(itertools.islice(read_samples(path, vocab_size), FIRST_LINES))
    if not samples:
        raise PreflightError(f"{path}: no samples")
    source = Path(path)
    if source.is_dir():
        return 0.0
    tokens = sum(len(s.input_ids) for s in samples)
    with source.open("rb") as handle:
        head = sum(len(line) for line in itertools.islice(handle, samples[-1].line))
    return head / max(tokens, 1)


def check_disk(output_dir: Path, input_path: str, bytes_per_token: float, facts: ModelFacts,
               layer_ids: list[int], max_seq_len: int) -> int:
    """Estimated output bytes (tokens x layers x hidden x bytes); error when the disk lacks room."""
    if not bytes_per_token:
        return 0
    tokens = Path(input_path).stat().st_size / bytes_per_token
    estimate = int(tokens * len(layer_ids) * facts.hidden_size * facts.dtype_bytes * 1.05)
    free = shutil.disk_usage(output_dir).free
    if estimate > free:
        raise PreflightError(f"--output-dir {output_dir}: about {estimate / 1e9:.1f} GB of hidden states expected, "
                             f"{free / 1e9:.1f} GB free")
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
