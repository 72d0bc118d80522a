"""vllm-engine's own capture (hidden_states/backends/worker/own_capture.py) with a small torch stack standing in
for vLLM's decoder: which capture is chosen, what its hooks keep, and that a broken row attribution
cannot reach a file (the parent's row check fails the batch). Real vLLM runs it in
tests/e2e/test_backends.py (speculators 0.9 on the path, 0.17.0 and 0.32.0), compared with HF."""
import pytest
import torch
from packaging.version import Version

from hidden_states.backends import BackendSettings, needs_speculators
from hidden_states.backends.worker import engine_capture, own_capture
from hidden_states.backends.vllm_engine import (CAPTURE_ENV, EXTENSIONS, OWN, SPECULATORS, VllmEngineBackend,
                                                chosen_capture)
from hidden_states.errors import UsageError
from tests.unit.decoder_stack import HIDDEN, LAYER_IDS, Stack, extract_through_the_worker


@pytest.mark.parametrize("installed, environ, chosen", [
    ("0.3.0", {}, SPECULATORS), ("0.4.0", {}, SPECULATORS),
    ("0.9.0", {}, OWN), (None, {}, OWN),
    ("0.4.0", {CAPTURE_ENV: "own"}, OWN), ("0.3.0", {CAPTURE_ENV: "speculators"}, SPECULATORS),
])
def test_the_capture_is_speculators_where_0_3_or_0_4_is_installed_else_our_own(monkeypatch, installed, environ, chosen):
    monkeypatch.setattr("vllm_compat.extractor_api.speculators_version",
                        lambda: None if installed is None else Version(installed))
    assert chosen_capture(environ)[0] == chosen
    monkeypatch.delenv(CAPTURE_ENV, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    assert needs_speculators("vllm-engine") is (chosen == SPECULATORS)
    backend = VllmEngineBackend(BackendSettings("m", [0], 8, 1, 0.1))
    facts = backend.prepare(Version("0.32.0"))
    assert facts["capture"] == chosen and backend.llm_keywords() == {"worker_extension_cls": EXTENSIONS[chosen]}


@pytest.mark.parametrize("installed, value, message", [
    ("0.4.0", "mine", f"{CAPTURE_ENV}=mine: expected speculators or own"),
    ("0.9.0", "speculators", f"{CAPTURE_ENV}=speculators: speculators' capture needs speculators >=0.3.0,<0.5, "
                             "found 0.9.0"),
    (None, "speculators", "it is not installed"),
])
def test_a_capture_that_cannot_run_is_refused_naming_the_variable(monkeypatch, installed, value, message):
    monkeypatch.setattr("vllm_compat.extractor_api.speculators_version",
                        lambda: None if installed is None else Version(installed))
    with pytest.raises(UsageError, match=message.replace("(", r"\(")) as raised:
        chosen_capture({CAPTURE_ENV: value})
    assert raised.value.exit_code == 2


def reference(input_ids, positions) -> dict[int, torch.Tensor]:
    """Each layer's output (hidden_states + residual) of ``Stack``, as it returned, without hooks."""
    stack, outputs = Stack(), {}
    hidden_states, residual = input_ids.float()[:, None].repeat(1, HIDDEN), None
    for index, layer in enumerate(stack.layers):
        hidden_states, residual = layer(positions, hidden_states, residual)
        outputs[index] = (hidden_states + residual).clone()
    return outputs


def test_each_forward_hands_over_its_layers_outputs_once_in_layer_order():
    stack, stored = Stack(), []
    own_capture.capture_layers(stack, LAYER_IDS, stored.append)
    input_ids, positions = torch.tensor([5, 6, 7]), torch.tensor([0, 1, 2])
    out = stack(input_ids, positions)
    assert torch.equal(out, Stack()(input_ids, positions))  # the forward itself is untouched
    want = reference(input_ids, positions)
    assert len(stored) == 1 and [s.shape for s in stored[0]] == [(3, HIDDEN)] * 2
    for got, layer in zip(stored[0], sorted(LAYER_IDS), strict=True):
        assert torch.equal(got, want[layer])  # summed in the hook, before the next layer's in-place add
    stack(input_ids[:1], positions[:1])
    assert len(stored) == 2 and stored[1][0].shape == (1, HIDDEN)


def test_a_layer_outside_the_stack_is_refused():
    with pytest.raises(RuntimeError, match=r"layers \[3\] are not among this worker's decoder layers 0-2"):
        own_capture.capture_layers(Stack(), [0, 3], lambda states: None)


PROMPTS = {"a": [11, 12, 13], "b": [21, 22, 23, 24, 25]}


def test_rows_reach_each_request_as_hf_would_compute_them_alone(monkeypatch):
    results = extract_through_the_worker(monkeypatch, ["b", "a"], ["b", "a"], PROMPTS)
    for got, ids in zip(results, PROMPTS.values(), strict=True):
        want = reference(torch.tensor(ids), torch.arange(len(ids)))
        assert [torch.equal(layer, want[index]) for layer, index in zip(got, sorted(LAYER_IDS))] == [True, True]


def test_negative_a_broken_row_attribution_fails_the_batch(monkeypatch):
    """The runner's batch order lies (a after b, rows b before a) and the worker takes it on trust, as a
    GPU worker does (it does not read its rows' token ids back): the rows land in the wrong regions, and
    the parent's check of every stored row's token id refuses both requests."""
    monkeypatch.setattr(engine_capture, "order_by_rows", lambda order, *rest: order)
    results = extract_through_the_worker(monkeypatch, ["b", "a"], ["a", "b"], PROMPTS)
    assert all(isinstance(r, RuntimeError) and "attributed rows to the wrong request" in str(r) for r in results), results
