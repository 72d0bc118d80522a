"""Which of vLLM's pipeline stages died first, when the workers are not this process's children.

Under ``vllm.LLM`` vLLM's workers are children of its engine core: when one dies, the engine core
exits with an error and this process sees only that (``processes.Children``). Each worker titles
its process ``VLLM::Worker_PP<stage>`` (``_TP<rank>`` after it with more than one rank a stage;
setproctitle, once it runs). :class:`StageExits` finds those processes among the engine core's
descendants (``/proc``) and watches each through a pidfd (readable once the process has ended: no
exit status, which only its parent may reap), so that the first stage worker to end is known after
vLLM has stopped the others. Linux 5.3 and later; elsewhere it learns nothing.
"""
from __future__ import annotations

import os
import select
import threading
import time
from pathlib import Path

TITLE = b"VLLM::Worker_PP"
FIND_FOR = 1800.0  # seconds to look for the stages' workers after the engine core starts (the model's load)


def _descendants(pid: int) -> set[int]:
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found.update(int(child) for child in (task / "children").read_text().split())
        except (OSError, ValueError):
            pass
    for child in list(found):
        found |= _descendants(child)
    return found


def _title(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace").strip()
    except OSError:
        return ""


class StageExits:
    """Watches the ``workers`` stage workers below the process ``root`` (a daemon thread): finds them,
    then waits for their ends, in order."""

    def __init__(self, root: int, workers: int):
        self.root, self.workers = root, workers
        self.ended: list[tuple[str, int]] = []  # (title, pid) of each stage worker, in the order they ended
        self.found: dict[int, str] = {}  # pid -> title of each stage worker, once all are found and watched
        self._fds_ready = threading.Event()
        self._lock = threading.Lock()
        threading.Thread(target=self._run, name="hidden-states-stage-exits", daemon=True).start()

    def first(self) -> tuple[str, int] | None:
        """The stage worker that ended first (its title, its pid); None while none has."""
        with self._lock:
            return self.ended[0] if self.ended else None

    def _find(self) -> dict[int, str]:
        deadline = time.monotonic() + FIND_FOR
        while time.monotonic() < deadline and os.path.exists(f"/proc/{self.root}"):
            found = {pid: _title(pid) for pid in _descendants(self.root)}
            found = {pid: title for pid, title in found.items() if title.encode().startswith(TITLE)}
            if len(found) >= self.workers:
                return found
            time.sleep(1.0)
        return {}

    def _run(self) -> None:
        if not hasattr(os, "pidfd_open"):
            return
        fds: dict[int, tuple[str, int]] = {}
        self.found = self._find()
        for pid, title in self.found.items():
            try:
                fds[os.pidfd_open(pid)] = (title, pid)
            except OSError:  # ended meanwhile
                with self._lock:
                    self.ended.append((title, pid))
        self._fds_ready.set()
        try:
            while fds:
                ready, _, _ = select.select(list(fds), [], [])
                with self._lock:
                    self.ended.extend(fds[fd] for fd in ready)
                for fd in ready:
                    del fds[fd]
                    os.close(fd)
        finally:
            for fd in fds:
                os.close(fd)


def said(watch: StageExits | None) -> str:
    """What the stage watch adds to the engine core's death: the stage whose worker ended first."""
    first = watch.first() if watch is not None else None
    if first is None:
        return ""
    title, pid = first
    stage = title[len(TITLE.decode()):].split("_")[0]
    return (f"; the first of its workers to end was pipeline stage {stage}'s ({title}, pid {pid}): that stage died "
            f"first, the engine core stopped on it")
