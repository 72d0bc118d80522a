"""A certified extraction's writes, on a thread of their own: each group's rows wait there for their
witnesses (the probes, which the engine runs behind the groups already queued), are certified, and
go to the writer, in the order handed. The extraction loop hands a group on as soon as its states
are in and goes on submitting, so the engine never idles waiting for a certificate."""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait


class WritesAside:
    """Runs the work handed to it one at a time, in order; after one fails, none of the rest."""

    def __init__(self):
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="hidden-states-certify")
        self._pending: deque[Future] = deque()
        self.failure: BaseException | None = None

    def hand(self, work: Callable[[], None]) -> None:
        """Queue ``work``; first raise the error of any work that failed."""
        self.check()
        self._pending.append(self._thread.submit(self._run, work))

    def check(self) -> None:
        """Raise the first error any work met (a row's certificate failing: the run stops there)."""
        while self._pending and self._pending[0].done():
            self._pending.popleft()
        if self.failure is not None:
            raise self.failure

    def finish(self) -> None:
        """Wait for everything handed (written, or failed), then raise the first error met."""
        self.settle()
        self.check()

    def settle(self) -> None:
        """Wait for everything handed to end, written or failed, raising nothing (a run stopping on
        another error keeps the rows already certified: they are finished work)."""
        wait(list(self._pending))
        self._pending.clear()

    def _run(self, work: Callable[[], None]) -> None:
        if self.failure is not None:  # an earlier group failed: nothing after it is written
            return
        try:
            work()
        except BaseException as exc:  # noqa: BLE001 - the loop raises it (check)
            self.failure = exc
