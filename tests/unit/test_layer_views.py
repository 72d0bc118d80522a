"""Layers handed to a format as views of one stacked tensor (what --backend vllm-native gives: the
columns of vLLM's own [tokens, layers, hidden] file): the stacked format writes that tensor without a
copy, the per-layer format writes each layer as its own tensor. The stacked format's files are
written by our own streaming safetensors writer, read here by safetensors itself."""
import io
from pathlib import Path

import pytest
import torch

from hidden_states.output import formats
from hidden_states.output.formats.speculators_05 import read_sample
from hidden_states.inputs.streams import Sample

TOKENS, LAYERS, HIDDEN = 5, 3, 8


def quiet(message):
    pass


@pytest.fixture
def stacked():
    return torch.arange(TOKENS * LAYERS * HIDDEN, dtype=torch.float32).to(torch.bfloat16).view(TOKENS, LAYERS, HIDDEN)


def create(name, directory):
    return formats.create(name, directory, formats.Layers([1, 2, 4], 6, HIDDEN), log=quiet)


def test_columns_of_one_tensor_are_written_as_that_tensor(tmp_path, stacked):
    format = create("speculators-0.5", tmp_path)
    sample = Sample(0, 1, list(range(TOKENS)), None)
    record = format.record(sample, [stacked[:, j] for j in range(LAYERS)])
    assert record["hidden_states"].data_ptr() == stacked.data_ptr()  # no copy made
    assert record["hidden_states"].is_contiguous() and torch.equal(record["hidden_states"], stacked)
    path = tmp_path / "hs_0.safetensors"
    with open(path, "wb") as handle:
        format.save(record, handle)
    assert torch.equal(read_sample(path)["hidden_states"], stacked)


@pytest.mark.parametrize("layers", [lambda s: [s[:, j].clone() for j in range(LAYERS)],  # separate tensors
                                    lambda s: [s[:, j] for j in reversed(range(LAYERS))],  # columns out of order
                                    lambda s: [s[:, j] for j in range(LAYERS - 1)]],  # some of the columns
                         ids=["separate", "reordered", "subset"])
def test_other_layers_are_stacked(tmp_path, stacked, layers):
    given = layers(stacked)
    record = create("speculators-0.5", tmp_path).record(Sample(0, 1, list(range(TOKENS)), None), given)
    assert record["hidden_states"].data_ptr() != stacked.data_ptr()
    assert torch.equal(record["hidden_states"], torch.stack(given, dim=1))


def test_the_per_layer_format_writes_each_column_as_its_own_tensor(tmp_path, stacked):
    format = create("speculators-0.3", tmp_path)
    record = format.record(Sample(0, 1, list(range(TOKENS)), None), [stacked[:, j] for j in range(LAYERS)])
    buffer = io.BytesIO()
    format.save(record, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)["hidden_states"]
    for j, layer in enumerate(loaded):
        assert torch.equal(layer, stacked[:, j])
        # a trainer gets a [tokens, hidden] tensor of its own, not a view of every layer's storage
        assert layer.is_contiguous() and layer.untyped_storage().nbytes() == TOKENS * HIDDEN * layer.element_size()


WRITE_PAST_THE_LIMIT = """
import resource, signal, sys
from pathlib import Path
import torch
from hidden_states.output import formats
from hidden_states.output.writer import BackgroundWriter
from hidden_states.errors import OutputError
from hidden_states.inputs.streams import Sample

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
out = Path(sys.argv[1])
format = formats.create(sys.argv[2], out, formats.Layers([1], 6, 1024), log=print)
writer = BackgroundWriter(out, format=format)
(out / "hidden_states").mkdir()
writer.submit(0, format.record(Sample(0, 1, list(range(1024)), None), [torch.ones(1024, 1024)]))
try:
    writer.close()
except OutputError as exc:
    print(exc)
"""


