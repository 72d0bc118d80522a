"""Base models renamed ``get_input_embeddings()`` to ``embed_input_ids()`` (vLLM 0.11.1).

Drift: Llama/Qwen2/Qwen3/Qwen3-MoE/DeepseekV2/GptOss base models expose ``embed_input_ids``
from 0.11.1 (``vllm/model_executor/models/llama.py:378`` in 0.11.0 -> ``:427`` in 0.11.1).
speculators 0.3.0's patched forward calls ``self.get_input_embeddings(input_ids)`` and dies with
``AttributeError`` inside the worker.

What it does: after speculators 0.3's ``_setup_hidden_states_capture`` has patched the base model,
that one model instance gets ``get_input_embeddings`` as an alias of its ``embed_input_ids``.

Scope: worker (speculators' worker extension, in vLLM's worker processes), speculators 0.3.x only.
Disable: ``VLLM_COMPAT_DISABLE=embed_input_ids_alias``.
"""
from packaging.specifiers import SpecifierSet

from ..adapter import Adapter, Expect, Patch, Scope
from ..consumer import SPECULATORS_03, WORKER_EXTENSION
from ..probes.shapes import WhichAttr
from ..wrapping import function_wrapper

OLD, NEW = "get_input_embeddings", "embed_input_ids"


def alias_embedding(wrapped, extension, args, kwargs):
    result = wrapped(*args, **kwargs)
    base = extension.model_runner.model.model
    if not hasattr(base, OLD) and hasattr(base, NEW):
        base.get_input_embeddings = base.embed_input_ids
    return result


ADAPTER = Adapter(
    id="embed_input_ids_alias",
    summary="give speculators 0.3's patched forward the get_input_embeddings() it calls",
    drift="base-model get_input_embeddings() renamed embed_input_ids() in 0.11.1",
    scope=Scope.WORKER,
    vllm=SpecifierSet(">=0.11.1"),
    expect=Expect(WhichAttr("vllm.model_executor.models.llama:LlamaModel", old_name=OLD, new_name=NEW),
                  old={OLD, "both"}, new={NEW}),
    speculators=SpecifierSet(SPECULATORS_03),
    deferred=True,
    patches=(Patch(f"{WORKER_EXTENSION}._setup_hidden_states_capture", function_wrapper(alias_embedding)),),
    verified_through="0.34.0",  # ran on the H200 under 0.34.0, generator states = HF (docs/compatibility.md)
    evidence="docs/drift-atlas.md, \"Input embeddings renamed (0.11.1)\": "
             "vllm/model_executor/models/llama.py:378 (0.11.0) -> :427 (0.11.1)",
)
