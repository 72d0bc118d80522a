"""``regenerated.jsonl``: one line per conversation as regenerated, in input order, written once
every one of its rows' files is whole (renamed into place and in the ledger): a line never names a
file a failing disk did not write. A static shard appends to its own ``regenerated.<tag>.jsonl``,
merged at its end (``regeneration.merge_shards``)."""
from __future__ import annotations

import json
from collections import deque
from pathlib import Path

from ..backends import Reply
from ..errors import OutputError
from .regeneration import Regeneration, keep_finished_lines, merge_shards, order_lines, regenerated_name


class RegeneratedLines:
    """The regenerated lines' file of one process (``tag``: a shard's; None: the run's).

    Attributes:
        with_lines: conversations whose line a regenerated file holds.
        lined_now: conversations whose line this run wrote.
    """

    def __init__(self, directory: Path, tag: str | None, *, log):
        self.directory, self.tag, self.log = directory, tag, log
        self.with_lines: set[int] = set()
        self.lined_now: set[int] = set()
        self._awaiting: deque[dict] = deque()  # lines in input order whose rows' files are not all whole yet
        self._file = None

    def keep_finished(self, finished) -> None:
        """At the start of a run: only the lines of finished conversations are kept."""
        self.with_lines = keep_finished_lines(self.directory, self.tag, finished)

    def open(self) -> None:
        self._file = open(self.directory / regenerated_name(self.tag), "a", encoding="utf-8")

    def when_whole(self, lines: list[dict], whole) -> None:
        """Take ``lines`` (in input order) and write, in that order, those whose rows' files ``whole``
        holds: one still waiting on its files holds those after it, until :meth:`write_whole` gives up."""
        self._awaiting.extend(lines)
        self.write_whole(whole)

    def write_whole(self, whole, give_up: bool = False) -> None:
        """Write the awaiting lines whose files ``whole`` holds, in order, up to the first that waits
        (``give_up``: the run is over: lines whose files were never written are dropped, their
        conversations left to the next run)."""
        ready = []
        while self._awaiting:
            if set(self._awaiting[0]["sample_indices"]) <= whole.keys():
                ready.append(self._awaiting.popleft())
            elif give_up:
                self._awaiting.popleft()
            else:
                break
        if ready:
            self.write(ready)

    def write(self, lines: list[dict]) -> None:
        for line in lines:
            self._file.write(json.dumps(line, ensure_ascii=False) + "\n")
            self.with_lines.add(line["index"])
            self.lined_now.add(line["index"])
        self._file.flush()

    @property
    def opened(self) -> bool:
        return self._file is not None

    def close(self, finished) -> None:
        """Close the file; put it back in input order (a resumed run appends the conversations it redid
        after later ones kept: each conversation once, whatever stopped the run; a disk too full for
        that leaves it to the next run's start, which does the same); a shard's merged."""
        self._file.close()
        try:
            order_lines(self.directory, self.tag, finished)
        except OutputError as exc:
            self.log(f"warning: {regenerated_name(self.tag)} is left out of input order until the next run: {exc}")
        self.merge_shards(finished)

    def merge_shards(self, finished) -> None:
        if self.tag is not None:
            merge_shards(self.directory, finished)


class InOrder:
    """Hands ``write`` the lines of conversations numbered ``order`` in that order, each as soon as every
    one before it has its line or was skipped."""

    def __init__(self, order: list[int], write):
        self._order, self._write, self._next = order, write, 0
        self._held: dict[int, dict | None] = {}

    def put(self, number: int, line: dict) -> None:
        self._held[number] = line
        self._flush()

    def skip(self, number: int) -> None:
        self._held[number] = None
        self._flush()

    def _flush(self) -> None:
        ready = []
        while self._next < len(self._order) and self._order[self._next] in self._held:
            line = self._held.pop(self._order[self._next])
            if line is not None:
                ready.append(line)
            self._next += 1
        if ready:
            self._write(ready)


def regenerated_line(regen: Regeneration, indices: list[int]) -> dict:
    """A conversation as regenerated: its place in the input, its sample files, its messages, and
    per reply the generated ids and vLLM's finish reason."""
    replies: list[Reply] = regen.replies
    return {"index": regen.index, "source": regen.where, "sample_indices": indices, "messages": regen.messages,
            **({"tools": regen.kept.tools} if regen.kept.tools else {}),
            "generated": [{"token_ids": reply.generated, "finish_reason": reply.finish_reason} for reply in replies]}
