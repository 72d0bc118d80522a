"""Layer ids between the two speculators conventions, the default format, and the 0.5 layout's files."""
import importlib.metadata

import pytest

from hidden_states import layer_conventions as lc
from hidden_states.errors import UsageError


def test_05_ids_count_layers_done_ours_count_the_layer():
    assert lc.to_extractor(lc.SPECULATORS_05, [6, 1, 4, 3], 6) == [0, 2, 3, 5]
    assert lc.from_extractor(lc.SPECULATORS_05, [0, 2, 3, 5]) == [1, 3, 4, 6]
    assert lc.to_extractor(lc.SPECULATORS_03, [2, 3, 3, 5], 6) == [2, 3, 3, 5]  # ours: as listed


@pytest.mark.parametrize("ids, message", [
    ([0, 3], r"\[0\] outside \[1, 6\].*0 is the embeddings"),
    ([3, 7], r"\[7\] outside \[1, 6\]"),
    ([3, 3], r"\[3\] given more than once"),
])
def test_05_ids_outside_or_repeated_are_refused(ids, message):
    with pytest.raises(UsageError, match=message):
        lc.to_extractor(lc.SPECULATORS_05, ids, 6)


def test_each_format_defaults_to_its_trainers_layers():
    assert lc.default_ids(lc.SPECULATORS_03, 32) == [2, 16, 29, 31]
    assert lc.default_ids(lc.SPECULATORS_05, 32) == [2, 16, 29, 32]
    assert lc.to_extractor(lc.SPECULATORS_05, lc.default_ids(lc.SPECULATORS_05, 32), 32) == [1, 15, 28, 31]
    assert lc.default_ids(lc.SPECULATORS_05, 6) == [2, 3, 6]  # each layer once


@pytest.mark.parametrize("installed, expected", [
    ("0.3.0", "speculators-0.3"), ("0.4.0", "speculators-0.3"), ("0.5.0", "speculators-0.5"),
    ("0.9.0", "speculators-0.5"), (None, "speculators-0.5"),
])
def test_default_format_follows_the_installed_speculators(monkeypatch, installed, expected):
    def version(name):
        if installed is None:
            raise importlib.metadata.PackageNotFoundError(name)
        return installed

    monkeypatch.setattr(importlib.metadata, "version", version)
    assert lc.default_format() == expected


def test_05_sample_files_are_whole_or_cut_short(tmp_path):
    torch = pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    from hidden_states.output import formats
    from hidden_states.inputs.streams import Sample

    logged = []
    layout = formats.create("speculators-0.5", tmp_path, formats.Layers([0, 2], 6, 8), log=logged.append)
    assert layout.describe()["layer_ids"] == [1, 3]
    (tmp_path / "hidden_states").mkdir()
    states = [torch.full((5, 8), 1.0), torch.full((5, 8), 2.0)]
    record = layout.record(Sample(3, 4, [7, 8, 9, 10, 11], None), states)
    assert tuple(record["hidden_states"].shape) == (5, 2, 8) and record["loss_mask"].tolist() == [1] * 5
    path = tmp_path / layout.sample_file(3)
    with open(path, "wb") as handle:
        layout.save(record, handle)
    assert layout.sample_index(path.name) == 3 and layout.ends_whole(path) and layout.read_length(path) == 5
    path.write_bytes(path.read_bytes()[:-1])
    assert not layout.ends_whole(path)

    layout.finish({0: 5, 2: 5})  # sample 1 has no file: no dataset that would misalign rows and files
    assert logged == ["speculators-0.5: the dataset index is not written: samples 1 have no file yet (the trainer "
                      "maps row i to hs_i.safetensors); extract them and it is"]  # through the run's logger
    assert not (tmp_path / "state.json").exists()
    with pytest.raises(ValueError, match="ascending"):
        formats.create("speculators-0.5", tmp_path, formats.Layers([2, 0], 6, 8), log=logged.append)
