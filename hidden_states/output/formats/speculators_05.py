"""speculators >= 0.5's layout, what its ``ArrowDataset`` reads through the ``file`` hidden-states
backend (``speculators/train/data.py``, ``hs_connectors/transfer.py:FileTransfer`` in 0.9.0):

* the output directory is a dataset saved with ``datasets.Dataset.save_to_disk``, torch format,
  columns ``input_ids`` (int64 [T]), ``loss_mask`` (int64 [T]) and ``seq_len`` (int64); row ``i`` is
  sample ``i`` (the trainer opens ``hidden_states/hs_{row}.safetensors`` for row ``row``);
* ``hidden_states/hs_{i}.safetensors``: ``hidden_states`` [T, n_layers, hidden] (the layers in
  ascending id order, as vLLM's ``extract_hidden_states`` stacks them; the trainer fuses all but the
  last and takes the last as the verifier's final state) and ``token_ids`` int64 [T], which the
  trainer compares with the row's ``input_ids``; plus ``loss_mask`` int64 [T], which the trainer
  does not read: it lets the dataset be rebuilt from the files alone (resume, ``convert``).
* ``token_freq.pt``: the trained tokens' frequencies, for an input of conversations (speculators
  0.9 reads ``<data-path>/token_freq.pt`` for ``--draft-vocab-size``);
* with ``--state-dtype fp8``: ``hidden_states`` float8_e4m3fn and ``hidden_states_scales`` float32
  [T, 1, 1], as speculators 0.9's FP8 hs-connector writes them (``fp8_states``); its trainer reads
  them with ``--hidden-states-backend fp8``, which dequantizes.

``hidden-states generate`` streams a reply's file while the engine generates (:class:`StreamedFile`):
its states first, at a reserved header's end, then the ids and the FP8 scales, then the header, so
a file may lay its tensors out in another order than :func:`write_safetensors` (readers go by the
header's offsets).

Layer ids count decoder layers done (``layer_conventions``): this format's ``k`` is the extractor's
``k - 1``. The dataset is written when a run ends, over samples ``0 .. n-1``, and only when every one
of them has its file: the trainer maps row ``i`` to file ``i``, so a gap would misalign or stall it.
"""
from __future__ import annotations

import os
import re
import shutil
import struct
from pathlib import Path
from typing import BinaryIO

from ... import extras, fp8_states
from ...errors import OutputError
from ...inputs.streams import Sample
from ...layer_conventions import MEANING, SPECULATORS_05, from_extractor
from ..names import TOKEN_FREQ
from ..writer import Continued
from . import Layers
from .safetensors_files import (SAFETENSORS_DTYPES, safetensors_header, safetensors_json, state_tensors,
                                write_safetensors)

STATES_DIR = "hidden_states"
SAMPLE_FILE = re.compile(r"^hs_(\d+)\.safetensors$")
DATASET_FILES = re.compile(r"^(data-\d{5}-of-\d{5}\.arrow|dataset_info\.json|state\.json)$")
DATASET_TEMP = ".tmp-dataset"
UNQUANTIZED = "unquantized states"  # a record's host states that its writer thread quantizes (FP8)
STREAMED = "streamed states"  # a record's StreamedFile and its states' views, whose rows it holds from the start
RESERVED_HEADER = 2048  # bytes a streamed file keeps for its header (8-byte length + JSON): the states start after


def sample_tensors(input_ids, loss_mask, states, state_dtype: str = "model") -> dict:
    """One sample file's tensors from its per-layer states (see :func:`state_tensors`)."""
    return {**state_tensors(states, state_dtype), **id_tensors(input_ids, loss_mask)}


def id_tensors(input_ids, loss_mask) -> dict:
    import torch

    return {"token_ids": torch.as_tensor(input_ids, dtype=torch.long),
            "loss_mask": torch.as_tensor(loss_mask, dtype=torch.long)}


