"""SIGINT and SIGTERM during an extraction: finish the batch in flight, then stop."""
from __future__ import annotations

import signal


class Aborted(KeyboardInterrupt):
    """A signal that could not wait for the batch in flight: a second one, or one during the model load."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Interrupt:
    """SIGINT or SIGTERM while extracting: finish the batch in flight, then stop (``requested`` holds
    the signal). While the model loads, or for a second signal: :class:`Aborted` at once.

    Args:
        log: the extraction's logger (says what the first signal does).
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, log):
        self.log = log
        self.requested: int | None = None
        self.extracting = False
        self._previous: dict = {}

    def __enter__(self):
        for signum in self.SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum, frame):
        if not self.extracting or self.requested is not None:
            raise Aborted(signum)
        self.requested = signum
        self.log(f"{signal.Signals(signum).name}: finishing the batch in flight (Ctrl-C again to abort now)")

    def __exit__(self, *exc):
        for signum, previous in self._previous.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
