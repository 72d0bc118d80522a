"""Tokenized training samples, streamed (never loaded whole), each validated where it is read.

Two sources, both what speculators' preprocessing produces:

* a JSONL file, one sample per line: ``{"input_ids": [...], "loss_mask": [...]}`` (``loss_mask``
  optional; blank lines are skipped but still counted for line numbers);
* a dataset directory saved with ``datasets.Dataset.save_to_disk`` (memory-mapped Arrow; needs the
  ``datasets`` package), with the same two columns.

Sample ``i`` is the ``i``-th sample of the source (0-based); its output file is ``data_{i}.pt``, which
is what makes a rerun skip finished work.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .errors import InputError


@dataclass(frozen=True)
class Sample:
    index: int
    line: int  # 1-based line in the JSONL file; row + 1 for a dataset directory
    input_ids: list[int]
    loss_mask: list[int] | None

    @property
    def where(self) -> str:
        return f"line {self.line}"


def _int_list(value, what: str, where: str) -> list[int]:
    if hasattr(value, "tolist"):
        value = value.tolist()
    if not isinstance(value, list):
        raise InputError(f"{where}: {what} must be a list of integers, got {type(value).__name__}")
    for position, item in enumerate(value):
        if isinstance(item, bool) or not isinstance(item, int):
            raise InputError(f"{where}: {what}[{position}] is {item!r}, not an integer")
    return value


def validate(record, where: str, index: int, line: int, vocab_size: int | None) -> Sample:
    """A checked :class:`Sample` from one parsed record, or InputError naming ``where``."""
    if not isinstance(record, dict):
        raise InputError(f"{where}: expected a JSON object with 'input_ids', got {type(record).__name__}")
    if "input_ids" not in record:
        raise InputError(f"{where}: no 'input_ids' (keys: {', '.join(sorted(record)) or 'none'})")
    ids = _int_list(record["input_ids"], "input_ids", where)
    if not ids:
        raise InputError(f"{where}: empty sample (input_ids is [])")
    if vocab_size is not None:
        for position, token in enumerate(ids):
            if not 0 <= token < vocab_size:
                raise InputError(f"{where}: input_ids[{position}] = {token} is outside the model's vocabulary "
                                 f"[0, {vocab_size})")
    mask = record.get("loss_mask")
    if mask is not None:
        mask = _int_list(mask, "loss_mask", where)
        if len(mask) != len(ids):
            raise InputError(f"{where}: loss_mask has {len(mask)} entries for {len(ids)} input_ids")
    return Sample(index, line, ids, mask)


def json_problem(exc: json.JSONDecodeError) -> str:
    """What is wrong, placed in the file's line (the decoder counts the newline at its end as a
    line of its own: "line 2 column 1" meant "the line ends too soon")."""
    line = exc.doc.rstrip("\r\n")
    if exc.pos >= len(line):
        return f"{exc.msg} at the end of the line"
    return f"{exc.msg} at column {exc.pos + 1}"


def read_jsonl(path: Path, vocab_size: int | None = None) -> Iterator[Sample]:
    index = 0
    with path.open("rb") as handle:
        for line_number, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue
            where = f"{path}:{line_number}"
            try:
                record = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise InputError(f"{where}: not valid JSON ({json_problem(exc)})") from None
            except UnicodeDecodeError as exc:
                raise InputError(f"{where}: not UTF-8 (byte {exc.start + 1} of the line)") from None
            yield validate(record, where, index, line_number, vocab_size)
            index += 1


def read_dataset_dir(path: Path, vocab_size: int | None = None) -> Iterator[Sample]:
    try:
        import datasets
    except ImportError:
        raise InputError(f"{path}: reading a saved dataset directory needs the 'datasets' package "
                         f"(pip install datasets), or pass the JSONL file instead") from None
    try:
        dataset = datasets.load_from_disk(str(path))
    except Exception as exc:  # datasets raises several types for a bad directory
        raise InputError(f"{path}: not a dataset saved with save_to_disk ({type(exc).__name__}: {exc})") from None
    if isinstance(dataset, datasets.DatasetDict):
        raise InputError(f"{path}: a DatasetDict ({', '.join(dataset)}); point at one split's directory")
    for row, record in enumerate(dataset):
        yield validate(record, f"{path} row {row}", row, row + 1, vocab_size)


def read_samples(path: str | Path, vocab_size: int | None = None) -> Iterator[Sample]:
    """Samples of a JSONL file or a saved dataset directory, validated as they are read."""
    path = Path(path)
    if not path.exists():
        raise InputError(f"{path}: no such file or directory")
    if path.is_dir():
        return read_dataset_dir(path, vocab_size)
    try:
        path.open("rb").close()
    except OSError as exc:
        raise InputError(f"{path}: cannot be read ({exc.strerror})") from None
    return read_jsonl(path, vocab_size)
