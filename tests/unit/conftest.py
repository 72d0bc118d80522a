"""Fixtures shared by the unit tests."""
import json

import pytest


@pytest.fixture
def fake_model(tmp_path):
    """A model directory holding only a ``config.json``: 4 layers, hidden size 8, 64 tokens; what the
    extraction's plan reads when a fake backend stands in for vLLM."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 4, "hidden_size": 8, "vocab_size": 64}))
    return model