@pytest.mark.parametrize("name", ["speculators-0.3", "speculators-0.5"])
def test_a_write_the_os_refuses_names_the_file_and_the_cause(tmp_path, name):
    """A file the OS will not take (here: over RLIMIT_FSIZE, as a full disk would) fails the run
    with the OS's reason and the file's name, in both formats (the stacked one through our own
    writer, the per-layer one through torch.save into a Python file)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", WRITE_PAST_THE_LIMIT, str(tmp_path), name],
                          capture_output=True, text=True, cwd=Path(__file__).parents[2])
    file = create(name, tmp_path).sample_file(0)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == f"writing sample 0: {tmp_path / file}: File too large", done.stdout + done.stderr[-2000:]
    assert not list(tmp_path.rglob("*.pt")) and not list(tmp_path.rglob("*.safetensors"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_sample_files_are_what_safetensors_reads(tmp_path, dtype):
    """Written by our own streaming writer, read back by safetensors itself, every dtype a model's
    states come in, an empty sample and an odd-sized one; every tensor starts aligned to its
    element size (the states' odd byte count would put the int64 ids off by 2 if written first)."""
    from safetensors import safe_open

    from hidden_states.output.formats.speculators_05 import safetensors_header, write_safetensors

    for tokens, layers, hidden in ((TOKENS, LAYERS, HIDDEN), (0, LAYERS, HIDDEN), (3, 1, 3)):
        tensors = {"hidden_states": torch.randn(tokens, layers, hidden).to(dtype),
                   "token_ids": torch.arange(tokens), "loss_mask": torch.ones(tokens, dtype=torch.long)}
        path = tmp_path / f"hs_{tokens}.safetensors"
        with open(path, "wb") as handle:
            write_safetensors(tensors, handle)
        with safe_open(str(path), framework="pt") as read:
            assert sorted(read.keys()) == sorted(tensors)
            for name, tensor in tensors.items():
                assert read.get_tensor(name).dtype == tensor.dtype and torch.equal(read.get_tensor(name), tensor)
        header = safetensors_header(path)
        assert all(header[name]["data_offsets"][0] % tensor.element_size() == 0 for name, tensor in tensors.items())


def test_a_tensor_a_sample_file_cannot_hold_is_refused(tmp_path, stacked):
    from hidden_states.output.formats.speculators_05 import write_safetensors

    with open(tmp_path / "x", "wb") as handle:
        with pytest.raises(ValueError, match="hidden_states: torch.uint8 is not a sample file's dtype"):
            write_safetensors({"hidden_states": torch.zeros(2, dtype=torch.uint8)}, handle)
        with pytest.raises(ValueError, match="hidden_states: not contiguous"):
            write_safetensors({"hidden_states": stacked[:, 1]}, handle)


def test_a_contiguous_run_of_a_longer_rows_states_is_written_without_a_copy(tmp_path):
    from hidden_states.output.formats.speculators_03 import own_storage

    longer = torch.arange(12 * HIDDEN, dtype=torch.float32).reshape(12, HIDDEN).to(torch.bfloat16)
    for run in (longer[:5], longer[3:9]):  # a served row's first rows; a run that starts inside the storage
        mine = own_storage(run)
        assert mine.data_ptr() == run.data_ptr()  # the same memory: no copy
        assert mine.untyped_storage().nbytes() == run.numel() * run.element_size()
        assert torch.equal(mine, run)
        buffer = io.BytesIO()
        torch.save({"hidden_states": [mine]}, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=True)["hidden_states"][0]
        assert torch.equal(loaded, run) and loaded.untyped_storage().nbytes() == run.numel() * run.element_size()
    whole = longer.clone()
    assert own_storage(whole) is whole
    column = longer.reshape(12, 2, HIDDEN // 2)[:, 1]  # not one run: copied
    copied = own_storage(column)
    assert copied.data_ptr() != column.data_ptr() and copied.is_contiguous() and torch.equal(copied, column)
