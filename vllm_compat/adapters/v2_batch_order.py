"""Model Runner V2 has no ``input_batch``: record each step's batch order where it is built.

Drift: vLLM's Model Runner V2 (``vllm/v1/worker/gpu/model_runner.py``; opt-in from 0.12.0, default
for Qwen3 in 0.22, for Llama/Mistral in 0.23, for every model from 0.29 when Triton is there; the
CPU backend has its own V2 runner in 0.32) builds each step's batch in ``prepare_inputs``, sorted
decodes-first then by token count, and has no ``model_runner.input_batch``. The captured rows of a
forward come in that order. speculators 0.4.0 reads ``model_runner.input_batch.req_id_to_index``
(``AttributeError`` under V2) and 0.3.0's rows must be attributed to requests too.

What it does: wraps V2's ``prepare_inputs`` to note the request ids of the batch it returns, in row
order, for the worker-side adapters that attribute captured rows (``capture_attribution``,
``input_batch_view``) and for the extractor's ``--backend vllm-engine``, whose worker reads it with
either capture (speculators' or its own, which runs without speculators): so for any consumer, not
only speculators 0.3/0.4. It changes nothing about the batch. Works with either runner active; do not
rely on forcing the old runner (``VLLM_USE_V2_MODEL_RUNNER=0`` is deprecated in 0.32).

Scope: worker. Disable: ``VLLM_COMPAT_DISABLE=v2_batch_order``.
"""
from packaging.specifiers import SpecifierSet

from ..adapter import Adapter, Expect, Patch, Scope
from ..batch_order import remember_v2_batch
from ..probes.shapes import MISSING, PRESENT, Exists
from ..wrapping import function_wrapper

TARGET = "vllm.v1.worker.gpu.model_runner:GPUModelRunner.prepare_inputs"

ADAPTER = Adapter(
    id="v2_batch_order",
    summary="note Model Runner V2's per-step batch order for the capture attribution",
    drift="Model Runner V2 (0.12 opt-in, default from 0.22/0.29) has no model_runner.input_batch",
    scope=Scope.WORKER,
    vllm=SpecifierSet(">=0.12.0"),
    expect=Expect(Exists(TARGET), old={MISSING}, new={PRESENT}),
    deferred=True,
    patches=(Patch(TARGET, function_wrapper(remember_v2_batch)),),
    verified_through="0.34.0",  # ran on the H200 under 0.34.0, generator states = HF (docs/compatibility.md)
    evidence="docs/drift-atlas.md, \"Model Runner V2 by default (0.22.0 to 0.29.0)\": "
             "vllm/v1/worker/gpu/model_runner.py:1291 (0.32.0)",
)
