"""The rows of replies still being generated, copied into their sample files while the engine runs
(``hidden-states generate``, ``engine_replies.EngineReplies.answer``'s ``stream``).

Without it a reply's file is written after its conversation ends: when all the replies of a batch
end in the same step, every file is written after the last one, and the disk's time adds to the
run's. Here a thread wakes every ``interval`` seconds and, for each reply it follows, copies the rows
its region has counted since the last time (token-major: one row of every layer after another, as
a speculators-0.5 file holds them) to the reply's :class:`Sink`. What is left for the end is the
rows counted since the last copy and the training row's own tail.

A counted row is final, but for two things the region says: rows a preempted request stored again
(``RegionPool.rewritten_from``) and rows the training row's prefill computes in the reply's region
(from its first row, ``RegionPool.first_row``). :meth:`ReplyStreams.stop` ends a reply's copies
(waiting for the one under way) before either of the training row's writes can start, and whoever
finishes the file takes the rows from the first of those on again from the region.
"""
from __future__ import annotations

import threading
from typing import Callable, Protocol


class Sink(Protocol):
    """Where a reply's rows go: ``append`` takes the next rows (``[n, layers, row_bytes]`` uint8, in
    order from row 0), ``rows`` counts those taken, ``fail`` says it can take no more."""

    rows: int

    def append(self, rows) -> None: ...

    def fail(self, error: BaseException) -> None: ...


class _Followed:
    def __init__(self, sink: Sink, capacity: int):
        self.sink, self.capacity = sink, capacity
        self.lock = threading.Lock()
        self.stopped = False


class ReplyStreams:
    """Follows replies' regions and copies their counted rows to their sinks on one thread.

    Args:
        counted: region offset -> its rows counted now and the first of them stored (``RegionPool``'s
            ``rows_stored`` with no wait, ``first_row``).
        read: (offset, capacity, start, stop) -> rows ``start .. stop`` of the region at ``offset``
            (laid out for ``capacity`` rows), token-major, a copy.
        interval: seconds between two rounds; a round copies what every reply gained.
    """

    def __init__(self, counted: Callable[[int], tuple[int, int]], read: Callable[[int, int, int, int], object],
                 interval: float = 0.25):
        self._counted, self._read, self.interval = counted, read, interval
        self._followed: dict[int, _Followed] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.rows_copied = 0

    def follow(self, offset: int, capacity: int, sink: Sink) -> None:
        """Copy the rows of the region at ``offset`` (laid out for ``capacity``) to ``sink`` as they are counted."""
        with self._lock:
            self._followed[offset] = _Followed(sink, capacity)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="hidden-states-reply-streams", daemon=True)
                self._thread.start()

    def stop(self, offset: int) -> Sink | None:
        """Stop copying the region at ``offset``'s rows, the copy under way finished first; returns its
        sink (None: not followed)."""
        with self._lock:
            followed = self._followed.pop(offset, None)
        if followed is None:
            return None
        with followed.lock:
            followed.stopped = True
        return followed.sink

    def copy_round(self) -> None:
        """Copy every followed region's rows counted since the last round."""
        with self._lock:
            followed = list(self._followed.items())
        for offset, one in followed:
            with one.lock:
                if one.stopped:
                    continue
                count, first = self._counted(offset)
                count = min(count, one.capacity)
                if count <= one.sink.rows:
                    continue
                if first != 0:  # rows a prefix cache gave it are not in its region: not a reply's file
                    self._drop(offset, one, RuntimeError("the region's first rows came from vLLM's prefix cache"))
                    continue
                try:
                    rows = count - one.sink.rows
                    one.sink.append(self._read(offset, one.capacity, one.sink.rows, count))
                    self.rows_copied += rows
                except Exception as exc:  # noqa: BLE001 - the file is written whole at the end instead
                    self._drop(offset, one, exc)

    def _drop(self, offset: int, one: _Followed, error: BaseException) -> None:
        one.stopped = True
        one.sink.fail(error)
        with self._lock:
            if self._followed.get(offset) is one:
                del self._followed[offset]

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.copy_round()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
