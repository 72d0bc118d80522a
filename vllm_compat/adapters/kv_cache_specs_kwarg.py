"""``get_kv_cache_config_from_groups`` no longer takes ``kv_cache_specs`` (vLLM 0.12.0).

Drift: ``(vllm_config, kv_cache_groups, kv_cache_specs, available_memory)`` up to 0.11.2
(``vllm/v1/core/kv_cache_utils.py:1001``) became ``(vllm_config, kv_cache_groups,
available_memory)`` in 0.12.0 (``:1050``); passing ``kv_cache_specs=`` raises ``TypeError``.
The groups already carry the specs, so the keyword is dropped.

Scope: global (dropping a keyword the function no longer takes is safe for every caller). Patched
where it is defined and on the speculators generator's by-value import of it.
Disable: ``VLLM_COMPAT_DISABLE=kv_cache_specs_kwarg``.
"""
from packaging.specifiers import SpecifierSet

from .._targets import generator_name
from .._wrapping import function_wrapper
from ..adapter import Adapter, Expect, Patch, Scope
from ..shapes import ABSENT, OPTIONAL, REQUIRED, Param

TARGET = "vllm.v1.core.kv_cache_utils:get_kv_cache_config_from_groups"


def drop_kv_cache_specs(wrapped, instance, args, kwargs):
    kwargs.pop("kv_cache_specs", None)
    return wrapped(*args, **kwargs)


ADAPTER = Adapter(
    id="kv_cache_specs_kwarg",
    summary="accept and drop get_kv_cache_config_from_groups(kv_cache_specs=...)",
    drift="kv_cache_specs parameter removed in 0.12.0",
    scope=Scope.GLOBAL,
    vllm=SpecifierSet(">=0.12.0"),
    expect=Expect(Param(TARGET, "kv_cache_specs"), old={REQUIRED, OPTIONAL}, new={ABSENT}),
    patches=(
        Patch(TARGET, function_wrapper(drop_kv_cache_specs)),
        Patch(generator_name("get_kv_cache_config_from_groups"), function_wrapper(drop_kv_cache_specs)),
    ),
    evidence="DRIFT.md §1: vllm/v1/core/kv_cache_utils.py:1001 (0.11.2) -> :1050 (0.12.0)",
)
