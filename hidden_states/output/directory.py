"""An output directory (:class:`OutputDir`): checked against the run's identity, prepared, its
finished samples read, its index written when the run ends."""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from ..errors import OutputError
from ..files import TEMP_PREFIX, atomic_write_json, describe_os_error, read_json
from ..inputs.identity import describe_input, difference, recorded
from .names import CONFIG, LEDGERS, TOKEN_FREQ, format_name, temp_prefix


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
        # TOKEN_FREQ whatever the format: a speculators-0.3 directory written before the layout decided
        # it holds one too
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
    def token_frequencies(self) -> Path | None:
        """Where this run writes the trained tokens' frequencies, for an input of conversations: the
        file its format's trainer reads them from; None: the format's trainer reads none here."""
        name = self.format.token_frequencies_file
        return self.path / name if name is not None else None

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
