"""The run's logger, and its progress: a bar on a terminal, plain periodic lines in logs."""
from __future__ import annotations

import sys
import time

from . import run_log
from .settings import default


def log_to_stderr(message: str) -> None:
    """The extractor's one logger: ``[hidden-states] message`` on stderr."""
    print(f"[hidden-states] {message}", file=sys.stderr, flush=True)


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Progress:
    """Samples and tokens done against a total that may be an estimate (``exact`` False: the input's
    size in samples is still being learned while it streams; shown as ``~N``).

    Args:
        total_samples: samples this run expects to extract.
        log: where the periodic lines go when ``stream`` is not a terminal.
        exact: whether ``total_samples`` is known or estimated.
        stream: the terminal the bar draws on (stderr).
        interval: seconds between periodic lines.
    """

    def __init__(self, total_samples: int, *, log, exact: bool = True, stream=None,
                 interval: float = default("progress_interval")):
        self.total = total_samples
        self.exact = exact
        self.log = log
        self.stream = stream or run_log.terminal() or sys.stderr
        self.interval = interval
        self.samples = 0
        self.tokens = 0
        self.started = time.monotonic()
        self._last_line = self.started
        self._bar = None
        if getattr(self.stream, "isatty", lambda: False)():
            try:
                from tqdm import tqdm

                self._bar = tqdm(total=total_samples, unit="sample", file=self.stream, dynamic_ncols=True)
            except ImportError:
                pass

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / max(time.monotonic() - self.started, 1e-9)

    def eta(self) -> str:
        if not self.samples:
            return "?"
        rate = self.samples / max(time.monotonic() - self.started, 1e-9)
        return _duration(max(self.total - self.samples, 0) / rate)

    def retotal(self, total_samples: int, exact: bool) -> None:
        """A better estimate of the total (or the exact one)."""
        self.total, self.exact = max(total_samples, self.samples), exact
        if self._bar is not None:
            self._bar.total = self.total

    def update(self, samples: int, tokens: int) -> None:
        self.samples += samples
        self.tokens += tokens
        if self._bar is not None:
            self._bar.update(samples)
            self._bar.set_postfix_str(f"{self.tokens_per_second:,.0f} tok/s")
            return
        now = time.monotonic()
        if now - self._last_line >= self.interval or self.samples >= self.total:
            self._last_line = now
            self.log(f"{self.samples}/{'' if self.exact else '~'}{self.total} samples, {self.tokens:,} tokens, "
                     f"{self.tokens_per_second:,.0f} tok/s, ETA {self.eta()}")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
