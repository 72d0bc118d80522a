"""Fixtures shared by the unit tests."""
import json
from pathlib import Path

import pytest


@pytest.fixture
def fake_model(tmp_path):
    """A model directory holding only a ``config.json``: 4 layers, hidden size 8, 64 tokens; what the
    extraction's plan reads when a fake backend stands in for vLLM."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 4, "hidden_size": 8, "vocab_size": 64}))
    return model


@pytest.fixture
def tiny(tmp_path):
    """The tiny Llama checkpoint (built once into the cache) and a one-sample input."""
    from hidden_states.fixtures.tiny_model import build
    from tests.conftest import CACHE

    model = build("llama", Path(CACHE) / "models" / "llama")
    data = tmp_path / "data.jsonl"
    data.write_text('{"input_ids": [5, 6, 7]}\n')
    return model, data
