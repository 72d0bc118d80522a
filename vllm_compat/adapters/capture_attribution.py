"""speculators 0.3.0 slices captured states in submission order: attribute rows to requests instead.

Not a vLLM drift but the 0.3.0 generator's own defect: its worker concatenates every captured
row of every step, and the parent slices that in the order it *submitted* the prompts. Rows come
in the model runner's batch order, step by step: when one call needs several scheduler steps
(more tokens than one step admits, chunked prompts) or the runner reorders the batch, sequences
get each other's states, with no error (even on vLLM 0.11.0 itself: docs/cpu-vllm.md,
"Correctness traps"). Warm-up and padding rows would shift every slice as well.

What it does, inside the worker: the step's per-request token counts are noted when the worker
executes a scheduler output; each captured forward records which request owns which rows (the
runner's batch order); on retrieval the rows are regrouped per request, in the generator's
submission order (its request ids are ``req_<call>_<index>``), chunks in step order. The batch
order comes from the active model runner (V1's persistent batch, or V2's per-step batch noted by
``v2_batch_order``). Rows that
belong to no request are dropped. A count that does not add up raises instead of misattributing.

Scope: worker, speculators 0.3.x only. Disable: ``VLLM_COMPAT_DISABLE=capture_attribution``.
"""
from packaging.specifiers import SpecifierSet

from ..adapter import Adapter, Patch, Scope
from ..batch_order import scheduled_in_row_order
from ..consumer import SPECULATORS_03, WORKER_EXTENSION
from ..wrapping import function_wrapper

SEGMENTS = "_vllm_compat_segments"  # on the worker object: [(request id or None, rows), ...]
_step: dict[str, dict[str, int] | None] = {"tokens": None}  # this process's step in flight


def remember_step(wrapped, worker, args, kwargs):
    scheduler_output = kwargs["scheduler_output"] if "scheduler_output" in kwargs else args[0]
    _step["tokens"] = dict(scheduler_output.num_scheduled_tokens)
    try:
        return wrapped(*args, **kwargs)
    finally:
        _step["tokens"] = None


def record_rows(wrapped, worker, args, kwargs):
    aux_hidden_states = args[0] if args else kwargs["aux_hidden_states"]
    rows = aux_hidden_states[0].shape[0]
    segments = worker.__dict__.setdefault(SEGMENTS, [])
    tokens = _step["tokens"]
    if tokens is None:  # a warm-up or profiling forward: no request owns these rows
        segments.append((None, rows))
    else:
        owned = 0
        for request_id in scheduled_in_row_order(worker.model_runner, tokens):
            segments.append((request_id, tokens[request_id]))
            owned += tokens[request_id]
        if owned > rows:
            raise RuntimeError(f"vllm-compat capture_attribution: forward captured {rows} rows, "
                               f"but the step scheduled {owned} tokens")
        if owned < rows:
            segments.append((None, rows - owned))  # padding
    return wrapped(*args, **kwargs)


def forget_rows(wrapped, worker, args, kwargs):
    worker.__dict__.pop(SEGMENTS, None)
    return wrapped(*args, **kwargs)


def submission_key(request_id: str) -> tuple[int, int]:
    call, index = request_id.rsplit("_", 2)[-2:]
    return int(call), int(index)


def regroup_rows(wrapped, worker, args, kwargs):
    import torch

    segments = worker.__dict__.pop(SEGMENTS, [])
    layers = wrapped(*args, **kwargs)
    if layers is None:
        return None
    rows = layers[0].shape[0]
    if sum(n for _, n in segments) != rows:
        raise RuntimeError(f"vllm-compat capture_attribution: {rows} captured rows, "
                           f"{sum(n for _, n in segments)} accounted for")
    spans: dict[str, list[tuple[int, int]]] = {}
    start = 0
    for request_id, n in segments:
        if request_id is not None:
            spans.setdefault(request_id, []).append((start, start + n))
        start += n
    index = torch.cat([
        torch.arange(lo, hi) for request_id in sorted(spans, key=submission_key) for lo, hi in spans[request_id]
    ]).to(layers[0].device)
    return [layer.index_select(0, index) for layer in layers]


ADAPTER = Adapter(
    id="capture_attribution",
    summary="regroup speculators 0.3's captured rows per request, in submission order",
    drift="speculators 0.3.0 assumes rows arrive in submission order, one step per call",
    scope=Scope.WORKER,
    vllm=SpecifierSet(">=0.10.0"),
    speculators=SpecifierSet(SPECULATORS_03),
    deferred=True,
    patches=(
        Patch(f"{WORKER_EXTENSION}._store_captured_states", function_wrapper(record_rows)),
        Patch(f"{WORKER_EXTENSION}._reset_capture", function_wrapper(forget_rows)),
        Patch(f"{WORKER_EXTENSION}._get_captured_states", function_wrapper(regroup_rows)),
        Patch("vllm.v1.worker.gpu_worker:Worker.execute_model", function_wrapper(remember_step)),
    ),
    verified_through="0.34.0",  # ran on the H200 under 0.34.0, generator states = HF (docs/compatibility.md)
    requires=("v2_batch_order",),  # reads the batch order it notes under Model Runner V2
    evidence="docs/drift-atlas.md, \"Defects of speculators 0.3.0\"; docs/cpu-vllm.md, \"Correctness traps\"",
)
