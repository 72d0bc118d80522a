"""One run at a time per output directory: the lock (:class:`DirectoryLock`), and who holds it
(:func:`holder`, for ``plan`` and ``status``)."""
from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from ..errors import OutputError
from ..files import describe_os_error


LOCK = ".hidden-states.lock"  # held by the run writing into the directory (DirectoryLock)


def lock_name(tag: str | None) -> str:
    """The lock file a writer tagged ``tag`` holds on its own (None: the directory's, ``LOCK``)."""
    return f".hidden-states.{tag}.lock" if tag else LOCK


class DirectoryLock:
    """One run at a time per output directory: ``fcntl.flock`` on a lock file in it, held for the run.

    A single run (and a Ray driver, whose replicas write under its lock) holds ``LOCK`` exclusively.
    A static shard (``tag``) holds ``LOCK`` shared, with the other shards of its run, and its own
    ``lock_name(tag)`` exclusively: shards run together, a single run and a shard do not, nor two
    copies of one shard. The holder writes its pid, host, start and command into the file it holds
    exclusively, and empties it when it ends; the kernel releases the lock of a run that dies (even
    ``kill -9``), whose record stays: the next run takes the lock over and says so.
    """

    def __init__(self, directory: Path, tag: str | None = None):
        self.directory = Path(directory)
        self.tag = tag
        self._held: list[tuple[int, bool]] = []  # (descriptor, whether this run's record is in it)

    def acquire(self) -> str | None:
        """Take the lock. Returns the line saying a run that ended held it (None: it was free).

        Raises:
            OutputError: another run holds it, naming that run.
        """
        ended = []
        try:
            shared = self._take(LOCK, exclusive=self.tag is None, ended=ended)
            if self.tag is not None:
                if shared:  # the run that wrote it ended: no exclusive holder can be alive while we share it
                    os.ftruncate(self._held[-1][0], 0)
                self._take(lock_name(self.tag), exclusive=True, ended=ended)
        except BaseException:
            self.release()
            raise
        return (f"{self.directory}: lock taken over from a run that ended ({ended[0]})") if ended else None

    def _take(self, name: str, exclusive: bool, ended: list[str]) -> bool:
        """Lock ``name``; the record of a run that ended found in it goes to ``ended``. Returns
        whether there was one."""
        path = self.directory / name
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise OutputError(f"--output-dir {describe_os_error(exc, path)} (the lock file)") from None
        try:
            fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            running = holder(self.directory, self.tag) or "another run"
            raise OutputError(f"--output-dir {self.directory}: {running} is writing into it; wait for it to end, "
                              f"or use another --output-dir") from None
        self._held.append((fd, False))
        record = _read_record(fd)
        if record:
            ended.append(_describe_record(record))
        if exclusive:
            mine = json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                               "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                               "command": " ".join(sys.argv)[:300]})
            os.ftruncate(fd, 0)
            os.pwrite(fd, mine.encode() + b"\n", 0)
            self._held[-1] = (fd, True)
        return bool(record)

    def release(self) -> None:
        """Empty this run's records and let the lock go (a run that ended normally leaves none)."""
        while self._held:
            fd, mine = self._held.pop()
            try:
                if mine:
                    os.ftruncate(fd, 0)
                # unlocked, not only closed: a process forked meanwhile (vLLM's) shares the descriptor
                fcntl.flock(fd, fcntl.LOCK_UN)
            except OSError:
                pass
            finally:
                os.close(fd)


def _read_record(fd: int) -> dict | None:
    try:
        record = json.loads(os.pread(fd, 4096, 0) or b"null")
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _describe_record(record: dict) -> str:
    """``pid 4242 on gpu-3 since 2026-01-02T03:04:05+0000: hidden-states extract ...``."""
    return (f"pid {record.get('pid')} on {record.get('host')} since {record.get('since')}"
            + (f": {record['command']}" if record.get("command") else ""))


def holder(directory: Path, tag: str | None = None) -> str | None:
    """The run that holds ``directory``'s lock against a writer tagged ``tag``, described (None:
    nobody does); opens only the lock files already there, writes nothing (``plan``, ``status``)."""
    directory = Path(directory)
    checks = [(LOCK, tag is None)] + ([(lock_name(tag), True)] if tag else [])
    for name, exclusive in checks:
        fd = _open_existing(directory / name)
        if fd is None:
            continue
        try:
            try:
                fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
            except BlockingIOError:
                record = _read_record(fd)
                if record:
                    return f"another run ({_describe_record(record)})"
                shards = [f"{path.name[len('.hidden-states.'):-len('.lock')]}: {_describe_record(found)}"
                          for path in sorted(directory.glob(".hidden-states.*.lock"))
                          if (found := _record_of(path))]
                return "another run's static shards (" + ("; ".join(shards) or "no record") + ")"
            except OSError:  # a file system that cannot lock it here: the run's own acquire says why
                continue
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
    return None


def _open_existing(path: Path) -> int | None:
    """A lock file opened to be probed, never created: for writing where it may be (NFS's emulated
    exclusive lock needs it), else for reading; None when it is not there or cannot be opened."""
    for flags in (os.O_RDWR, os.O_RDONLY):
        try:
            return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
    return None


def _record_of(path: Path) -> dict | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return _read_record(fd)
    finally:
        os.close(fd)
