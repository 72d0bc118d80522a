"""speculators 0.4.0 reads ``model_runner.input_batch``, which Model Runner V2 does not have.

Drift: see ``v2_batch_order``. speculators 0.4.0's ``_store_captured_states`` sorts the step's
request metadata by ``self.model_runner.input_batch.req_id_to_index``: ``AttributeError`` inside
the worker whenever V2 is the active runner (default for Qwen3 from 0.22, Llama/Mistral 0.23,
every model from 0.29 with Triton, or ``VLLM_USE_V2_MODEL_RUNNER=1``).

What it does: only while speculators 0.4's ``_store_captured_states`` runs, and only on a runner
without ``input_batch``, the runner carries a read-only view whose ``req_id_to_index`` is the
forward's row order (noted by ``v2_batch_order``); the view is removed right after.

Scope: worker, speculators 0.4.x. Disable: ``VLLM_COMPAT_DISABLE=input_batch_view``.
"""
from types import MappingProxyType, SimpleNamespace

from packaging.specifiers import SpecifierSet

from ..adapter import Adapter, Expect, Patch, Scope
from ..batch_order import batch_order
from ..consumer import SPECULATORS_04, WORKER_EXTENSION
from ..probes.shapes import MISSING, PRESENT, Exists
from ..wrapping import function_wrapper


def with_input_batch_view(wrapped, worker, args, kwargs):
    runner = worker.model_runner
    if getattr(worker, "_current_request_metadata", None) is None or hasattr(runner, "input_batch"):
        return wrapped(*args, **kwargs)
    order = batch_order(runner)
    runner.input_batch = SimpleNamespace(req_id_to_index=MappingProxyType({r: i for i, r in enumerate(order)}))
    try:
        return wrapped(*args, **kwargs)
    finally:
        del runner.input_batch


ADAPTER = Adapter(
    id="input_batch_view",
    summary="give speculators 0.4 the input_batch.req_id_to_index it reads, under Model Runner V2",
    drift="Model Runner V2 has no model_runner.input_batch (speculators 0.4.0 reads it per forward)",
    scope=Scope.WORKER,
    vllm=SpecifierSet(">=0.12.0"),
    expect=Expect(Exists("vllm.v1.worker.gpu.model_runner:GPUModelRunner.prepare_inputs"),
                  old={MISSING}, new={PRESENT}),
    speculators=SpecifierSet(SPECULATORS_04),
    deferred=True,
    patches=(Patch(f"{WORKER_EXTENSION}._store_captured_states", function_wrapper(with_input_batch_view)),),
    verified_through="0.32.0",
    requires=("v2_batch_order",),  # reads the batch order it notes under Model Runner V2
    evidence="docs/drift-atlas.md, \"Model Runner V2 by default (0.22.0 to 0.29.0)\": "
             "AttributeError in _store_captured_states under MRv2",
)
