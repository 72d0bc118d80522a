"""The background writer (:class:`BackgroundWriter`): finished samples to their files on threads
from a bounded queue, each renamed into place, then its ledger line."""
from __future__ import annotations

import json
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import OutputError
from ..files import describe_os_error
from ..settings import default
from .names import ledger_name, temp_prefix


def os_error_behind(exc: BaseException) -> OSError | None:
    """The OSError behind ``exc``, if any: torch's zip writer, failing to finish a file whose write
    raised (a full disk), raises its own RuntimeError over the OSError."""
    seen = exc
    while seen is not None:
        if isinstance(seen, OSError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


class Continued(dict):
    """A record whose temporary file is begun already (``formats.speculators_05.StreamedFile``, at
    :meth:`BackgroundWriter.temp_path`): the writer opens it to finish it, not to start it again."""


@dataclass
class WriterStats:
    files: int = 0
    bytes: int = 0
    stall_seconds: float = 0.0  # time the producer waited for queue space (the final drain is added by the caller)
    write_seconds: float = 0.0
    threads: int = 0  # writing threads at the most (the drain's excluded)
    lengths: dict[int, int] = field(default_factory=dict)


class BackgroundWriter:
    """Writes finished samples on threads from a bounded queue; errors surface in the caller.

    Each record goes to a temporary file that ``format.save`` fills, is renamed to the format's
    sample file, then gets its ledger line.

    Args:
        directory: where the sample files go.
        max_pending: samples allowed to wait for the disk before ``submit`` blocks.
        threads: writer threads to start with (``torch.save`` serialises one file at a time; several
            keep a fast disk busy).
        max_threads: the threads double every ``GROW_INTERVAL`` seconds in which ``submit`` waited
            for queue space for at least ``GROW_STALL`` of that time, up to this many (None:
            ``threads``, a fixed number; doubling, not one at a time: a run of a few seconds is over
            before one thread per interval reaches what its disk needs). A run whose files grow
            faster than its forward (rows served from shared prefixes write several times the bytes
            they compute) gets the threads its disk needs, and one that keeps up gets none.
        format: the output format (``formats.create``) whose files this writer writes.
        tag: this writer's name among several writing into one directory (a shard, a replica):
            its ledger is ``done.<tag>.jsonl`` and its temporary files carry the tag.
    """

    GROW_INTERVAL = 0.5  # seconds between two growths: each gets time to show what it changes
    # the share of an interval spent waiting that doubles the threads. Counted over the interval, not per
    # wait: with files of tens of MB a slot frees every few ms, so a starved run waits often and briefly
    GROW_STALL = 0.1

    def __init__(self, directory: Path, max_pending: int = default("writer_queue"),
                 threads: int = default("writer_threads"), *, format, tag: str | None = None,
                 max_threads: int | None = None):
        if threads < 1:
            raise ValueError(f"BackgroundWriter needs at least one thread, got {threads}")
        self.max_threads = max(threads, max_threads or threads)
        self._grown_at = time.perf_counter()
        self._stall_since_grown = 0.0
        self.directory = Path(directory)
        self.format = format
        self.stats = WriterStats()
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        # unbuffered: a failed line never flushes at close
        self.ledger = self.directory / ledger_name(tag)
        self._temp_prefix = temp_prefix(tag)
        self._ledger = self.ledger.open("ab", buffering=0)
        self._threads: list[threading.Thread] = []
        self._sinks: dict = {}  # by sample index: the file begun for its rows (sink), until write
        for _ in range(threads):
            self._start_thread()

    def _start_thread(self) -> None:
        thread = threading.Thread(target=self._run, name=f"hidden-states-writer-{len(self._threads)}", daemon=True)
        thread.start()
        self._threads.append(thread)
        self.stats.threads = len(self._threads)

    def submit(self, index: int, record: dict) -> None:
        self._raise_if_failed()
        started = time.perf_counter()
        while True:
            try:
                self._queue.put((index, record), timeout=0.5 if len(self._threads) >= self.max_threads else 0.05)
                break
            except queue.Full:
                self._raise_if_failed()
                self._consider_growing(time.perf_counter() - started)
        waited = time.perf_counter() - started
        self.stats.stall_seconds += waited
        self._stall_since_grown += waited
        self._consider_growing(0.0)

    def _consider_growing(self, waiting: float) -> None:
        """Once per ``GROW_INTERVAL``: twice the threads (at most ``max_threads``) if ``submit`` waited
        for ``GROW_STALL`` of it (``waiting``: the wait still under way, not yet counted)."""
        now = time.perf_counter()
        if len(self._threads) >= self.max_threads or now - self._grown_at < self.GROW_INTERVAL:
            return
        if self._stall_since_grown + waiting >= self.GROW_STALL * (now - self._grown_at):
            for _ in range(min(len(self._threads), self.max_threads - len(self._threads))):
                self._start_thread()
        # the wait under way counts from here on: what of it came before is this interval's
        self._grown_at, self._stall_since_grown = now, -waiting

    def sink(self, index: int):
        """The file sample ``index``'s rows go to as they are computed (``generate``'s replies: the
        backend streams each row as the engine generates it), begun under this writer's temporary
        name by the format (``Format.stream_file``); None where the format writes whole files only,
        or the file cannot be begun (then it is written whole by :meth:`write`, where an error that
        stays is said). :meth:`write` finishes it."""
        try:
            sink = self.format.stream_file(self.temp_path(index))
        except OSError:
            return None
        if sink is not None:
            self._sinks[index] = sink
        return sink

    def write(self, sample, states: list, extra: dict | None = None):
        """Hand ``sample``'s file to the threads: its record made by the format from ``states`` (one
        per layer, on any device), finishing the file its :meth:`sink` began where that holds the
        rows it should (else that file is removed and the file written whole); ``extra``: tensors the
        file holds beside (``Format.record``). Returns the sink whose file it finishes, or None."""
        sink = self._sinks.pop(sample.index, None)
        if sink is not None and sink.kept is not None and sink.error is None:
            self.submit(sample.index, self.format.streamed_record(sample, states, sink, *([extra] if extra else [])))
            return sink
        if sink is not None:
            sink.discard()
        # (without extra tensors, called as a format written before they existed is)
        self.submit(sample.index, self.format.record(sample, states, *([extra] if extra else [])))
        return None

    def temp_path(self, index: int) -> Path:
        """Where sample ``index``'s file is written before its rename: this writer's temporary name for it."""
        return self.directory / f"{self._temp_prefix}{Path(self.format.sample_file(index)).name}.{os.getpid()}"

    def lengths_written(self) -> dict[int, int]:
        """A copy of ``stats.lengths`` (sample index -> length of every file written and in the
        ledger so far), safe while the threads write."""
        with self._lock:
            return dict(self.stats.lengths)

    def close(self, drain_threads: int = 0) -> None:
        """Write everything queued, stop the threads, raise the first write error if any.

        ``drain_threads`` more threads join in first: what is queued when a run ends is its last
        batch, written after the model has finished (the run's tail), when nothing else needs the
        cores."""
        for i in range(drain_threads):
            thread = threading.Thread(target=self._run, name=f"hidden-states-writer-drain-{i}", daemon=True)
            thread.start()
            self._threads.append(thread)
        for _ in self._threads:
            self._queue.put(None)
        for thread in self._threads:
            thread.join()
        self._ledger.close()
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if self._error is not None:
                continue  # drain: after a failure nothing more is written
            index, record = item
            final = self.directory / self.format.sample_file(index)
            temp = self.temp_path(index)
            started = time.perf_counter()
            try:
                with open(temp, "r+b" if isinstance(record, Continued) else "wb") as handle:
                    self.format.save(record, handle)
                os.replace(temp, final)
            except BaseException as exc:  # noqa: BLE001 - carried to the main thread
                temp.unlink(missing_ok=True)
                cause = os_error_behind(exc)
                if cause is not None:
                    exc = OutputError(f"writing sample {index}: {describe_os_error(cause, final)}")
                self._error = self._error or exc
                continue
            length = self.format.length(record)
            size = final.stat().st_size
            with self._lock:
                try:
                    self._ledger.write((json.dumps({"index": index, "length": length}) + "\n").encode())
                except OSError as exc:  # the file is whole: a rerun keeps it and asks it for its length
                    self._error = self._error or OutputError(describe_os_error(exc, self.ledger))
                    continue
                self.stats.files += 1
                self.stats.bytes += size
                self.stats.write_seconds += time.perf_counter() - started
                self.stats.lengths[index] = length
