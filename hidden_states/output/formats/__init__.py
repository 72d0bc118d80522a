"""Output formats: how extracted samples lie on disk, behind one interface (:class:`Format`).

A format is a writer. It names each sample's file, turns one sample and its states into a record,
saves a record into an open file, tells a whole file from one cut short, describes itself for
``data_config.json``, names the token frequencies file its trainer reads (if any), writes its index files when a run ends and names them (for ``--start-over``). Everything around that is shared
by every format (``output/``): the temporary name and the rename, the background writer threads,
the ``done.jsonl`` ledger, resume and the finished set.

A new format is a module here with a class following :class:`Format`, registered in
:data:`FORMATS` under the name ``--format`` takes.
"""
from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Callable, Protocol

from ...files import TEMP_PREFIX

if TYPE_CHECKING:
    from ...inputs.streams import Sample


@dataclass(frozen=True)
class Layers:
    """The captured layers, as the extractor counts them.

    Attributes:
        ids: layer ids in the order listed (``--layer-ids``), speculators 0.3/0.4's convention: id
            ``L`` is the output of decoder layer ``L`` before the final norm. A format that counts
            otherwise translates (speculators 0.5 counts "after k layers": its ``k`` is our ``k - 1``).
        num_layers: decoder layers of the model.
        hidden_size: width of every state.
    """

    ids: list[int]
    num_layers: int
    hidden_size: int


class Format(Protocol):
    """One run's output format, writing into ``directory``.

    ``record`` runs on the extraction loop's thread; ``save`` on a writer thread, into a temporary
    file that the shared writer renames to ``sample_file(index)`` once ``save`` returns.
    """

    name: str
    directory: Path
    layers: Layers | None  # None only for a bare writer (bench/writer.py): no describe or finish
    log: Callable[[str], None] | None  # the run's logger, one line per message (None: layers is None too)

    def describe(self) -> dict: ...  # data_config.json's "format" entry

    def sample_file(self, index: int) -> str: ...  # the file name of sample ``index``

    def sample_index(self, file_name: str) -> int | None: ...  # inverse of sample_file; None: not a sample

    def ends_whole(self, path: Path) -> bool: ...  # False: cut short (a crash before it reached the disk)

    state_dtypes: tuple[str, ...]  # the --state-dtype values its trainer reads (fp8_states.STATE_DTYPES)
    # the file in ``directory`` its trainer reads the trained tokens' frequencies from, written by a run of
    # conversations that read every row (``names.TOKEN_FREQ``); None: its trainer reads none there, and
    # a file the trainer does not expect may be taken for a sample (speculators 0.3/0.4 load every *pt)
    token_frequencies_file: str | None
    state_dtype: str  # this writer's

    # states: one [n, hidden] per layers.ids entry, on any device; extra: tensors stored beside them under
    # their own names, which no trainer reads (a row's certificate: certify.certificate)
    def record(self, sample: Sample, states: list, extra: dict | None = None) -> object: ...

    # a file a sample's rows are streamed into as they are computed, begun at ``path`` (the writer's
    # temporary name; ``BackgroundWriter.sink``); None: this format writes whole files only
    def stream_file(self, path: Path) -> object | None: ...

    # the record finishing a file ``stream_file`` began (called only for such a file)
    def streamed_record(self, sample: Sample, states: list, stream, extra: dict | None = None) -> object: ...

    def save(self, record, handle: BinaryIO) -> None: ...

    def length(self, record) -> int: ...  # tokens of a record (the ledger's length)

    def read_length(self, path: Path) -> int: ...  # tokens of a whole sample file the ledger lacks

    def finish(self, lengths: dict[int, int]) -> None: ...  # every finished sample's length, at the end of a run

    def index_files(self) -> list[str]: ...  # the files ``finish`` wrote in ``directory`` (names), those present


# --format name -> module of this package holding the format's class (imported when used)
FORMATS = {"speculators-0.3": "speculators_03", "speculators-0.5": "speculators_05"}


def state_dtypes(name: str) -> tuple[str, ...]:
    """The ``--state-dtype`` values format ``name``'s trainer reads."""
    return importlib.import_module(f"{__name__}.{FORMATS[name]}").FORMAT.state_dtypes


def create(name: str, directory: Path, layers: Layers | None = None, *, log: Callable[[str], None] | None = None,
           state_dtype: str = "model") -> Format:
    """The format ``name`` writing into ``directory``.

    Args:
        name: a ``--format`` name.
        directory: the output directory.
        layers: the captured layers; None for a format that only names and reads files, or a bare writer.
        log: the run's logger, through which the format says what it does at the end of a run
            (``finish``); needed with ``layers``.
        state_dtype: how the states are stored (``fp8_states.STATE_DTYPES``); refused where the
            format's trainer cannot read it.
    """
    if name not in FORMATS:
        raise ValueError(f"unknown format {name!r} (known: {', '.join(FORMATS)})")
    if layers is not None and log is None:
        raise ValueError(f"format {name!r} writing a run needs the run's logger (log=)")
    module = importlib.import_module(f"{__name__}.{FORMATS[name]}")
    if state_dtype not in module.FORMAT.state_dtypes:
        raise ValueError(f"format {name!r} stores states as {', '.join(module.FORMAT.state_dtypes)}, not {state_dtype}")
    layout = module.FORMAT(Path(directory), layers, log)
    layout.state_dtype = state_dtype
    return layout


def sample_files(name: str, directory: Path) -> dict[int, Path]:
    """Every sample file of format ``name`` in ``directory``, by sample index (a file being written,
    under its temporary name, left out); reads only."""
    layout = create(name, directory)
    folder = (directory / layout.sample_file(0)).parent
    found = {}
    for entry in os.scandir(folder) if folder.is_dir() else ():
        index = layout.sample_index(entry.name)
        if index is not None and not entry.name.startswith(TEMP_PREFIX):
            found[index] = Path(entry.path)
    return found


def readers(directory: Path) -> list[Format]:
    """Every format, reading ``directory`` (no layers): what names and tells whole the files of any
    layout an output directory may hold."""
    return [create(name, directory) for name in FORMATS]
