"""The checks of a run's input and output directory before the model loads: the input's first samples
(a bounded peek), the tokens the samples to do make, and the room on the disk for their states."""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import InputError, OutputError, PreflightError
from ..files import TEMP_PREFIX
from ..sizes import human_size
from .preflight import ModelFacts

if TYPE_CHECKING:  # (annotations: the checks of the input's samples are handed its stream)
    from ..inputs.streams import InputStream, Sample

FIRST_LINES = 64  # samples validated before the model loads (a bounded peek); the rest as they stream


def check_first_samples(stream: InputStream, strict_max_len: int | None = None) -> None:
    """Read the first samples ahead and validate them (with ``strict_max_len``: their length too, as
    ``--strict`` asks)."""
    samples = stream.peek(FIRST_LINES)
    if not samples:
        raise PreflightError(f"{stream.path}: no samples")
    for sample in samples:
        if strict_max_len is not None and len(sample.input_ids) > strict_max_len:
            raise InputError(too_long(str(stream.path), sample, strict_max_len))


def too_long(path: str, sample: Sample, max_seq_len: int) -> str:
    return f"{path}:{sample.line}: {len(sample.input_ids)} tokens, more than --max-seq-len {max_seq_len} (--strict)"


def estimate_tokens(stream: InputStream, max_seq_len: int, samples: int | None = None) -> int:
    """The tokens ``samples`` of the input's samples make, as extracted (each cut to ``max_seq_len``),
    at the first samples' mean length; None: the whole input's (``InputStream.expected_samples``: from
    its row count, or a JSONL file's size, at the rate of the rows read so far; conversations as
    tokenized)."""
    first = stream.peek(FIRST_LINES)
    if not first:
        return 0
    count = stream.expected_samples()[0] if samples is None else samples
    return round(count * sum(min(len(s.input_ids), max_seq_len) for s in first) / len(first))


def check_disk(output_dir: Path, tokens: int, facts: ModelFacts, layer_ids: list[int], state_dtype: str = "model"
               ) -> int:
    """Estimated output bytes for ``tokens`` (x layers x hidden x bytes; FP8: 1 byte a state and a
    4-byte scale a token); error when the disk lacks room."""
    fp8 = state_dtype == "fp8"
    per_token = len(layer_ids) * facts.hidden_size * (1 if fp8 else facts.dtype_bytes) + (4 if fp8 else 0)
    estimate = int(tokens * per_token * 1.05)
    free = shutil.disk_usage(output_dir).free
    if estimate > free:
        unwritable = not_writable(output_dir)
        if unwritable:  # a directory nothing can be written to reports no room: say what it is
            raise OutputError(f"--output-dir: {output_dir} is not writable ({unwritable})")
        raise PreflightError(f"--output-dir {output_dir}: about {human_size(estimate)} of hidden states expected, "
                             f"{human_size(free)} free")
    return estimate


def not_writable(directory: Path) -> str | None:
    """Why nothing can be written in ``directory`` (an OSError's words), None when a file can: a file
    is made and removed there, as access() answers yes to root on a filesystem that refuses writes."""
    import os
    import tempfile

    try:
        handle, name = tempfile.mkstemp(prefix=TEMP_PREFIX, dir=directory)
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    os.close(handle)
    os.unlink(name)
    return None
