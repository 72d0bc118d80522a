"""The output directory, written so nothing is ever lost, whatever the format (``formats/``).

* the format's sample files, one per sample index (``data_{i}.pt`` for speculators 0.3/0.4);
* ``done.jsonl``: the resume ledger, one ``{"index": i, "length": n}`` line per finished sample
  (``done.<tag>.jsonl`` for a writer with a tag: each static shard and each data-parallel replica
  appends to a ledger of its own, so no two processes, maybe on two hosts, append to one file; a
  rerun reads them all, whatever mix of writers produced the files);
* ``data_config.json``: model, layer ids, package versions, the vllm-compat adapters applied, the
  format's own description, and what the samples were made from (``identity.py``: the input's
  path, size and hash, the tokenization settings), written before the first sample; a run into a
  directory holding another extraction with finished samples is refused (``OutputDir.check``);
* whatever index files the format writes when a run ends (``sample_lengths.json``);
* ``token_freq.pt`` (``TOKEN_FREQ``), for an input of conversations, once a run has read every row.

Every file is written under a temporary name and renamed into place, so a final name always holds
a whole file. A background thread does the writing from a bounded queue: the model never waits on
disk unless the disk is slower than extraction, and that wait is measured (``stall_seconds``).
The ledger line is written after the rename; a rerun skips every sample whose file exists and ends
whole (files are not fsync'ed, for speed: after a power cut a renamed file whose data never reached
the disk can be empty or cut short, and is redone).
"""
from __future__ import annotations

import fcntl
import json
import os
import queue
import shutil
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from .errors import OutputError
from .files import TEMP_PREFIX, atomic_write_json, describe_os_error, read_json
from .inputs.identity import describe_input, difference, recorded
from .settings import default

LEDGER = "done.jsonl"
LEDGERS = "done*.jsonl"  # every writer's ledger (see ledger_name)
CONFIG = "data_config.json"
LOCK = ".hidden-states.lock"  # held by the run writing into the directory (DirectoryLock)
# The trained tokens' frequencies (speculators 0.9 reads <data-path>/token_freq.pt for
# --draft-vocab-size), written by a run that read every row of an input of conversations
TOKEN_FREQ = "token_freq.pt"


def ledger_name(tag: str | None) -> str:
    """The ledger of the writer tagged ``tag`` (None: the single run's ``done.jsonl``)."""
    return f"done.{tag}.jsonl" if tag else LEDGER


def temp_prefix(tag: str | None) -> str:
    """The start of the temporary names a writer tagged ``tag`` uses: a shard sweeps only its own
    leftovers, never the files another shard is writing right now."""
    return f"{TEMP_PREFIX}{tag}." if tag else TEMP_PREFIX


def format_name(config: dict) -> str:
    """The output format a ``data_config.json`` names; a directory written before formats had names
    holds speculators-0.3, the only format then."""
    return (config.get("format") or {}).get("name", "speculators-0.3")


