"""A run's output: all of it to a log file in the output directory, the terminal's share filtered.

vLLM's processes (engine core, workers), Gloo's C++ and Python's warnings write to the file
descriptors they inherit, and Ray's workers' output reaches the driver's; no logging setting
reaches all of them. So while :func:`captured` is active, this process's stdout and stderr (fds 1
and 2, which every child it starts inherits) are one pipe. A thread reads it, writes every line to
the log file, and hands each to a :class:`~hidden_states.log_levels.TerminalFilter`, which decides
what the terminal (the stderr the run started with) shows.

multiprocessing's resource tracker is started first, on the real stderr: it outlives this block
(it ends with the process), and holding the pipe it would keep the reader from seeing its end.
"""
from __future__ import annotations

import contextlib
import datetime
import logging
import os
import select
import sys
import threading
import time
from pathlib import Path

from .log_levels import OUR_PREFIX, TerminalFilter, prefix_only

LOG_NAME = "hidden-states.log"
QUIET_SECONDS = 0.3  # at the end, the reader stops once the pipe has been quiet this long ...
DRAIN_SECONDS = 3.0  # ... or after this long (a process that outlived the run may hold the pipe)
_OURS = OUR_PREFIX.encode()
# vllm-compat's own lines, in this process and (vllm_compat.plugin) in vLLM's
COMPAT_FORMAT = "%(levelname)s [vllm-compat] %(message)s"
COMPAT_LEVEL_ENV = "VLLM_COMPAT_LOG_LEVEL"

_terminal = None  # the terminal while captured, when it is one: for a progress bar
# set by the run once the output directory is its own (claimed): until then the log file is not
# opened, so a refused run adds nothing to a directory that holds another run's files
_claimed = threading.Event()


def directory_claimed() -> None:
    """The run owns its output directory now: the log file may be opened there (a no-op uncaptured)."""
    _claimed.set()


def terminal():
    """The terminal (a text stream) while :func:`captured` shows INFO lines on one; else None."""
    return _terminal


def log_path(output_dir: str | os.PathLike, tag: str | None = None) -> Path:
    """The run's log file: ``hidden-states.log``, or ``hidden-states.<tag>.log`` for a static shard
    (shards share the output directory)."""
    return Path(output_dir) / (LOG_NAME if tag is None else f"hidden-states.{tag}.log")


def has_cuda_device() -> bool:
    """Whether an NVIDIA device node is present (asked without touching CUDA: see vllm_compat.host)."""
    return any(Path("/dev").glob("nvidia[0-9]*"))


@contextlib.contextmanager
def captured(log_file: Path | None, level: int, *, cuda: bool | None = None):
    """Everything printed in this block, by this process and its children, to ``log_file`` (appended,
    from when its directory exists; None: no file) and, filtered at ``level``, to the terminal."""
    global _terminal
    _claimed.clear()
    restore_env = _set_env(level)
    restore_logger = _compat_logger()
    _start_resource_tracker()
    sys.stdout.flush()
    sys.stderr.flush()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    read, write = os.pipe()
    for fd in (1, 2):
        os.dup2(write, fd)
    os.close(write)
    reader = _Reader(read, log_file, saved[2], TerminalFilter(level, cuda=has_cuda_device() if cuda is None else cuda))
    reader.start()
    if level <= logging.INFO and os.isatty(saved[2]):
        _terminal = os.fdopen(os.dup(saved[2]), "w", buffering=1)
    try:
        yield
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        for fd in (1, 2):
            os.dup2(saved[fd], fd)
        reader.stop()
        if _terminal is not None:
            _terminal.close()
            _terminal = None
        for fd in saved.values():
            os.close(fd)
        restore_logger()
        restore_env()


def _set_env(level: int):
    """vLLM's processes read these at import: the file gets vllm-compat's DEBUG lines always, vLLM's
    at ``--log-level debug``. A variable the user set stays as it is."""
    wanted = {COMPAT_LEVEL_ENV: "DEBUG"}
    if level <= logging.DEBUG:
        wanted["VLLM_LOGGING_LEVEL"] = "DEBUG"
    before = {name: os.environ.get(name) for name in wanted}
    for name, value in wanted.items():
        os.environ.setdefault(name, value)

    def restore():
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value

    return restore


