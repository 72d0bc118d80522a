"""A small torch stack standing in for vLLM's decoder (fused-residual layers, as vLLM writes them),
a worker running it, and one step of requests through that worker to the parent's tensors: shared
by the unit tests of vllm-engine's own capture and of ``--cuda-graphs``' capture (support module)."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from hidden_states.backends import BackendSettings
from hidden_states.backends.worker import engine_capture, own_capture
from hidden_states.backends.shared.regions import REGION, RegionPool
from hidden_states.backends.vllm_engine import RegionBatch, VllmEngineBackend

HIDDEN = 4
LAYER_IDS = [2, 0]  # asked out of order: captured in layer order, as speculators' capture does


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


def states_taken(backend, work) -> list:
    """Each request of ``work`` finished as vLLM would hand it back: the parent's tensors for it (cloned
    out of the pool), or the error the parent raises."""
    results = []
    for position, ids in enumerate(work.ids):
        work.finished[position] = SimpleNamespace(prompt_token_ids=ids)
        try:
            results.append([layer.clone() for layer in backend._states(work, position)])
        except RuntimeError as exc:
            results.append(exc)
    return results


def extract_through_the_worker(monkeypatch, rows, claimed, prompts, make_worker=None):
    """One step of the two requests through ``Worker`` (or the worker ``make_worker()`` makes); the
    parent's tensors (or its error) per request."""
    monkeypatch.setattr(engine_capture, "tp_rank", lambda: 0)
    backend = VllmEngineBackend(BackendSettings("m", sorted(LAYER_IDS), 16, 1, 0.1))
    backend._layout, backend.row_bytes, backend.rows_timeout = {"dtype": "float32", "hidden_size": HIDDEN}, HIDDEN * 4, 0.1
    backend.pool = RegionPool(4 * backend.region_bytes(16))
    try:
        work = RegionBatch(list(prompts.values()),
                            [backend.pool.reserve(backend.region_bytes(len(p)), timeout=1) for p in prompts.values()])
        worker = Worker(rows, claimed) if make_worker is None else make_worker()
        worker._setup_hidden_states_capture(sorted(LAYER_IDS))
        worker._hidden_states_stream_to(backend.pool.path)
        # the parent's region for each request, in its sampling parameters (VllmEngineBackend.params)
        requests = [SimpleNamespace(req_id=r, prompt_token_ids=p, num_computed_tokens=0,
                                    sampling_params=SimpleNamespace(extra_args={REGION: (work.offsets[i], len(p))}))
                    for i, (r, p) in enumerate(prompts.items())]
        worker.execute_model(SimpleNamespace(
            finished_req_ids=set(), scheduled_new_reqs=requests, num_scheduled_tokens={r: len(p) for r, p in prompts.items()},
            scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[])))
        return states_taken(backend, work)
    finally:
        backend.pool.close()


def extract_through_stages(monkeypatch, prompts, layer_ids, splits, after_step=None, through_sink=()):
    """One step of ``prompts`` through one ``Worker`` per pipeline stage (``splits``: each stage's
    (start_layer, end_layer) of a 6-layer ``Stack``), each capturing the layers its stage runs into
    the same regions, as vLLM's stages would; the parent's tensors (or its error) per request.
    ``after_step(pool, offsets, lengths)``: called once the stages stored the step's rows.
    ``through_sink``: the stages that send their rows to a loopback region sink (as a stage on
    another host would) instead of mapping the pool."""
    from hidden_states.backends.region_transport import new_nonce, open_transport, stage_slots
    from hidden_states.backends.shared.region_sink import SINK_ENV
    from hidden_states.backends.stage_layers import merge_stage_replies

    monkeypatch.setattr(engine_capture, "tp_rank", lambda: 0)
    backend = VllmEngineBackend(BackendSettings("m", sorted(layer_ids), 16, 1, 0.1))
    workers, replies = [], []
    for stage, (start, end) in enumerate(splits):
        monkeypatch.setattr(engine_capture, "pp_rank", lambda stage=stage: stage)
        worker = Worker(list(prompts), list(prompts))
        stack = worker.model_runner.model.model = Stack(6)
        stack.start_layer, stack.end_layer = start, end
        worker.model_config = SimpleNamespace(dtype=torch.float32, get_hidden_size=lambda: HIDDEN)
        replies.append(worker._hidden_states_stream_setup(layer_ids))
        workers.append(worker)
    backend._layout, stages = merge_stage_replies(replies, sorted(layer_ids))
    backend.blocks, backend.row_bytes, backend.rows_timeout = len(stages), HIDDEN * 4, 5.0 if through_sink else 0.1
    backend.pool = RegionPool(4 * backend.region_bytes(16), stages=tuple(stages), nonce=new_nonce())
    monkeypatch.delenv(SINK_ENV, raising=False)
    backend.sink, transport = open_transport(backend.pool, stage_slots(replies, layer_ids, stages), backend.row_bytes,
                                             False, on_ray=bool(through_sink))
    try:
        work = RegionBatch(list(prompts.values()),
                           [backend.pool.reserve(backend.region_bytes(len(p)), timeout=1) for p in prompts.values()])
        requests = [SimpleNamespace(req_id=r, prompt_token_ids=p, num_computed_tokens=0,
                                    sampling_params=SimpleNamespace(extra_args={REGION: (work.offsets[i], len(p))}))
                    for i, (r, p) in enumerate(prompts.items())]
        step = SimpleNamespace(finished_req_ids=set(), scheduled_new_reqs=requests,
                               num_scheduled_tokens={r: len(p) for r, p in prompts.items()},
                               scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]))
        for stage, worker in enumerate(workers):
            monkeypatch.setattr(engine_capture, "pp_rank", lambda stage=stage: stage)
            if stage in through_sink:
                monkeypatch.setenv(SINK_ENV, "always")
            else:
                monkeypatch.delenv(SINK_ENV, raising=False)
            if worker._hidden_states_stream_to(backend.pool.path, stages, transport) is not None:
                worker.execute_model(step)
        if after_step is not None:
            after_step(backend.pool, work.offsets, work.lengths)
        return states_taken(backend, work), backend, stages
    finally:
        if backend.sink is not None:
            backend.sink.close()
        backend.pool.close()
