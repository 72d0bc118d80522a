"""What the extractor's summary counts: the rate ends when the last file is whole, not after the
backend's shutdown (vLLM's workers take seconds to exit, which a short run would count as
extraction time). A small fake backend stands in for vLLM here; the real one runs in tests/e2e."""
import json
import time

import pytest

from hidden_states import backends
from hidden_states.extract import Settings, run

pytest.importorskip("torch")

SHUTDOWN = 1.0


class SlowShutdownBackend:
    name = "fake"

    def __init__(self, settings):
        self.settings = settings

    def start(self):
        return {"backend": self.name}

    def extract(self, batch):
        import torch

        return [[torch.full((len(ids), 8), float(layer)) for layer in self.settings.layer_ids] for ids in batch]

    def close(self):
        time.sleep(SHUTDOWN)


def test_shutdown_is_reported_apart_from_the_extraction(tmp_path, monkeypatch):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 4, "hidden_size": 8, "vocab_size": 64}))
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"input_ids": [5] * n}) + "\n" for n in (3, 4, 5)))
    monkeypatch.setattr(backends, "create", lambda name, settings: SlowShutdownBackend(settings))

    summary = run(Settings(model_path=str(model), prepared_data=str(data), output_dir=str(tmp_path / "out"),
                           batch_size=2, layer_ids=[1, 3], backend="fake"), log=lambda message: None)

    assert (summary.extracted, summary.tokens) == (3, 12)
    assert summary.shutdown_seconds >= SHUTDOWN
    assert summary.seconds < SHUTDOWN
    assert f"shutdown {summary.shutdown_seconds:.1f} s" in summary.line()
    assert sorted(p.name for p in (tmp_path / "out").glob("data_*.pt")) == ["data_0.pt", "data_1.pt", "data_2.pt"]
