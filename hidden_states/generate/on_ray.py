"""``generate``'s batch kind for Ray replicas (``replicas.driver.RayReplicas``): a batch is whole
conversations (a later turn needs the earlier replies), each replica regenerating them on its own
``vllm-engine`` backend. A batch's lines come back with its call; the driver writes them, in
hand-out order, once every file the batch wrote is confirmed on disk, and counts the batch then:
``regenerated.jsonl``, the summary and the tally are a single run's."""
from __future__ import annotations

import dataclasses

from ..replicas.replica import Handle, ReplicaBatch
from .lines import RegeneratedLines
from .regeneration import Tally


class ConversationBatches:
    """Batches of (Regeneration, sample indices) pairs; their lines written through ``lines``, their
    counts into ``tally`` and the driver's summary."""

    def __init__(self, lines: RegeneratedLines, tally: Tally):
        self.lines, self.tally = lines, tally
        self._returned: dict[int, ReplicaBatch] = {}  # by hand-out number: returned, lines not written yet
        self._next_line = 0  # the batch whose lines are written next

    def batch_of(self, conversations_batch) -> ReplicaBatch:
        return ReplicaBatch(conversations_batch, [index for _, indices in conversations_batch for index in indices],
                            ", ".join(f"{indices} ({regen.where})" for regen, indices in conversations_batch))

    def account(self, driver, handle: Handle, batch: ReplicaBatch, result: dict) -> None:
        batch.result = result
        written = set(result["rows"])
        for index in set(batch.indices) - written:  # a conversation the replica skipped (too long): no file
            handle.unconfirmed.pop(index, None)
        batch.outstanding &= written
        self._returned[batch.number] = batch

    def progressed(self, driver) -> None:
        """Write the lines of the batches whose files are all on disk, in hand-out order."""
        while self._next_line in self._returned and not self._returned[self._next_line].outstanding:
            self._complete(driver, self._returned.pop(self._next_line))
            self._next_line += 1

    def _complete(self, driver, batch: ReplicaBatch) -> None:
        result, summary = batch.result, driver.summary
        self.lines.write(result["lines"])
        self.tally.add(result["tally"])
        summary.extracted += result["extracted"]
        summary.tokens += result["tokens"]
        summary.computed_tokens += result["computed_tokens"]
        driver.progress.update(len(result["lines"]), result["tokens"])

    def unreturned(self, driver, replica_id: int, failed: ReplicaBatch) -> list[ReplicaBatch]:
        """Its batch that failed and its calls still queued: their lines never came back, whatever
        of their files the replica wrote (its writer drained as it retired)."""
        return [failed, *(batch for rid, batch in driver.calls.values() if rid == replica_id and batch.result is None)]

    def again(self, driver, lost: ReplicaBatch) -> ReplicaBatch | None:
        """A batch of a retired replica: done when its call returned and every file it wrote is whole
        (renamed into place before the death); else run again whole: every conversation regenerated,
        its files rewritten, its line the new run's (no file of a first attempt beside a line of the
        second, whatever the sampling)."""
        if lost.result is not None:
            lost.outstanding = {index for index in lost.outstanding if not driver.whole(index)}
            if not lost.outstanding:
                for index in lost.result["rows"]:
                    driver.prepared.finished.setdefault(index, None)
                return None
        self._returned.pop(lost.number, None)
        return dataclasses.replace(lost, result=None, skip=frozenset())

    def flush(self, driver) -> None:
        """At the end: the lines of every batch whose files are whole, those after a batch given up
        included (the files decide what a rerun redoes: a conversation is done with its line)."""
        self.progressed(driver)
        for number in sorted(self._returned):
            batch = self._returned[number]
            batch.outstanding = {index for index in batch.outstanding if not driver.whole(index)}
            if not batch.outstanding:
                self._complete(driver, self._returned.pop(number))
