"""A sample file as ``verify`` reads it, whatever its format: every tensor it holds, its layers as the
trainer reads them, its certificate; and a certificate written into it after the run (``verify
--engine``), the file replaced whole."""
from __future__ import annotations

from pathlib import Path

from .. import fp8_states
from ..certify.certificate import Certificate
from ..files import atomic_write
from ..layer_conventions import SPECULATORS_05


def read_row(name: str, path: Path) -> tuple[list, object, Certificate | None]:
    """A row's written layers (``[T, H]`` each, as the trainer reads them), their FP8 scales (None: not
    FP8) and its certificate."""
    return row_of(name, file_tensors(name, path))


def file_tensors(name: str, path: Path) -> dict:
    """Every tensor one sample file of format ``name`` holds, as stored."""
    if name == SPECULATORS_05:
        from .formats.speculators_05 import read_sample

        return read_sample(path)
    import torch

    return torch.load(path, weights_only=True)


def row_of(name: str, tensors: dict, dequantized: bool = True) -> tuple[list, object, Certificate | None]:
    """:func:`read_row` from a file's ``tensors``; ``dequantized`` False: FP8 layers as stored, an
    ``fp8_states.Quantized`` holding their scales (what a certifier reads)."""
    if name != SPECULATORS_05:
        return list(tensors["hidden_states"]), None, Certificate.from_tensors(tensors)
    states, scales = tensors["hidden_states"], tensors.get(fp8_states.SCALES)
    if scales is None:
        return list(states.unbind(dim=1)), None, Certificate.from_tensors(tensors)
    if not dequantized:
        return fp8_states.Quantized(states.unbind(dim=1), scales), scales, Certificate.from_tensors(tensors)
    return list(fp8_states.dequantize(states, scales).unbind(dim=1)), scales, Certificate.from_tensors(tensors)


def write_certificate(name: str, path: Path, tensors: dict, certificate) -> None:
    """``path`` again with ``certificate``'s tensors beside what it held (every other tensor as it was),
    written whole under a temporary name and renamed over it: a reader meets the old file or the new."""
    held = {**tensors, **certificate.tensors()}
    if name == SPECULATORS_05:
        from .formats.safetensors_files import write_safetensors

        atomic_write(path, lambda handle: write_safetensors({k: v.contiguous() for k, v in held.items()}, handle))
    else:
        import torch

        atomic_write(path, lambda handle: torch.save(held, handle))
