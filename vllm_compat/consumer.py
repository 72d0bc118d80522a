"""The consumer facts, in one place: which speculators releases the shim adapts, what code of theirs
it patches, and where they touch vLLM in ways no static reader of their source can follow.

Everyone reads these from here: the adapters (their ``speculators=`` ranges and targets), the audit,
the contract and end-to-end tests, and the scripts (``scripts/test_matrix.py``, ``vllm_venv.py``,
``compatibility.py``, which import this module with the repository on ``sys.path``: importing it
imports neither vLLM nor torch, only :mod:`vllm_compat.probes.shapes`).

Two kinds of speculators release meet vLLM differently:

* *generators* (0.3.x, 0.4.x) drive vLLM's internals in-process
  (``VllmHiddenStatesGenerator``): the adapters keep them working, the audit checks them;
* 0.5 and later drive ``vllm serve`` with vLLM's own ``extract_hidden_states`` method and need no
  shim (the extractor's ``--backend vllm-native`` is that path). Those that train on the
  extractor's output are consumers of its file format, not of this shim: their releases belong
  beside ``GENERATOR_RELEASES`` under their own name, never in the generator ranges below.
"""
from __future__ import annotations

from .probes.shapes import PRESENT, Attr, Check

# -- the generator releases ---------------------------------------------------------------------
# The releases the contract and end-to-end suites run (one speculators install each, see
# scripts/vllm_venv.py), oldest first.
GENERATOR_RELEASES = ("0.3.0", "0.4.0")
# speculators releases that drive vLLM internals in-process, and the two lines among them
IN_PROCESS_SPECULATORS = ">=0.3.0,<0.5"
SPECULATORS_03 = ">=0.3.0,<0.4"
SPECULATORS_04 = ">=0.4.0,<0.5"
# speculators releases that drive `vllm serve` instead: nothing in-process for the shim to check
SERVING_SPECULATORS = ">=0.5"

# -- the trainers that read the extractor's output ---------------------------------------------------
# Not generators: they read the files hidden_states writes (hidden_states.formats). speculators 0.5
# added the Arrow + hidden_states/hs_{i}.safetensors layout and 0.8 removed the reader of the old one.
# Per layout: the releases that train on it, and the release whose own trainer the e2e suite runs on
# it (tests/e2e/test_formats.py).
TRAINER_LAYOUTS = {"speculators-0.3": IN_PROCESS_SPECULATORS, "speculators-0.5": SERVING_SPECULATORS}
TRAINER_PROOF_RELEASES = {"speculators-0.3": "0.3.0", "speculators-0.5": "0.9.0"}

# -- the generator's code the adapters patch ------------------------------------------------------
GENERATOR = "speculators.data_generation.vllm_hidden_states_generator"
WORKER_EXTENSION = "speculators.data_generation.custom_worker:HiddenStatesWorkerExtension"


def generator_name(name: str) -> str:
    """A module-level name inside the generator module, e.g. the ``Scheduler`` it imported."""
    return f"{GENERATOR}:{name}"


# -- touch points the call-site audit cannot derive -----------------------------------------------
# Everything the generator's code imports, constructs, calls or reads on a vLLM object of known
# class is derived from its source by vllm_compat.callsites. What stays here is reached in ways no
# static reader of that source can follow; each entry says why.
# Each entry: (check, expected observation, speculators releases that touch it).
TOUCHPOINTS: tuple[tuple[Check, frozenset[str], str], ...] = tuple(
    (check, frozenset(expected), consumers)
    for check, expected, consumers in [
        # collective_rpc("get_kv_cache_spec") names a worker method by a string: the generator never
        # calls it as an attribute, and the worker class is chosen by vLLM at run time.
        (Attr("vllm.v1.worker.gpu_worker:Worker", "get_kv_cache_spec"), {PRESENT}, IN_PROCESS_SPECULATORS),
        # The worker extension is mixed into vLLM's Worker by ParallelConfig(worker_extension_cls=...),
        # so its `self` is a Worker that the extension's own source never names; collective_rpc then
        # runs the extension's methods beside the Worker's execute_model.
        (Attr("vllm.v1.worker.gpu_worker:Worker", "execute_model"), {PRESENT}, IN_PROCESS_SPECULATORS),
        # _patched_forward is bound onto whatever base model vLLM loaded (types.MethodType), so its
        # `self.embed_input_ids(...)` names no class; vLLM's Llama stands for the decoder models.
        # (0.3.0 calls get_input_embeddings: the embed_input_ids_alias adapter's own check.)
        (Attr("vllm.model_executor.models.llama:LlamaModel", "embed_input_ids"), {PRESENT}, SPECULATORS_04),
    ]
)
