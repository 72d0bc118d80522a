"""Tokenized training samples, streamed (never loaded whole), each validated where it is read.

Two sources, both what speculators' preprocessing produces:

* a JSONL file, one sample per line: ``{"input_ids": [...], "loss_mask": [...]}`` (``loss_mask``
  optional; blank lines are skipped but still counted for line numbers);
* a dataset directory saved with ``datasets.Dataset.save_to_disk`` (memory-mapped Arrow; needs the
  ``datasets`` package), with the same two columns.

Sample ``i`` is the ``i``-th sample of the source (0-based); the output format names its file by
``i`` (``data_{i}.pt``), which is what makes a rerun skip finished work.
"""
from __future__ import annotations

import json
import os
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


class InputStream:
    """The input, opened once and read once, in order, validated as it is read.

    :meth:`peek` reads the first samples ahead (what the preflight checks before the model loads);
    iterating hands them out again, then reads on from where the peek stopped. How many samples the
    input holds is learned while streaming (:meth:`expected_samples`): a saved dataset knows its
    row count; a JSONL file's count is estimated from the bytes read so far, and exact at its end.

    Attributes:
        path: the JSONL file or dataset directory.
        samples_read: samples read so far (peeked ones included).
        bytes_read: bytes of the JSONL file read so far (0 for a dataset directory).
    """

    def __init__(self, path: str | Path, vocab_size: int | None = None):
        self.path = Path(path)
        self.vocab_size = vocab_size
        self.samples_read = 0
        self.bytes_read = 0
        self._size: int | None = None  # bytes of the JSONL file
        self._rows: int | None = None  # rows of a dataset directory
        self._ended = False
        self._peeked: list[Sample] = []
        self._reader: Iterator[Sample] | None = None

    def peek(self, count: int) -> list[Sample]:
        """The first ``count`` samples (fewer if the input is shorter), read now and handed out again
        by iteration."""
        reader = self._open()
        while len(self._peeked) < count:
            sample = next(reader, None)
            if sample is None:
                break
            self._peeked.append(sample)
        return list(self._peeked)

    def __iter__(self) -> Iterator[Sample]:
        reader = self._open()
        while self._peeked:
            yield self._peeked.pop(0)
        yield from reader

    def expected_samples(self) -> tuple[int, bool]:
        """(samples in the input, whether that number is exact): exact for a dataset directory and at
        the end of a JSONL file; before that, the samples read plus the bytes left at the mean size
        of those read."""
        if self._rows is not None:
            return self._rows, True
        if self._ended or not self.samples_read or not self.bytes_read:
            return self.samples_read, self._ended
        left = max(self._size - self.bytes_read, 0) * self.samples_read / self.bytes_read
        return self.samples_read + round(left), False

    def _open(self) -> Iterator[Sample]:
        if self._reader is None:
            if not self.path.exists():
                raise InputError(f"{self.path}: no such file or directory")
            self._reader = self._dataset_dir() if self.path.is_dir() else self._jsonl()
        return self._reader

    def _jsonl(self) -> Iterator[Sample]:
        try:
            handle = self.path.open("rb")
        except OSError as exc:
            raise InputError(f"{self.path}: cannot be read ({exc.strerror})") from None
        with handle:
            self._size = os.fstat(handle.fileno()).st_size
            for line_number, raw in enumerate(handle, start=1):
                self.bytes_read += len(raw)
                if not raw.strip():
                    continue
                where = f"{self.path}:{line_number}"
                try:
                    record = json.loads(raw)
                except json.JSONDecodeError as exc:
                    raise InputError(f"{where}: not valid JSON ({json_problem(exc)})") from None
                except UnicodeDecodeError as exc:
                    raise InputError(f"{where}: not UTF-8 (byte {exc.start + 1} of the line)") from None
                sample = validate(record, where, self.samples_read, line_number, self.vocab_size)
                self.samples_read += 1
                yield sample
        self._ended = True

    def _dataset_dir(self) -> Iterator[Sample]:
        try:
            import datasets
        except ImportError:
            raise InputError(f"{self.path}: reading a saved dataset directory needs the 'datasets' package "
                             f"(pip install datasets), or pass the JSONL file instead") from None
        try:
            dataset = datasets.load_from_disk(str(self.path))
        except Exception as exc:  # datasets raises several types for a bad directory
            raise InputError(f"{self.path}: not a dataset saved with save_to_disk ({type(exc).__name__}: {exc})") \
                from None
        if isinstance(dataset, datasets.DatasetDict):
            raise InputError(f"{self.path}: a DatasetDict ({', '.join(dataset)}); point at one split's directory")
        self._rows = len(dataset)
        for row, record in enumerate(dataset):
            sample = validate(record, f"{self.path} row {row}", row, row + 1, self.vocab_size)
            self.samples_read += 1
            yield sample
        self._ended = True
