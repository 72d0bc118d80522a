"""The backends' ``tokens_ahead`` defaults: each named once (backends.ONE_BATCH_AHEAD,
engine_feed.STEPS_AHEAD) and taken from that name by every backend."""
from types import SimpleNamespace

from hidden_states import backends
from hidden_states.backends import engine_feed
from hidden_states.backends.engine_base import EngineBackend
from hidden_states.backends.speculators_generator import SpeculatorsBackend

SETTINGS = backends.BackendSettings("m", [0], 8, 1, 0.1)


def test_every_backend_without_an_engine_keeps_one_batch_ahead():
    assert backends.OneBatchAtATime.tokens_ahead == backends.ONE_BATCH_AHEAD
    assert SpeculatorsBackend(SETTINGS).tokens_ahead == backends.ONE_BATCH_AHEAD
    assert EngineBackend(SETTINGS).tokens_ahead == backends.ONE_BATCH_AHEAD  # before start() knows the step


def test_the_engine_backends_keep_steps_ahead_of_the_engines_step(monkeypatch):
    llm = SimpleNamespace(llm_engine=SimpleNamespace(vllm_config=SimpleNamespace(
        scheduler_config=SimpleNamespace(max_num_batched_tokens=512))))
    assert engine_feed.steps_of_tokens_ahead(llm) == engine_feed.STEPS_AHEAD * 512
    monkeypatch.setattr(engine_feed, "STEPS_AHEAD", 2)  # the one name decides it
    assert engine_feed.steps_of_tokens_ahead(llm) == 1024


def test_pipeline_stages_each_keep_one_more_step_ahead():
    """vLLM runs a batch per pipeline stage at once: each stage past the first adds one step ahead."""
    llm = SimpleNamespace(llm_engine=SimpleNamespace(vllm_config=SimpleNamespace(
        scheduler_config=SimpleNamespace(max_num_batched_tokens=512),
        parallel_config=SimpleNamespace(pipeline_parallel_size=2))))
    assert engine_feed.steps_of_tokens_ahead(llm) == (engine_feed.STEPS_AHEAD + 1) * 512
