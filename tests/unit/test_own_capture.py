"""vllm-engine's own capture (hidden_states/backends/own_capture.py) with a small torch stack standing in
for vLLM's decoder: which capture is chosen, what its hooks keep, and that a broken row attribution
cannot reach a file (the parent's row check fails the batch). Real vLLM runs it in
tests/e2e/test_backends.py (speculators 0.9 on the path, 0.17.0 and 0.32.0), compared with HF."""
from types import SimpleNamespace

import pytest
import torch
from packaging.version import Version

from hidden_states.backends import BackendSettings, engine_capture, needs_speculators, own_capture
from hidden_states.backends.regions import REGION, RegionPool
from hidden_states.backends.vllm_engine import (CAPTURE_ENV, EXTENSIONS, OWN, SPECULATORS, VllmEngineBackend,
                                                _RegionBatch, chosen_capture)
from hidden_states.errors import UsageError

HIDDEN = 4
LAYER_IDS = [2, 0]  # asked out of order: captured in layer order, as speculators' capture does


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


class Layer(torch.nn.Module):
    """A fused-residual decoder layer as vLLM writes them: returns (hidden_states, residual), and
    adds its input into the residual it was handed *in place* (as vLLM's fused_add_rms_norm does)."""

    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale

    def forward(self, positions, hidden_states, residual):
        if residual is None:
            residual = hidden_states.clone()
        else:
            residual.add_(hidden_states)  # overwrites the previous layer's returned residual
        return residual * self.scale + positions[:, None], residual


class Stack(torch.nn.Module):
    def __init__(self, layers: int = 3):
        super().__init__()
        self.layers = torch.nn.ModuleList(Layer(1.0 + i) for i in range(layers))
        self.start_layer, self.end_layer = 0, layers

    def forward(self, input_ids, positions):
        hidden_states, residual = input_ids.float()[:, None].repeat(1, HIDDEN), None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        return hidden_states + residual


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


class Worker(own_capture.OwnStreamingCapture):
    """vLLM's worker in miniature: its model is ``Stack``; ``execute_model`` runs the scheduled requests'
    tokens through it, rows in ``rows`` order, while its runner says the batch is in ``claimed`` order."""

    def __init__(self, rows: list[str], claimed: list[str]):
        self.rows = rows
        self.model_runner = SimpleNamespace(model=SimpleNamespace(model=Stack()), device=torch.device("cpu"),
                                            input_batch=SimpleNamespace(req_ids=claimed))

    def execute_model(self, scheduler_output):
        prompts = {new.req_id: new.prompt_token_ids for new in scheduler_output.scheduled_new_reqs}
        ids = [t for r in self.rows for t in prompts[r]]
        positions = [p for r in self.rows for p in range(len(prompts[r]))]
        self.model_runner.model.model(input_ids=torch.tensor(ids), positions=torch.tensor(positions))


def extract_through_the_worker(monkeypatch, rows, claimed, prompts, make_worker=None):
    """One step of the two requests through ``Worker`` (or the worker ``make_worker()`` makes); the
    parent's tensors (or its error) per request."""
    monkeypatch.setattr(engine_capture, "tp_rank", lambda: 0)
    backend = VllmEngineBackend(BackendSettings("m", sorted(LAYER_IDS), 16, 1, 0.1))
    backend._layout, backend._row_bytes, backend.rows_timeout = {"dtype": "float32", "hidden_size": HIDDEN}, HIDDEN * 4, 0.1
    backend._pool = RegionPool(4 * backend._region_bytes(16))
    try:
        work = _RegionBatch(list(prompts.values()),
                            [backend._pool.reserve(backend._region_bytes(len(p)), timeout=1) for p in prompts.values()])
        worker = Worker(rows, claimed) if make_worker is None else make_worker()
        worker._setup_hidden_states_capture(sorted(LAYER_IDS))
        worker._hidden_states_stream_to(backend._pool.path)
        # the parent's region for each request, in its sampling parameters (VllmEngineBackend.params)
        requests = [SimpleNamespace(req_id=r, prompt_token_ids=p, num_computed_tokens=0,
                                    sampling_params=SimpleNamespace(extra_args={REGION: (work.offsets[i], len(p))}))
                    for i, (r, p) in enumerate(prompts.items())]
        worker.execute_model(SimpleNamespace(
            finished_req_ids=set(), scheduled_new_reqs=requests, num_scheduled_tokens={r: len(p) for r, p in prompts.items()},
            scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[])))
        results = []
        for position, ids in enumerate(work.ids):
            work.finished[position] = SimpleNamespace(prompt_token_ids=ids)
            try:
                results.append([layer.clone() for layer in backend._states(work, position)])
            except RuntimeError as exc:
                results.append(exc)
        return results
    finally:
        backend._pool.close()


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
