"""speculators 0.3/0.4's layout, what its ``Eagle3SampleFileDataset`` reads:

* ``data_{i}.pt``: ``{"input_ids": LongTensor[n], "hidden_states": [Tensor[n, hidden] per layer],
  "loss_mask": LongTensor[n]}`` (``speculators.train.data.standardize_data_v1``);
* ``sample_lengths.json``: ``{"i": n}`` for every finished sample (the trainer's length index).

Layer ids are written as the extractor counts them (speculators 0.3/0.4's own convention).
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import BinaryIO

from ...files import atomic_write_json
from ...inputs.streams import Sample
from . import Layers

DATA_FILE = re.compile(r"^data_(\d+)\.pt$")
LENGTHS = "sample_lengths.json"
ZIP_END = b"PK\x05\x06"  # torch.save writes a zip: its end-of-central-directory record comes last


class Speculators03:
    name = "speculators-0.3"
    state_dtypes = ("model",)  # its trainer reads states as they are: no FP8 scales in this layout
    state_dtype = "model"
    # its trainer reads no token frequencies, and its dataset, given the directory, loads every file
    # whose name ends in "pt" as a sample (speculators/train/data.py ``list_files``): a token_freq.pt
    # here would stop its training (KeyError: 'hidden_states')
    token_frequencies_file = None

    def __init__(self, directory: Path, layers: Layers | None, log=None):
        self.directory = directory
        self.layers = layers
        self.log = log

    def describe(self) -> dict:
        return {
            "name": self.name,
            "file_pattern": "data_{idx}.pt",
            "input_ids": "torch.long [seq_len]",
            "hidden_states": f"list of {len(self.layers.ids)} x [seq_len, {self.layers.hidden_size}] (output of "
                             "each layer in layer_ids, before the final norm)",
            "loss_mask": "torch.long [seq_len] (all ones when the input has none)",
        }

    def sample_file(self, index: int) -> str:
        return f"data_{index}.pt"

    def sample_index(self, file_name: str) -> int | None:
        match = DATA_FILE.match(file_name)
        return int(match.group(1)) if match else None

    def ends_whole(self, path: Path) -> bool:
        """Whether ``path`` ends the way every complete ``torch.save`` file does (one seek and read)."""
        try:
            with open(path, "rb") as handle:
                handle.seek(-22, os.SEEK_END)
                return handle.read(4) == ZIP_END
        except OSError:  # shorter than the record, or unreadable
            return False

    def record(self, sample: Sample, states: list, extra: dict | None = None) -> dict:
        import torch

        n = len(sample.input_ids)
        mask = sample.loss_mask if sample.loss_mask is not None else [1] * n
        return {"input_ids": torch.tensor(sample.input_ids, dtype=torch.long),
                "hidden_states": [layer.cpu() for layer in states],
                "loss_mask": torch.tensor(mask, dtype=torch.long), **(extra or {})}

    def stream_file(self, path: Path) -> None:
        """None: a speculators-0.3 file stores each layer whole (``[T, hidden]``), so a row's layers
        never lie side by side to be written as the row comes."""
        return None

    def streamed_record(self, sample: Sample, states: list, stream, extra: dict | None = None) -> dict:
        raise TypeError("speculators-0.3 files are written whole: no file of it is streamed")

    def save(self, record: dict, handle: BinaryIO) -> None:
        import torch

        config = getattr(torch.serialization, "config", None)
        if config is not None and hasattr(config.save, "compute_crc32"):
            # zip CRCs cost a pass over every byte on one core; torch.load does not check them
            config.save.compute_crc32 = False
        # A layer handed over as a view (vllm-native's are columns of vLLM's [tokens, layers, hidden]
        # file; a row served from a longer row's states is its first rows) gets a storage of its own
        # bytes here, on a writer thread: torch.save writes a view's whole storage, and the trainer's
        # tensors would load as views of it.
        record = {**record, "hidden_states": [own_storage(layer) for layer in record["hidden_states"]]}
        # into a Python file: torch's own C++ writer reports a full disk as a RuntimeError
        # ("basic_ios::clear", "unexpected pos") that names neither the cause nor the file
        torch.save(record, handle)

    def length(self, record: dict) -> int:
        return int(record["input_ids"].shape[0])

    def read_length(self, path: Path) -> int:
        import torch

        return int(torch.load(path, weights_only=True, mmap=True)["input_ids"].shape[0])

    def index_files(self) -> list[str]:
        return [LENGTHS] if (self.directory / LENGTHS).exists() else []

    def finish(self, lengths: dict[int, int]) -> None:
        atomic_write_json(self.directory / LENGTHS, {str(index): length for index, length in sorted(lengths.items())})


FORMAT = Speculators03


def own_storage(tensor):
    """``tensor`` on a storage of exactly its own bytes, so that ``torch.save`` writes only those.

    Itself where it is the whole of its storage; where it is one contiguous run inside a larger
    storage (a row served from a longer row's states: its first rows), a tensor on that run's slice of
    the storage, sharing its memory: no copy, where a clone would cost the writer a pass over every
    byte and fresh pages for it; else (a column of a stacked tensor) a contiguous copy.
    """
    import torch

    size = tensor.numel() * tensor.element_size()
    if not tensor.is_contiguous():
        return tensor.clone(memory_format=torch.contiguous_format)
    storage = tensor.untyped_storage()
    if tensor.storage_offset() == 0 and storage.nbytes() == size:
        return tensor
    start = tensor.storage_offset() * tensor.element_size()
    return torch.empty(0, dtype=tensor.dtype, device=tensor.device).set_(
        storage[start:start + size], 0, tensor.shape, tensor.stride())
