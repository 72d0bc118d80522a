"""``Request.__init__`` no longer takes ``eos_token_id`` (vLLM 0.17.0).

Drift: required positional ``eos_token_id`` up to 0.16.0 (``vllm/v1/request.py:59-65``); gone in
0.17.0 (``:60-76``), where EOS lives on ``SamplingParams``. Passing it raises ``TypeError``.
The speculators generators ask for ``max_tokens=1`` and abort after prefill, so EOS never matters:
the keyword is dropped.

Scope: global (``Request`` is a class: patching its ``__init__`` reaches every import of it).
Disable: ``VLLM_COMPAT_DISABLE=request_eos_token_id``.
"""
from packaging.specifiers import SpecifierSet

from ..adapter import Scope
from ..factories import drop_keyword

ADAPTER = drop_keyword(
    id="request_eos_token_id",
    target="vllm.v1.request:Request.__init__",
    keyword="eos_token_id",
    summary="accept and drop Request(eos_token_id=...)",
    drift="eos_token_id parameter removed in 0.17.0 (moved to SamplingParams)",
    scope=Scope.GLOBAL,
    vllm=SpecifierSet(">=0.17.0"),
    verified_through="0.34.0",  # ran on the H200 under 0.34.0, generator states = HF (docs/compatibility.md)
    evidence="docs/drift-atlas.md, \"`Request` drops `eos_token_id` (0.17.0)\": "
             "vllm/v1/request.py:59-65 (0.16.0) -> :60-76 (0.17.0)",
)
