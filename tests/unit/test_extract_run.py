"""The extraction run around a backend: what its summary counts, and what a rerun trusts. A small
fake backend stands in for vLLM here; the real one runs in tests/e2e/test_extractor.py."""
import json
import time
from pathlib import Path

import pytest

from hidden_states import backends
from hidden_states.errors import PreflightError
from hidden_states.extract import Settings, run
from vllm_compat.forward_check import KernelCheck

pytest.importorskip("torch")

SHUTDOWN = 1.0


class SlowShutdownBackend:
    name = "fake"

    kernel_errors = [0.0, 1e-6]  # what the forward check reports: one relative error per self-test

    def __init__(self, settings):
        self.settings = settings

    def start(self):
        return {"backend": self.name}

    def extract(self, batch):
        import torch

        return [[torch.full((len(ids), 8), float(layer)) for layer in self.settings.layer_ids] for ids in batch]

    def check_forward(self, probe):
        assert probe and all(0 <= i < 64 for i in probe)  # ids the model's vocabulary has
        return [KernelCheck("RMSNorm (q_norm)", "[16, 4, 32]/stride [256, 32, 1]", e) for e in self.kernel_errors]

    def close(self):
        time.sleep(SHUTDOWN)


@pytest.fixture
def job(tmp_path, monkeypatch):
    """A model directory, three samples (3, 4 and 5 tokens) and settings that run the fake backend."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 4, "hidden_size": 8, "vocab_size": 64}))
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"input_ids": [5] * n}) + "\n" for n in (3, 4, 5)))
    monkeypatch.setattr(backends, "create", lambda name, settings: SlowShutdownBackend(settings))
    return Settings(model_path=str(model), prepared_data=str(data), output_dir=str(tmp_path / "out"),
                    batch_size=2, layer_ids=[1, 3], backend="fake")


def data_files(settings):
    return sorted(p.name for p in Path(settings.output_dir).glob("data_*.pt"))


def test_shutdown_is_reported_apart_from_the_extraction(job):
    summary = run(job, log=lambda message: None)

    assert (summary.extracted, summary.tokens) == (3, 12)
    assert summary.shutdown_seconds >= SHUTDOWN
    assert summary.seconds < SHUTDOWN
    assert f"shutdown {summary.shutdown_seconds:.1f} s" in summary.line()
    assert data_files(job) == ["data_0.pt", "data_1.pt", "data_2.pt"]


@pytest.mark.parametrize("damage", [b"", b"PK\x03\x04 the first bytes of a zip, and no end"])
def test_a_file_cut_short_by_a_crash_is_redone(job, damage):
    import torch

    run(job, log=lambda message: None)
    cut = Path(job.output_dir) / "data_1.pt"
    cut.write_bytes(damage)  # what a power cut can leave: the rename on disk, the data not
    said = []

    summary = run(job, log=said.append)

    assert (summary.extracted, summary.skipped) == (1, 2)
    assert any("1 files" in line and "cut short" in line and "data_1.pt" in line for line in said), said
    assert data_files(job) == ["data_0.pt", "data_1.pt", "data_2.pt"]
    assert torch.load(cut, weights_only=True)["input_ids"].tolist() == [5] * 4


def test_a_kernel_the_forward_check_finds_wrong_stops_the_run_before_any_file(job, monkeypatch):
    monkeypatch.setattr(SlowShutdownBackend, "kernel_errors", [0.0, 1.37])
    with pytest.raises(PreflightError, match=r"(?s)1 of 2 kernel self-tests.*relative error 1.37e\+00 \(WRONG\)"):
        run(job, log=lambda message: None)
    assert data_files(job) == []


def test_skip_forward_check_runs_without_it(job, monkeypatch):
    monkeypatch.setattr(SlowShutdownBackend, "kernel_errors", [1.37])
    job.forward_check = False
    said = []
    assert run(job, log=said.append).extracted == 3
    assert any("forward check skipped" in line for line in said), said
