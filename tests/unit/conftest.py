"""Fixtures shared by the unit tests."""
import json
from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def no_cpu_core_lists(monkeypatch):
    """Each unit test starts without ``VLLM_CPU_OMP_THREADS_BIND``: a host's (or a test lane's) core list
    would make the plans of several ranks that these tests build refuse it (plan/cpu_threads.py); a test
    of that check sets its own."""
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)


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


@pytest.fixture
def job(fake_model, tmp_path, monkeypatch):
    """Six samples of 3..8 tokens of the fake 4-layer model, extracted by ``fakes.FakeBackend``."""
    from hidden_states import backends
    from hidden_states.settings import Settings
    from tests.unit.fakes import FakeBackend

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"input_ids": [5] * n}) + "\n" for n in range(3, 9)))
    FakeBackend.created = 0
    monkeypatch.setattr(backends, "create", lambda name, settings: FakeBackend(settings))
    return Settings(model_path=str(fake_model), prepared_data=str(data), output_dir=str(tmp_path / "out"),
                    batch_size=2, layer_ids=[3, 1], backend="fake", format="speculators-0.3")


@pytest.fixture
def chat_model(tmp_path):
    """A model directory the extractor's plan reads (config.json: 4 layers, hidden 8) with the tiny
    Llama-3 chat tokenizer."""
    from hidden_states.fixtures.chat_templates import build_tokenizer

    model = build_tokenizer("llama3", tmp_path / "model")
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 4, "hidden_size": 8, "vocab_size": 512}))
    return model


@pytest.fixture(scope="module")
def vllm_imported():
    """The engine feed imports vLLM on its first batch (SamplingParams, TokensPrompt): a minute or more
    on a busy host, so a module whose tests wait on a batch imports it first, with no time limit
    (``pytestmark = pytest.mark.usefixtures("vllm_imported")``)."""
    import importlib

    try:
        importlib.import_module("vllm.inputs")
        importlib.import_module("vllm").SamplingParams  # noqa: B018  (vllm's lazy attribute: its import)
    except ImportError:  # the tests that need it fail saying so; the others run
        pass


@pytest.fixture
def capture():
    """engine_capture: the streaming half both captures share (it imports neither speculators nor vLLM)."""
    import importlib

    return importlib.import_module("hidden_states.backends.worker.engine_capture")