class StreamedFile:
    """A sample file begun while its reply is generated (``backends.reply_streams``'s sink), under the
    writer's temporary name for the sample (``BackgroundWriter.temp_path``): each reply row's layers
    go at their place after a reserved header as the region counts them. The writer finishes it
    (:meth:`Speculators05.save`): the rows from ``kept`` on again, the rest of the tensors, the
    header; a file never finished is the writer's leftover, removed by the next run's start.

    Attributes:
        rows: rows written, in order from the first.
        kept: of those, the rows its sample's final states still hold (set once they are known,
            ``VllmEngineBackend``: the rows before the training row's prefill and any row stored
            again); None: not (yet) a sample's file, the writer writes it whole.
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        # opened for each append, never held: a run with thousands of replies in flight would
        # otherwise hold as many descriptors (the process's limit is often 1,024)
        os.close(os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644))
        self.rows = 0
        self.row_bytes: int | None = None
        self.kept: int | None = None
        self.error: BaseException | None = None

    def append(self, rows) -> None:
        """Rows ``rows .. rows + len(rows)``: a uint8 tensor ``[n, layers, bytes per layer]``, contiguous."""
        if not len(rows):
            return
        row_bytes = rows[0].numel()
        if self.row_bytes is None:
            self.row_bytes = row_bytes
        elif row_bytes != self.row_bytes:
            raise ValueError(f"a row of {row_bytes} bytes after rows of {self.row_bytes}")
        fd = os.open(self.path, os.O_WRONLY)
        try:
            _write_at(fd, memoryview(rows.reshape(-1).numpy()), RESERVED_HEADER + self.rows * row_bytes)
        finally:
            os.close(fd)
        self.rows += len(rows)

    def fail(self, error: BaseException) -> None:
        self.error = error

    def discard(self) -> None:
        """Remove it (its reply's row took a region of its own, or none came)."""
        self.path.unlink(missing_ok=True)


def _write_at(fd: int, data: memoryview, position: int) -> None:
    while data:
        written = os.pwrite(fd, data, position)
        data, position = data[written:], position + written


def finish_streamed(record: dict, handle: BinaryIO) -> bool:
    """Finish a streamed file in ``handle`` (opened on it, not truncated): its states' rows from the
    first its stream does not hold as final, then ``token_ids``, ``loss_mask`` and FP8's scales after
    the states, then the header in the room reserved. False, nothing written: it cannot be (its
    stream failed or never became the sample's; a tensor after the states would not start 8-byte
    aligned; the header outgrows its room), and the file is written whole instead."""
    import torch

    stream, states = record[STREAMED]
    tokens, count = int(record["token_ids"].shape[0]), len(states)
    if stream.error is not None or stream.kept is None:
        return False
    row_bytes = count * states[0].shape[1] * states[0].element_size()
    if str(states[0].dtype).removeprefix("torch.") not in SAFETENSORS_DTYPES or (tokens * row_bytes) % 8 \
            or stream.row_bytes not in (None, row_bytes):
        return False
    after = [(name, tensor) for name, tensor in record.items() if name != STREAMED]  # ids, mask, any extra
    if isinstance(states, fp8_states.Quantized):
        after.append((fp8_states.SCALES, states.scales.contiguous()))
    after.sort(key=lambda item: -item[1].element_size())  # each after the states starts aligned to its size
    header = safetensors_json([("hidden_states", states[0].dtype, [tokens, count, states[0].shape[1]]),
                               *((name, tensor.dtype, list(tensor.shape)) for name, tensor in after)])
    if len(header) > RESERVED_HEADER - 8:
        return False
    start = min(stream.kept, stream.rows, tokens)
    handle.seek(RESERVED_HEADER + start * row_bytes)
    rows = torch.stack([layer[start:].contiguous().view(torch.uint8) for layer in states], dim=1)
    handle.write(memoryview(rows.reshape(-1).numpy()))
    for _, tensor in after:
        handle.write(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))
    handle.truncate()
    handle.seek(0)
    handle.write(struct.pack("<Q", RESERVED_HEADER - 8) + header + b" " * (RESERVED_HEADER - 8 - len(header)))
    return True


