"""Places the in-process speculators generators touch vLLM that the call-site audit cannot derive.

Everything the consumer's code imports, constructs, calls or reads on a vLLM object of known class
is derived from its source by :mod:`vllm_compat.callsites`. What stays here is reached in ways no
static reader of that source can follow; each entry says why.
Each entry: (check, expected observation, speculators versions that touch it).
"""
from __future__ import annotations

from .shapes import PRESENT, Attr, Check

BOTH = ">=0.3.0,<0.5"
ONLY_04 = ">=0.4.0,<0.5"

TOUCHPOINTS: tuple[tuple[Check, frozenset[str], str], ...] = tuple(
    (check, frozenset(expected), consumers)
    for check, expected, consumers in [
        # collective_rpc("get_kv_cache_spec") names a worker method by a string: the generator never
        # calls it as an attribute, and the worker class is chosen by vLLM at run time.
        (Attr("vllm.v1.worker.gpu_worker:Worker", "get_kv_cache_spec"), {PRESENT}, BOTH),
        # The worker extension is mixed into vLLM's Worker by ParallelConfig(worker_extension_cls=...),
        # so its `self` is a Worker that the extension's own source never names; collective_rpc then
        # runs the extension's methods beside the Worker's execute_model.
        (Attr("vllm.v1.worker.gpu_worker:Worker", "execute_model"), {PRESENT}, BOTH),
        # _patched_forward is bound onto whatever base model vLLM loaded (types.MethodType), so its
        # `self.embed_input_ids(...)` names no class; vLLM's Llama stands for the decoder models.
        # (0.3.0 calls get_input_embeddings: the embed_input_ids_alias adapter's own check.)
        (Attr("vllm.model_executor.models.llama:LlamaModel", "embed_input_ids"), {PRESENT}, ONLY_04),
    ]
)
