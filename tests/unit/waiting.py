"""Waiting on a condition in tests that run threads or servers: poll until it holds, failing only
past a bound no loaded host reaches while things work (a test never sleeps and then assumes)."""
from __future__ import annotations

import time

WITHIN = 30.0  # seconds: what a host busy with other work still does in far less, when nothing is wrong


def until(condition, what: str, within: float = WITHIN, every: float = 0.01):
    """``condition()``'s first true value, polled every ``every`` s; an AssertionError naming ``what``
    if it stays false for ``within`` s."""
    deadline = time.monotonic() + within
    while True:
        held = condition()
        if held:
            return held
        assert time.monotonic() < deadline, f"gave up after {within:g} s waiting for {what}"
        time.sleep(every)