def os_error_behind(exc: BaseException) -> OSError | None:
    """The OSError behind ``exc``, if any: torch's zip writer, failing to finish a file whose write
    raised (a full disk), raises its own RuntimeError over the OSError."""
    seen = exc
    while seen is not None:
        if isinstance(seen, OSError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


@dataclass(frozen=True)
class Held:
    """Another extraction an output directory holds, which a run replaces (``OutputDir.check``).

    Attributes:
        format: its format's name (the files to remove are that format's).
        finished: its whole sample files.
        input: what it was made from, described (``identity.describe_input``).
    """

    format: str
    finished: int
    input: str

    def line(self, removed: int) -> str:
        done = f"{self.finished} finished samples" if self.finished else "no finished sample"
        return f"replaced the extraction it held ({done}, input {self.input}): {removed} of its files removed"


def _layouts(counts: dict[str, int]) -> str:
    """``4 speculators-0.3 files, 2 speculators-0.5 files``."""
    return ", ".join(f"{count} {name} files" for name, count in counts.items())


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


class OutputDir:
    """An output directory, checked for writability and for belonging to the same extraction.

    Args:
        format: the run's output format (``formats.create``), writing into this directory.
        tag: the writer tag of a run that shares the directory with others running at the same
            time (a static shard): :meth:`prepare` then removes only that tag's temporary files.
        layouts: every format whose files this directory may hold (``formats.readers``), read
            without layers: :meth:`check` counts the finished samples of each.
    """

    def __init__(self, format, tag: str | None = None, layouts=()):
        self.format = format
        self.tag = tag
        self.layouts = tuple(layouts)
        self.path = Path(format.directory)
        self.cut_short: list[int] = []  # samples whose file finished() found incomplete and removed

    def create(self) -> None:
        """Create the directory and check it is writable."""
        if self.path.exists() and not self.path.is_dir():
            raise OutputError(f"--output-dir {self.path}: is a file, not a directory")
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            probe = self.path / f"{TEMP_PREFIX}probe.{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise OutputError(f"--output-dir {describe_os_error(exc, self.path)} (not writable)") from None

    def check(self, identity: dict, start_over: bool = False) -> Held | None:
        """Whether this run may write here, given the extraction the directory holds; reads only.

        Finished samples are counted in every layout the directory may hold (``layouts``), not only
        this run's: a run in another format finds none of its own pattern where the other one's lie.

        Args:
            identity: this run's ``model``, ``layer_ids``, ``input`` and ``tokenization``
                (``identity.py``; its format is this directory's format's).
            start_over: replace another extraction even if it has finished samples (``--start-over``).

        Returns:
            None when the directory holds this same extraction, or none: the run resumes it. Else
            the other extraction, which the run replaces (:meth:`claim`): one with no finished
            sample (a run refused or failed before its first), or any with ``start_over``.

        Raises:
            OutputError: another extraction with finished samples (and no ``start_over``), naming
                both and the two ways on; sample files without a ``data_config.json``.
        """
        config = self.path / CONFIG
        held = self.whole_by_layout()
        finished = sum(held.values())
        if not config.exists():
            if finished:
                layouts = f" ({_layouts(held)})" if set(held) != {self.format.name} else ""
                raise OutputError(f"--output-dir {self.path} holds {finished} sample files{layouts} but no {CONFIG}: "
                                  f"what they were made from is unknown; use another --output-dir")
            return None
        previous = read_json(config, hint="; remove it or use another --output-dir")
        differs = difference({**previous, "format": format_name(previous)}, {**identity, "format": self.format.name})
        if differs is None:
            return None
        if finished and not start_over:
            # the layout named where it is not the recorded format's alone
            layouts = f" ({_layouts(held)})" if set(held) != {format_name(previous)} else ""
            raise OutputError(f"{self.path} holds another extraction ({differs}) with {finished} finished samples"
                              f"{layouts}: use another --output-dir, or --start-over to remove its files and "
                              f"extract this one")
        return Held(format_name(previous), finished, describe_input(recorded(previous)[0]))

    def whole_by_layout(self) -> dict[str, int]:
        """Format name -> whole sample files of that format here, for this run's format and every
        one in ``layouts`` (those with none left out); reads only."""
        counts = {}
        for layout in {self.format.name: self.format, **{other.name: other for other in self.layouts}}.values():
            whole = OutputDir(layout).sample_files()[0]
            if whole:
                counts[layout.name] = len(whole)
        return counts

    def claim(self, identity: dict, config: dict, replaced=None) -> int:
        """Make the directory this run's: remove the files of the extraction it replaces (``replaced``:
        that extraction's format, writing here, after :meth:`check` returned it), this writer's
        leftover temporary files, and write the config (``config`` with ``identity``). Returns the
        files removed."""
        removed = 0
        if replaced is not None:  # every layout's files (check counted them all), the recorded format's last
            for layout in self.layouts:
                if layout.name != replaced.name and OutputDir(layout).sample_files()[0]:
                    removed += self.remove_extraction(layout, config=False)
            removed += self.remove_extraction(replaced)
        for stale in self.path.glob(f"{temp_prefix(self.tag)}*"):
            stale.unlink(missing_ok=True)
        self.samples_dir.mkdir(exist_ok=True)
        atomic_write_json(self.path / CONFIG, {**config, **identity})
        return removed

    def remove_extraction(self, written, config: bool = True) -> int:
        """Remove what an extraction in the format ``written`` wrote here, and nothing else: its
        sample files, ledgers, temporary files and index files, then (``config``) its
        ``data_config.json`` (last: an interrupted removal is redone by the next run, which still
        finds it). Returns the count."""
        samples = (self.path / written.sample_file(0)).parent
        doomed = [Path(entry.path) for entry in (os.scandir(samples) if samples.is_dir() else ())
                  if written.sample_index(entry.name) is not None]
        doomed += sorted(self.path.glob(LEDGERS)) + sorted(self.path.glob(f"{TEMP_PREFIX}*"))
        doomed += [self.path / name for name in (*written.index_files(), TOKEN_FREQ)]
        for path in doomed:
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        if samples != self.path:
            try:
                samples.rmdir()  # only when nothing else is in it
            except OSError:
                pass
        if not config:
            return len(doomed)
        (self.path / CONFIG).unlink(missing_ok=True)
        return len(doomed) + 1

    @property
    def samples_dir(self) -> Path:
        """The folder of the format's sample files (the directory itself, or a folder in it)."""
        return (self.path / self.format.sample_file(0)).parent

    def sample_files(self) -> tuple[set[int], dict[int, Path]]:
        """The samples whose file is whole, and the files cut short by index; reads only."""
        whole, cut_short = set(), {}
        for entry in os.scandir(self.samples_dir) if self.samples_dir.is_dir() else ():
            index = self.format.sample_index(entry.name)
            if index is None:
                continue
            if self.format.ends_whole(Path(entry.path)):
                whole.add(index)
            else:
                cut_short[index] = Path(entry.path)
        return whole, cut_short

    def finished(self) -> dict[int, int | None]:
        """Sample index -> length (None when only the file tells) of every finished sample; files
        cut short are removed (and listed in ``cut_short``)."""
        whole, cut_short = self.sample_files()
        lengths: dict[int, int | None] = dict.fromkeys(whole)
        for index, path in cut_short.items():
            self.cut_short.append(index)
            os.unlink(path)
        for ledger in sorted(self.path.glob(LEDGERS)):
            for raw in ledger.read_text().splitlines():
                try:
                    record = json.loads(raw)
                except json.JSONDecodeError:  # a line cut short by a crash
                    continue
                if record.get("index") in lengths:
                    lengths[record["index"]] = record["length"]
        return lengths

    def finish(self, lengths: dict[int, int | None]) -> None:
        """Hand every finished sample's length to the format's end-of-run hook; a file renamed into
        place before a crash took its ledger line is asked for its length."""
        complete = {index: length if length is not None else self.format.read_length(
                    self.path / self.format.sample_file(index)) for index, length in lengths.items()}
        self.format.finish(complete)


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
