"""Safetensors files written from tensors' own memory, and their headers read: what a sample file
of ``speculators-0.5`` and a file ``hidden-states serve`` answers with are made of.

Knows nothing of samples, formats or output directories (``formats.speculators_05`` and
``serve.state_files`` name and place the files).
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import BinaryIO

from ... import fp8_states

# torch dtype -> safetensors' name for it: the dtypes a sample file holds (states in the model's dtype)
SAFETENSORS_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "float64": "F64", "int64": "I64",
                      "float8_e4m3fn": "F8_E4M3"}


def safetensors_header(path: Path) -> dict | None:
    """The JSON header of a safetensors file, or None when the file is not one or is cut short
    (its size must be exactly header + the largest tensor end: one small read, no tensor data)."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(8)
            if len(head) < 8:
                return None
            (size,) = struct.unpack("<Q", head)
            if size > 100_000_000:
                return None
            header = json.loads(handle.read(size))
            end = max((entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"),
                      default=0)
            return header if os.fstat(handle.fileno()).st_size == 8 + size + end else None
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return None


def safetensors_json(layout: list[tuple]) -> bytes:
    """A safetensors header's JSON for tensors ``(name, torch dtype, shape)`` laid out one after the
    other in that order from the data's start; a dtype a sample file does not hold is a ValueError."""
    import math

    entries, offset = {}, 0
    for name, dtype, shape in layout:
        known = SAFETENSORS_DTYPES.get(str(dtype).removeprefix("torch."))
        if known is None:
            raise ValueError(f"{name}: {dtype} is not a sample file's dtype ({', '.join(SAFETENSORS_DTYPES)})")
        size = math.prod(shape) * dtype.itemsize
        entries[name] = {"dtype": known, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    return json.dumps(entries, separators=(",", ":")).encode()


def write_safetensors(tensors: dict, handle: BinaryIO) -> None:
    """``tensors`` (contiguous) as one safetensors file, written from their own memory: the header,
    then each tensor's bytes, widest dtype first as safetensors lays them out (each tensor then starts
    aligned to its element size). safetensors' ``save`` builds the whole file in memory first (a copy
    of every byte: 3-4x the writer's time per file, bench/results/cpu-writer-2026-12-02.txt), and its
    ``save_file`` writes through a temporary file of its own naming, which a crash would leave in the
    output directory. An OS error (a full disk) is the ``OSError`` of the write that met it."""
    import torch

    ordered = sorted(tensors.items(), key=lambda item: -item[1].element_size())
    for name, tensor in ordered:
        if not tensor.is_contiguous():
            raise ValueError(f"{name}: not contiguous (written as its memory is laid out)")
    header = safetensors_json([(name, tensor.dtype, list(tensor.shape)) for name, tensor in ordered])
    header += b" " * (-len(header) % 8)  # the format's padding: the data starts 8-byte aligned
    handle.write(struct.pack("<Q", len(header)) + header)
    for _, tensor in ordered:
        handle.write(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))


def stacked_states(states: list):
    """One sample's per-layer ``[T, hidden]`` states as ``[T, n_layers, hidden]``, contiguous: the
    tensor they are columns of, in order, if they are (vllm-native hands over vLLM's own file that
    way: written as it is, no copy), else a stack of them."""
    import torch

    first, count = states[0], len(states)
    tokens, hidden = first.shape
    if tokens > 0 and all(layer.shape == first.shape and layer.dtype == first.dtype
                          and layer.stride() == (count * hidden, 1)
                          and layer.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
                          and layer.storage_offset() == first.storage_offset() + index * hidden
                          for index, layer in enumerate(states)):
        return first.as_strided((tokens, count, hidden), (count * hidden, hidden, 1), first.storage_offset())
    return torch.stack(list(states), dim=1).contiguous()


def state_tensors(states: list, state_dtype: str) -> dict:
    """``hidden_states`` (and FP8's ``hidden_states_scales``) on the host from per-layer states on any
    device: FP8's quantized there first, then copied; a backend's already quantized ones
    (``fp8_states.Quantized``) as they are."""
    if state_dtype == "fp8":
        quantized, scales = fp8_states.quantize(states)
        return {"hidden_states": stacked_states([layer.cpu() for layer in quantized]), fp8_states.SCALES: scales.cpu()}
    return {"hidden_states": stacked_states([layer.cpu() for layer in states])}
