"""A batch's rows through this process's backend to its writer: the rows a shared prefix serves
taken apart (``prefixes.share``), the others submitted in groups of about one engine step
(:func:`submit_groups`) with the backend's ``tokens_ahead`` in flight, each group's states handed,
once in, to the background writer (which has the format make each file) with the rows served
from them. A single run's
loop and a Ray replica's batches both run here."""
from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable

from .. import fp8_states
from ..certify.certifier import write_certified
from ..certify.witness import probe_positions
from ..inputs import prefixes
from ..inputs.streams import Sample
from ..run.summary import ExtractionFailed, Summary
from .writes_aside import WritesAside


class ExtractRows:
    """Rows to states to files, on ``model`` (``run.model_here.ModelHere``: its backend and writer).

    Args:
        written: (rows, tokens) -> None, called as a group's rows go to the writer (the progress).
    """

    def __init__(self, model, summary: Summary, *, share_prefixes: bool,
                 written: Callable[[int, int], None] = lambda rows, tokens: None):
        self.backend, self.writer, self.layer_order = model.backend, model.writer, model.layer_order
        self.certifier = getattr(model, "certifier", None)  # None: rows written uncertified (the load said why)
        self.summary, self.share_prefixes, self.written = summary, share_prefixes, written
        # (batch, future, tokens): submitted to the backend, not yet written, oldest first
        self._in_flight: deque[tuple] = deque()
        # by a submitted row's sample index: the rows written from its states (prefixes.py)
        self._served: dict[int, list[Sample]] = {}
        # a certified run's writes wait for their rows' probes there, not in the loop (writes_aside.py)
        self._aside = WritesAside() if self.certifier is not None else None

    def hand_out(self, batch: list[Sample]) -> None:
        """Submit ``batch`` (in groups of at most the backend's ``tokens_per_submit``, if it has one),
        then hand the oldest group in flight to the writer once the groups submitted after it hold
        the backend's ``tokens_ahead`` (``backends.ONE_BATCH_AHEAD`` by default): a backend that can
        runs those while the oldest one's states are copied out and written (the ``speculators``
        backend overlaps two calls; the engine backends want ``engine_feed.STEPS_AHEAD`` engine steps
        queued, whatever the batches' lengths)."""
        ahead = self.backend.tokens_ahead
        for group in submit_groups(self.carriers(batch), self.backend.tokens_per_submit):
            try:
                submitted = self.submit(group)
            except Exception as exc:  # the engine is gone (a dead process): name what it held, and this group
                raise self._failed([s for held, *_ in self._in_flight for s in held] + group, exc) from exc
            self._in_flight.append((group, submitted, sum(len(s.input_ids) for s in group)))
            while len(self._in_flight) > 1 and sum(tokens for *_, tokens in itertools.islice(self._in_flight, 1, None)) >= ahead:
                self._write(*self._in_flight.popleft()[:2])

    def drain(self) -> None:
        """Hand every group still in flight to the writer, and wait until it has them all."""
        while self._in_flight:
            self._write(*self._in_flight.popleft()[:2])
        if self._aside is not None:
            self._aside.finish()

    def settle(self) -> None:
        """A run stopping on an error: the groups already certifying end (written, or failed)."""
        if self._aside is not None:
            self._aside.settle()

    def _write(self, batch: list[Sample], submitted) -> None:
        rows = len(batch) + sum(len(self._served.get(s.index, ())) for s in batch)
        if self._aside is None:
            tokens = self.write_batch(batch, submitted)
            self._count(rows, tokens)
            return
        handed, tokens = self.take(batch, submitted)

        def certified_write() -> None:
            self.certify_and_write(handed)
            self._count(rows, tokens)

        self._aside.hand(certified_write)

    def _count(self, rows: int, tokens: int) -> None:
        self.summary.extracted += rows
        self.summary.tokens += tokens
        self.written(rows, tokens)

    def carriers(self, batch: list[Sample]) -> list[Sample]:
        """The rows of ``batch`` to extract; the others, prefixes of one of them, are kept to be written
        from its states (``prefixes.share``; every row with ``--no-shared-prefix``)."""
        shared = prefixes.share(batch) if self.share_prefixes else prefixes.whole(batch)
        self._served.update(shared.served)
        self.summary.shared_rows += shared.served_rows
        return shared.carriers

    def extract_batch(self, batch: list[Sample], skip: frozenset[int] = frozenset()) -> int:
        """One batch, start to end: backend -> the writer (the format's records), except the samples
        in ``skip`` (extracted with the batch, not written: a data-parallel retry of a batch some of
        whose files are already whole). Returns the batch's tokens."""
        carriers = self.carriers(batch)
        return self.write_batch(carriers, self.submit(carriers), skip)

    def replica_batch(self, batch: list[Sample], skip: frozenset[int]) -> dict:
        """One batch in a Ray replica: :meth:`extract_batch`; returns its tokens and its rows served
        from a shared prefix and tokens run (the driver's summary counts them)."""
        summary = self.summary
        shared, computed, cached = summary.shared_rows, summary.computed_tokens, summary.cached_tokens
        tokens = self.extract_batch(batch, skip)
        return {"tokens": tokens, "shared_rows": summary.shared_rows - shared,
                "computed_tokens": summary.computed_tokens - computed, "cached_tokens": summary.cached_tokens - cached}

    def submit(self, batch: list[Sample]):
        if self.certifier is None:
            return self.backend.submit([s.input_ids for s in batch])
        # the engine's witness for each row: its last position, and probes inside it that certify the
        # rows served from its first tokens too (certify.witness)
        probes = [probe_positions(s.input_ids, [len(r.input_ids) for r in self._served.get(s.index, ())],
                                  self.backend.prefix_hit_tokens)
                  for s in batch]
        return self.backend.submit_certified([s.input_ids for s in batch], probes)

    def write_batch(self, batch: list[Sample], submitted, skip: frozenset[int] = frozenset()) -> int:
        """Wait for a submitted batch's states and hand them to the writer, with the rows served from
        them (see :meth:`extract_batch`); returns the tokens of the rows handed over and served."""
        handed, tokens = self.take(batch, submitted, skip)
        self.certify_and_write(handed)
        return tokens

    def take(self, batch: list[Sample], submitted, skip: frozenset[int] = frozenset()) -> tuple[list, int]:
        """A submitted batch's states, once in, as rows for the writer: ``(row, its layers, the future
        of its witness or None)`` for it and the rows served from it, but those in ``skip``; and
        their tokens."""
        try:
            states = submitted.result()
        except Exception as exc:
            raise self._failed(batch, exc) from exc
        # the rows vLLM's prefix cache spared (the backend counts them as it resolves batches)
        cached = self.backend.cached_tokens - self.summary.cached_tokens
        self.summary.cached_tokens += cached
        self.summary.computed_tokens -= cached
        tokens = 0
        handed: list = []  # (row, its layers, its witness or None), in the batch's order
        for sample, layers in zip(batch, states, strict=True):
            layers, witness = layers if self.certifier is not None else (layers, None)
            layers = fp8_states.pick(layers, self.layer_order)
            self.summary.computed_tokens += len(sample.input_ids)
            for row in [sample, *self._served.pop(sample.index, ())]:
                if row.index not in skip:
                    # the states as the backend hands them, on its device: the format copies them to
                    # the host (FP8 quantized first, so half the bytes cross); a served row's are its
                    # carrier's first rows, a view the format makes its own storage where it must
                    handed.append((row, fp8_states.first_rows(layers, len(row.input_ids)), witness))
                tokens += len(row.input_ids)
        return handed, tokens

    def certify_and_write(self, handed: list) -> None:
        """Rows from :meth:`take` to the writer, certified first, all in one pass: the rows before a
        failing one are written, the failing one and those after it are not, and the run stops there."""
        if self.certifier is not None:
            try:  # each row's witness: its carrier's, once its probes have run, at the row's own positions
                handed = [(row, layers, witness.result().within(len(row.input_ids))) for row, layers, witness in handed]
            except Exception as exc:
                raise self._failed([row for row, _, _ in handed], exc) from exc
        write_certified(self.certifier, handed, self.writer.write)

    def _failed(self, batch: list[Sample], exc: Exception) -> ExtractionFailed:
        held = [row for s in batch for row in (s, *self._served.get(s.index, ()))]  # rows served from them too
        where = ", ".join(f"{s.index} ({s.where})" for s in sorted(held, key=lambda s: s.index))
        return ExtractionFailed(f"extracting samples {where} failed: {type(exc).__name__}: {exc or '(no message)'}")


def submit_groups(batch: list[Sample], tokens: int | None) -> list[list[Sample]]:
    """``batch`` in consecutive groups of at most ``tokens`` tokens (a longer sample alone), or whole
    when ``tokens`` is None. A group's states are written once all of it has run: an engine backend
    gets groups of about one engine step, so what is written after the run's last forward is one
    step's sequences, not a whole ``--batch-size`` batch's."""
    if tokens is None:
        return [batch]
    groups: list[list[Sample]] = []
    held = 0
    for sample in batch:
        if not groups or held + len(sample.input_ids) > tokens:
            groups.append([])
            held = 0
        groups[-1].append(sample)
        held += len(sample.input_ids)
    return groups