def read_sample(path: Path) -> dict:
    """``hidden_states``, ``token_ids`` and ``loss_mask`` of one sample file (and an FP8 file's
    ``hidden_states_scales``)."""
    from safetensors.torch import load_file

    return load_file(str(path))


class Speculators05:
    name = SPECULATORS_05
    state_dtypes = fp8_states.STATE_DTYPES
    state_dtype = "model"
    # speculators 0.9's --draft-vocab-size reads <data-path>/token_freq.pt (FP8 states or not)
    token_frequencies_file = TOKEN_FREQ

    def __init__(self, directory: Path, layers: Layers | None, log=None):
        self.directory = directory
        self.layers = layers
        self.log = log
        if layers is not None and list(layers.ids) != sorted(set(layers.ids)):
            raise ValueError(f"{self.name} stores layers once each, in ascending order; got {layers.ids}")

    @property
    def layer_ids(self) -> list[int]:
        """The layer ids in this format's own convention."""
        return from_extractor(self.name, self.layers.ids)

    def describe(self) -> dict:
        ids = self.layer_ids
        fp8 = self.state_dtype == "fp8"
        states = f"[seq_len, {len(ids)}, {self.layers.hidden_size}] (layers {ids} in this order)"
        described = {
            "name": self.name,
            "state_dtype": self.state_dtype,
            "layer_ids": ids,
            "layer_convention": MEANING[self.name],
            "file_pattern": f"{STATES_DIR}/hs_{{idx}}.safetensors",
            "hidden_states": f"float8_e4m3fn {states}" if fp8 else states,
            "token_ids": "int64 [seq_len]",
            "loss_mask": "int64 [seq_len] (all ones when the input has none; the dataset's column too)",
            "dataset": "datasets.save_to_disk in the output directory: input_ids, loss_mask, seq_len",
            "train_with": f"--data-path <this directory> --target-layer-ids {' '.join(map(str, ids[:-1]))}"
                          + (" --hidden-states-backend fp8" if fp8 else ""),
        }
        if fp8:
            described[fp8_states.SCALES] = ("float32 [seq_len, 1, 1]: state = fp8 * scale, scale = the token's "
                                           "max |state| over its layers / 448")
        return described

    def sample_file(self, index: int) -> str:
        return f"{STATES_DIR}/hs_{index}.safetensors"

    def sample_index(self, file_name: str) -> int | None:
        match = SAMPLE_FILE.match(Path(file_name).name)
        return int(match.group(1)) if match else None

    def ends_whole(self, path: Path) -> bool:
        return safetensors_header(path) is not None

    def record(self, sample: Sample, states: list, extra: dict | None = None) -> dict:
        n = len(sample.input_ids)
        mask = sample.loss_mask if sample.loss_mask is not None else [1] * n
        if self.state_dtype == "fp8" and not isinstance(states, fp8_states.Quantized) and states[0].device.type == "cpu":
            # already on the host: quantized on a writer thread (save), not on the extraction loop's
            return {**id_tensors(sample.input_ids, mask), UNQUANTIZED: list(states), **(extra or {})}
        return {**sample_tensors(sample.input_ids, mask, states, self.state_dtype), **(extra or {})}

    def stream_file(self, path: Path) -> StreamedFile:
        return StreamedFile(path)

    def streamed_record(self, sample: Sample, states: list, stream: StreamedFile, extra: dict | None = None) -> Continued:
        """The record of a sample whose file ``stream`` began (its rows before ``stream.kept`` in place);
        ``states``: the sample's final states, one ``[T, hidden]`` per layer (or
        ``fp8_states.Quantized``), whose rows past those the writer writes."""
        n = len(sample.input_ids)
        mask = sample.loss_mask if sample.loss_mask is not None else [1] * n
        return Continued({**id_tensors(sample.input_ids, mask), STREAMED: (stream, states), **(extra or {})})

    def save(self, record: dict, handle: BinaryIO) -> None:
        if STREAMED in record:
            if finish_streamed(record, handle):
                return
            stream, states = record[STREAMED]
            handle.seek(0)
            handle.truncate()
            record = {**{key: value for key, value in record.items() if key != STREAMED},
                      **state_tensors(states, self.state_dtype)}
        if UNQUANTIZED in record:
            states = record[UNQUANTIZED]
            record = {**{key: value for key, value in record.items() if key != UNQUANTIZED},
                      **state_tensors(states, "fp8")}
        write_safetensors(record, handle)

    def length(self, record: dict) -> int:
        return int(record["token_ids"].shape[0])

    def read_length(self, path: Path) -> int:
        header = safetensors_header(path)
        if header is None:
            raise OutputError(f"{path}: not a whole safetensors file")
        return int(header["token_ids"]["shape"][0])

    def index_files(self) -> list[str]:
        return sorted(p.name for p in self.directory.iterdir() if DATASET_FILES.match(p.name)) \
            if self.directory.is_dir() else []

    def finish(self, lengths: dict[int, int]) -> None:
        """Write the dataset over samples ``0 .. n-1`` when each has its file; otherwise say why not."""
        missing = sorted(set(range(max(lengths, default=-1) + 1)) - set(lengths))
        if not lengths or missing:
            shown = ", ".join(map(str, missing[:10])) + (f" and {len(missing) - 10} more" if len(missing) > 10 else "")
            self.log(f"{self.name}: the dataset index is not written: "
                     + (f"samples {shown} have no file yet" if missing else "no sample is finished")
                     + " (the trainer maps row i to hs_i.safetensors); extract them and it is")
            return
        write_dataset(self.directory, len(lengths))


