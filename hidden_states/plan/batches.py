"""Replica modes: which samples this process extracts, handed out in batches (:class:`BatchSource`).

The input is read once, in order (``inputs.InputStream``). :class:`Pending` applies what every mode
shares: the ``--start-index``/``--max-samples`` range, the finished set (resume: a sample whose
file is whole is never handed out again) and ``--max-seq-len`` (truncated, or refused with
``--strict``); it counts the finished samples it passes and the samples it truncates. A batch
source asks :meth:`Pending.samples` for the samples it wants, in input order, and groups them.

:class:`Sequential` (one process, every sample, in order) and :class:`ShardBatches` (one static
shard's share, ``shards.py``) are the modes of one process. A new mode is a class here following
:class:`BatchSource`, chosen in :func:`batch_source`; the extraction loop, the ledger, resume and the
writer stay as they are. Data-parallel replicas (``replicas/``) take their batches from the
driver's source, whichever it is.
"""
from __future__ import annotations

import bisect
from collections.abc import Callable, Collection, Iterator
from typing import Protocol

from ..errors import InputError
from ..inputs.streams import InputStream, Sample
from ..settings import Settings
from .run_checks import too_long


class Pending:
    """The input's samples still to extract, read once, in order.

    Args:
        stream: the input (its peeked samples come first).
        settings: the run's (``settings.Settings``): its range of sample indices (``Settings.in_range``), and
            ``max_seq_len``: longer samples are truncated to it, or refused with ``strict``.
        finished: indices whose files are whole.

    Attributes:
        skipped: finished samples in range passed over so far (those a source wanted).
        truncated: samples handed out truncated so far.
    """

    def __init__(self, stream: InputStream, settings: Settings, finished: Collection[int]):
        self.stream = stream
        self.settings = settings
        self.finished = finished
        self.skipped = 0
        self.truncated = 0
        self._finished_sorted = sorted(finished)

    def samples(self, wanted: Callable[[int], bool] = lambda index: True) -> Iterator[Sample]:
        """The samples in range that ``wanted`` picks and that are not finished, in input order, fitted
        to ``max_seq_len``; an input error is raised where the stream meets it."""
        settings = self.settings
        for sample in self.stream:
            if sample.index < settings.start_index:
                continue
            if not settings.in_range(sample.index):
                return  # past the range's end: the rest of the input is not read
            if not wanted(sample.index):
                continue
            if sample.index in self.finished:
                self.skipped += 1
                continue
            yield self._fit(sample)

    def todo(self, count: bool = False) -> tuple[int, bool]:
        """(samples in range not finished before this run, whether exact): from the input's expected
        size, which a JSONL file learns while it streams (``count``: its lines not read yet counted,
        ``InputStream.counted_samples``, as the plan does)."""
        return self._left(self._finished_sorted, count)

    def left(self, finished: Collection[int]) -> tuple[int, bool]:
        """(samples in range not in ``finished``, whether exact): what a run that ends now leaves
        undone, counted against the whole range (the input's lines not read counted; an estimate
        where its rows are conversations and it was not read to its end)."""
        return self._left(sorted(finished), count=True)

    def _left(self, finished_sorted: list[int], count: bool = False) -> tuple[int, bool]:
        start, end = self.settings.start_index, self.settings.end_index
        total, exact = self.stream.counted_samples() if count else self.stream.expected_samples()
        limit = min(total, end) if end is not None else total
        if end is not None and self.stream.samples_read >= end:
            exact = True  # the range ends inside what has been read
        if limit <= start:
            return 0, exact
        done = bisect.bisect_left(finished_sorted, limit) - bisect.bisect_left(finished_sorted, start)
        return limit - start - done, exact

    def _fit(self, sample: Sample) -> Sample:
        max_seq_len = self.settings.max_seq_len
        if len(sample.input_ids) <= max_seq_len:
            return sample
        if self.settings.strict:
            raise InputError(too_long(str(self.stream.path), sample, max_seq_len))
        self.truncated += 1
        mask = sample.loss_mask[:max_seq_len] if sample.loss_mask is not None else None
        return Sample(sample.index, sample.line, sample.input_ids[:max_seq_len], mask)


def batched(samples: Iterator[Sample], size: int) -> Iterator[list[Sample]]:
    """``samples`` in lists of ``size`` (the last may be shorter). An input error mid-stream first
    hands out the samples read before the bad one, then is raised."""
    batch: list[Sample] = []
    try:
        for sample in samples:
            batch.append(sample)
            if len(batch) == size:
                yield batch
                batch = []
    except InputError:
        if batch:
            yield batch
        raise
    if batch:
        yield batch


class BatchSource(Protocol):
    """Hands this process its batches.

    ``tag`` is None when this process is the only one writing into the output directory; else its
    writer tag (its own ledger and temporary names, ``output.BackgroundWriter``).
    """

    name: str
    tag: str | None

    def batches(self, pending: Pending, batch_size: int) -> Iterator[list[Sample]]: ...

    def expected(self, todo: int) -> int: ...  # of ``todo`` samples left in range, about how many come here

    # whether item ``index`` of the range (a sample; ``generate``: a conversation) is this process's
    def owns(self, index: int, start: int, batch_size: int) -> bool: ...


class Sequential:
    """One process extracts every pending sample, in input order."""

    name = "sequential"
    tag = None

    def batches(self, pending: Pending, batch_size: int) -> Iterator[list[Sample]]:
        return batched(pending.samples(), batch_size)

    def expected(self, todo: int) -> int:
        return todo

    def owns(self, index: int, start: int, batch_size: int) -> bool:
        return True


class ShardBatches:
    """One static shard (``shards.Shard``): every ``count``-th batch of the range, starting at its
    ``index``-th, batched as a single run would batch them."""

    def __init__(self, shard):
        self.shard = shard
        self.name = self.tag = shard.tag

    def batches(self, pending: Pending, batch_size: int) -> Iterator[list[Sample]]:
        start = pending.settings.start_index
        return batched(pending.samples(lambda index: self.owns(index, start, batch_size)), batch_size)

    def expected(self, todo: int) -> int:
        return -(-todo // self.shard.count)  # about: the shards' shares differ by a batch at most

    def owns(self, index: int, start: int, batch_size: int) -> bool:
        return self.shard.owns(index, start, batch_size)


def batch_source(settings) -> BatchSource:
    """The replica mode ``settings`` ask for (``settings.Settings``)."""
    if settings.shard is not None:
        return ShardBatches(settings.shard)
    return Sequential()
