"""``get_kv_cache_config_from_groups`` no longer takes ``kv_cache_specs`` (vLLM 0.12.0).

Drift: ``(vllm_config, kv_cache_groups, kv_cache_specs, available_memory)`` up to 0.11.2
(``vllm/v1/core/kv_cache_utils.py:1001``) became ``(vllm_config, kv_cache_groups,
available_memory)`` in 0.12.0 (``:1050``); passing ``kv_cache_specs=`` raises ``TypeError``.
The groups already carry the specs, so the keyword is dropped.

Scope: global (dropping a keyword the function no longer takes is safe for every caller). Patched
where it is defined and on the speculators generator's by-value import of it.
From 0.33.0 the function lives in ``kv_cache_planning``; ``kv_cache_planning_names`` (phase
``IMPORT_FIX``, applied first) puts it back at the address patched here.
Disable: ``VLLM_COMPAT_DISABLE=kv_cache_specs_kwarg``.
"""
from packaging.specifiers import SpecifierSet

from ..adapter import Scope
from ..consumer import generator_name
from ..factories import drop_keyword

ADAPTER = drop_keyword(
    id="kv_cache_specs_kwarg",
    target="vllm.v1.core.kv_cache_utils:get_kv_cache_config_from_groups",
    keyword="kv_cache_specs",
    also_at=(generator_name("get_kv_cache_config_from_groups"),),
    summary="accept and drop get_kv_cache_config_from_groups(kv_cache_specs=...)",
    drift="kv_cache_specs parameter removed in 0.12.0",
    scope=Scope.GLOBAL,
    vllm=SpecifierSet(">=0.12.0"),
    verified_through="0.34.0",  # ran on the H200 under 0.34.0, generator states = HF (docs/compatibility.md)
    evidence="docs/drift-atlas.md, \"`get_kv_cache_config_from_groups` drops `kv_cache_specs` (0.12.0)\": "
             "vllm/v1/core/kv_cache_utils.py:1001 (0.11.2) -> :1050 (0.12.0)",
)
