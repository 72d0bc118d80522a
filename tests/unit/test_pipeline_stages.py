"""vllm-engine under vLLM's pipeline parallelism: each stage captures the run's layers it runs into
the same regions, at their slots; the parent merges the stages' setup replies and refuses what
cannot run with stages before the load."""
from types import SimpleNamespace

import pytest
import torch

from hidden_states.backends.shared.regions import ids_start
from hidden_states.backends.stage_layers import merge_stage_replies, refuse_pipeline
from hidden_states.errors import UsageError
from tests.unit.decoder_stack import extract_through_stages

PROMPTS = {"a": [3, 4, 5, 6, 7], "b": [9, 8, 7]}
LAYER_IDS = [0, 2, 3, 5]


@pytest.mark.parametrize("splits", [[(0, 3), (3, 6)], [(0, 4), (4, 6)], [(0, 1), (1, 6)], [(0, 2), (2, 6)]])
def test_stages_storing_into_one_region_give_the_bytes_of_one_stage_storing_all(monkeypatch, splits):
    alone, _, one = extract_through_stages(monkeypatch, PROMPTS, LAYER_IDS, [(0, 6)])
    staged, backend, stages = extract_through_stages(monkeypatch, PROMPTS, LAYER_IDS, splits)
    assert one == [0] and stages == [0, 1] and backend.blocks == 2
    for single, split in zip(alone, staged, strict=True):
        assert len(split) == len(LAYER_IDS)
        for a, b in zip(single, split, strict=True):
            assert torch.equal(a, b)


def test_a_stage_that_runs_none_of_the_layers_captures_nothing(monkeypatch):
    alone, _, _ = extract_through_stages(monkeypatch, PROMPTS, [3, 5], [(0, 6)])
    staged, backend, stages = extract_through_stages(monkeypatch, PROMPTS, [3, 5], [(0, 2), (2, 6)])
    assert stages == [1] and backend.blocks == 1
    assert all(torch.equal(a, b) for single, split in zip(alone, staged) for a, b in zip(single, split))


def _reply(stage, layers):
    return {"dtype": "float32", "hidden_size": 4, "scales": False, "stage": stage, "layers": layers}


def test_the_parent_merges_the_stages_replies():
    layout, stages = merge_stage_replies([_reply(1, [3, 5]), None, _reply(0, [0, 2]), None], LAYER_IDS)
    assert stages == [0, 1] and layout["hidden_size"] == 4
    assert merge_stage_replies([_reply(0, []), _reply(1, [3])], [3])[1] == [1]
    # one stage, a reply without stage fields (a capture of before): that stage
    assert merge_stage_replies([{"dtype": "float32", "hidden_size": 4}], LAYER_IDS)[1] == [0]


def test_the_parent_refuses_overlapping_or_missing_layers():
    with pytest.raises(RuntimeError, match=r"layer 3 by stages \[0, 1\]"):
        merge_stage_replies([_reply(0, [0, 2, 3]), _reply(1, [3, 5])], LAYER_IDS)
    with pytest.raises(RuntimeError, match=r"no pipeline stage runs layers \[5\]"):
        merge_stage_replies([_reply(0, [0, 2]), _reply(1, [3])], LAYER_IDS)


def test_rows_stored_by_one_stage_alone_are_not_stored(monkeypatch):
    """A stage that stored nothing (its worker never ran the step): the parent names the rows missing."""
    from tests.unit import decoder_stack

    real = decoder_stack.Worker.execute_model

    def only_stage_0(self, scheduler_output):
        if self.model_runner.model.model.start_layer == 0:
            real(self, scheduler_output)
    monkeypatch.setattr(decoder_stack.Worker, "execute_model", only_stage_0)
    staged, _, _ = extract_through_stages(monkeypatch, PROMPTS, LAYER_IDS, [(0, 3), (3, 6)])
    assert all(isinstance(result, RuntimeError) and "stored 0 of" in str(result) for result in staged)


def test_a_stage_whose_ids_disagree_is_named(monkeypatch):
    def stage_1_stored_other_ids(pool, offsets, lengths):
        for offset, length in zip(offsets, lengths):
            pool.view(offset + ids_start(length, 1, 2) + 4, torch.int32, 1).fill_(-1)
    staged, _, _ = extract_through_stages(monkeypatch, PROMPTS, LAYER_IDS, [(0, 3), (3, 6)], stage_1_stored_other_ids)
    assert all(isinstance(result, RuntimeError) and "from token 1 of" in str(result)
               and "stored by pipeline stage 1" in str(result) for result in staged)


def _settings(**changes):
    return SimpleNamespace(**{"pp_size": 2, "cuda_graphs": False, "state_dtype": "model", **changes})


@pytest.mark.parametrize("settings, asked, flag", [
    (_settings(), "speculators", "--pp-size 2: speculators' capture"),
    (_settings(cuda_graphs=True), "", "--cuda-graphs: not with --pp-size 2"),
    (_settings(state_dtype="fp8"), "", "--state-dtype fp8: not with --pp-size 2"),
])
def test_what_cannot_run_with_stages_is_refused_before_the_load(settings, asked, flag):
    with pytest.raises(UsageError) as refused:
        refuse_pipeline(settings, asked, "speculators")
    assert str(refused.value).startswith(flag) and "\n" not in str(refused.value)
    refuse_pipeline(_settings(pp_size=1, cuda_graphs=True, state_dtype="fp8"), "speculators", "speculators")