def _compat_logger():
    """vllm-compat's lines in this process once each, with their level (the root logger may get a
    handler of its own later: xgrammar's import configures one)."""
    logger = logging.getLogger("vllm_compat")
    before = (logger.handlers[:], logger.level, logger.propagate)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(COMPAT_FORMAT))
    logger.handlers = [handler]
    logger.setLevel(logging.DEBUG)
    logger.propagate = False

    def restore():
        logger.handlers, level, logger.propagate = before[0], before[1], before[2]
        logger.setLevel(level)

    return restore


def _start_resource_tracker() -> None:
    try:
        from multiprocessing import resource_tracker

        resource_tracker.ensure_running()
    except Exception:  # noqa: BLE001 - no tracker here: nothing outlives the block on its account
        pass


class _Reader(threading.Thread):
    """Reads the pipe line by line: each to the log file, the filter's share to the terminal.

    The log file is opened once the run has claimed its output directory (:func:`directory_claimed`,
    after every check: a refused run leaves nothing there, not even in another run's log); the lines
    before are held until then.
    """

    def __init__(self, fd: int, path: Path | None, terminal_fd: int, shown: TerminalFilter):
        super().__init__(name="hidden-states-output", daemon=True)
        self.fd, self.path, self.terminal_fd, self.filter = fd, path, terminal_fd, shown
        self.log = None
        self._held: list[bytes] | None = [] if path is not None else None  # lines before the file opened
        self._stopping = threading.Event()
        self._log_error: OSError | None = None
        self._run_started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")

    def _open(self) -> None:
        """The log file, once the run claimed its directory; the held lines first, and its path to the terminal."""
        if not _claimed.is_set() or not self.path.parent.is_dir():
            return
        held, self._held = self._held, None
        try:
            self.log = open(self.path, "ab")
            self.log.write(f"=== {' '.join(sys.argv)} (pid {os.getpid()}, {self._run_started})\n".encode())
            self.log.writelines(line + b"\n" for line in held)
        except OSError as exc:
            self._log_error = exc
            return
        note = f"[hidden-states] full log: {self.path}".encode()
        self._write(note)
        if self.filter.shows(note.decode()):
            self._to_terminal(note)

    def run(self) -> None:
        pending = b""
        deadline = None
        while True:
            if self._stopping.is_set() and deadline is None:
                deadline = time.monotonic() + DRAIN_SECONDS
            ready, _, _ = select.select([self.fd], [], [], QUIET_SECONDS if deadline else 0.5)
            if not ready:
                if deadline is not None:
                    break
                continue
            chunk = os.read(self.fd, 1 << 16)
            if not chunk:
                break
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                self._line(line)
            if deadline is not None and time.monotonic() > deadline:
                break
        if pending:
            self._line(pending)
        if self._held:  # the run claimed its output directory after its last line
            self._open()
        os.close(self.fd)
        if self.log is not None:
            self.log.close()
        if self._log_error is not None:
            self._to_terminal(f"[hidden-states] warning: the log file stopped: {self._log_error}".encode())

    def _line(self, line: bytes) -> None:
        before, ours, rest = line.partition(_OURS)
        if ours and not prefix_only(before.decode("utf-8", "replace")):
            # another process's output that ended without a newline (a library's report at its exit),
            # then a line of ours: two lines, so that ours is seen, and filtered, as ours
            self._line(before)
            line = ours + rest
        if self._held is not None:
            self._held.append(line)
            self._open()
        else:
            self._write(line)
        if self.filter.shows(line.decode("utf-8", "replace")):
            self._to_terminal(line)

    def _write(self, line: bytes) -> None:
        if self.log is None:
            return
        try:
            self.log.write(line + b"\n")
            self.log.flush()
        except OSError as exc:  # a full disk: the terminal still gets its share
            self._log_error = exc
            with contextlib.suppress(OSError):
                self.log.close()
            self.log = None

    def _to_terminal(self, line: bytes) -> None:
        with contextlib.suppress(OSError):
            os.write(self.terminal_fd, line + b"\n")

    def stop(self) -> None:
        self._stopping.set()
        self.join()
