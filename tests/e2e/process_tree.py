"""A process's descendants, liveness and command line, read from /proc: what the end-to-end tests
check a run's shutdown with (support module)."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def descendants(pid: int) -> set[int]:
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found.update(int(c) for c in (task / "children").read_text().split())
        except OSError:  # the task ended
            pass
    for child in list(found):
        found |= descendants(child)
    return found


def _state(stat: Path) -> str | None:
    """The state letter a task's ``stat`` file gives; None once the task has ended."""
    try:
        return stat.read_text().rsplit(") ", 1)[1][0]
    except (OSError, IndexError):
        return None


def alive(pid: int) -> bool:
    return _state(Path(f"/proc/{pid}/stat")) not in (None, "Z")


def stop(pid: int, seconds: float = 10) -> None:
    """SIGSTOP ``pid`` and return once every thread of it is stopped (or it has ended). ``kill`` returns
    when the signal is sent; the group stop starts only when one of its threads runs to take it, and
    on a busy host its other threads (the background writer) go on meanwhile."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + seconds
    while alive(pid) and not all(_state(task / "stat") in (None, "t", "T")
                                 for task in Path(f"/proc/{pid}/task").glob("*")):
        assert time.monotonic() < deadline, f"pid {pid} did not stop within {seconds} s"
        time.sleep(0.005)


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""
