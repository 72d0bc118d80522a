"""Rows whose states are the first states of a longer row of the same batch (:func:`share`).

In a causal decoder a token's state depends only on the tokens before it, so a row that is an exact
prefix of another row (speculators 0.5's per-turn rows of one conversation, where the chat template
leaves the earlier turns as they were) has the longer row's first states. Only the rows that are a
prefix of no other row of their batch (the carriers) are extracted; every other row is written from
its carrier's states, cut to its own length, with its own ids and mask.

The window is the batch: the input is streamed and a batch is all the look-ahead there is, so a
conversation whose turns straddle two batches has its earlier turns extracted on their own. Rows are
still written and recorded one by one (``output/``), so resume and shards are unchanged: a row is
finished when its file is whole, whether it was extracted or sliced.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .streams import Sample


@dataclass
class Shared:
    """One batch planned: the rows to extract and, by a carrier's sample index, the rows served from it
    (each a prefix of the carrier, in input order)."""

    carriers: list[Sample]
    served: dict[int, list[Sample]] = field(default_factory=dict)

    @property
    def served_rows(self) -> int:
        return sum(len(rows) for rows in self.served.values())


def share(batch: list[Sample]) -> Shared:
    """``batch`` planned (see the module's docstring); the carriers keep the batch's order.

    Sorted by token ids, the rows that begin with a row ``p`` come right after it, so ``p`` is a
    prefix of some other row exactly when it is one of the row that follows it; that row's carrier
    (the last of the run of rows each extending the one before) is ``p``'s. A row equal to another is
    served from it too."""
    order = sorted(range(len(batch)), key=lambda i: batch[i].input_ids)
    carrier = list(range(len(batch)))
    for before, after in zip(reversed(order[:-1]), reversed(order[1:])):
        ids, longer = batch[before].input_ids, batch[after].input_ids
        if len(longer) >= len(ids) and longer[: len(ids)] == ids:
            carrier[before] = carrier[after]
    served: dict[int, list[Sample]] = {}
    for position, sample in enumerate(batch):
        if carrier[position] != position:
            served.setdefault(batch[carrier[position]].index, []).append(sample)
    return Shared([s for i, s in enumerate(batch) if carrier[i] == i], served)


def whole(batch: list[Sample]) -> Shared:
    """``batch`` with every row extracted (``--no-shared-prefix``)."""
    return Shared(list(batch))