def _rows(directory: Path, count: int):
    from safetensors import safe_open

    for index in range(count):
        with safe_open(str(directory / STATES_DIR / f"hs_{index}.safetensors"), framework="pt") as handle:
            ids = handle.get_tensor("token_ids")
            mask = handle.get_tensor("loss_mask")
        yield {"input_ids": ids.tolist(), "loss_mask": mask.tolist(), "seq_len": int(ids.shape[0])}


def write_dataset(directory: Path, count: int) -> None:
    """The Arrow dataset of samples ``0 .. count-1``, built from their files (streaming: one sample's
    ids at a time), saved beside them; the previous one is replaced, its state file last."""
    try:
        import datasets
    except ImportError:
        raise OutputError(f"{SPECULATORS_05} needs the 'datasets' package to write its dataset index "
                          f"({extras.install_hint('datasets')}); the sample files are whole, rerun to write "
                          f"it") from None
    datasets.disable_progress_bars()  # the run's own log says what happens; no bars in it
    temp = directory / DATASET_TEMP
    shutil.rmtree(temp, ignore_errors=True)
    features = datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int64")),
                                  "loss_mask": datasets.Sequence(datasets.Value("int64")),
                                  "seq_len": datasets.Value("int64")})
    try:
        dataset = datasets.Dataset.from_generator(_rows, gen_kwargs={"directory": directory, "count": count},
                                                  features=features, cache_dir=str(temp / "cache"))
        dataset.set_format(type="torch")
        dataset.save_to_disk(str(temp / "saved"))
        del dataset
        written = sorted(p.name for p in (temp / "saved").iterdir())
        for name in written:
            if name != "state.json":
                os.replace(temp / "saved" / name, directory / name)
        os.replace(temp / "saved" / "state.json", directory / "state.json")
        for stale in directory.iterdir():
            if DATASET_FILES.match(stale.name) and stale.name not in written:
                stale.unlink()
    except OSError as exc:
        raise OutputError(f"{directory}: writing the dataset index: {exc.strerror or exc}") from None
    finally:
        shutil.rmtree(temp, ignore_errors=True)


FORMAT = Speculators05
