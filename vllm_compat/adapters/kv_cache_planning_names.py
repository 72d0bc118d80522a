"""The KV-cache planning functions moved to ``kv_cache_planning`` (vLLM 0.33.0).

Drift: ``_get_kv_cache_groups_uniform_spec``, ``get_kv_cache_config_from_groups`` and
``unify_hybrid_kv_cache_specs`` moved from ``vllm/v1/core/kv_cache_utils.py`` (0.32.0: 1260, 1588,
1799) to the new ``vllm/v1/core/kv_cache_planning.py`` (0.33.0: 314, 642, 853) with signatures and
bodies unchanged, and ``kv_cache_utils`` does not re-export them. The speculators generator imports
all three from ``kv_cache_utils``, so importing it fails with ``ImportError``.

What it does: puts the three names back into ``vllm.v1.core.kv_cache_utils`` as the very same
functions (``kv_cache_utils.X is kv_cache_planning.X``), before anything imports them; revert
deletes them again. Applied first (phase ``IMPORT_FIX``), so that ``kv_cache_specs_kwarg`` then
wraps ``get_kv_cache_config_from_groups`` at its old address as on earlier releases.

Scope: worker (applied in every vLLM process too: a worker imports the generator's module when it
loads speculators' worker extension, ``speculators.data_generation``, and fails there first; a
missing name added where it used to be harms no caller).
Disable: ``VLLM_COMPAT_DISABLE=kv_cache_planning_names``.
"""
from packaging.specifiers import SpecifierSet

from ..adapter import Scope
from ..factories import alias_moved_names

ADAPTER = alias_moved_names(
    id="kv_cache_planning_names",
    old_module="vllm.v1.core.kv_cache_utils",
    new_module="vllm.v1.core.kv_cache_planning",
    names=("get_kv_cache_config_from_groups", "_get_kv_cache_groups_uniform_spec", "unify_hybrid_kv_cache_specs"),
    summary="give vllm.v1.core.kv_cache_utils back the KV-cache planning functions that moved out",
    drift="three kv_cache_utils functions moved to kv_cache_planning in 0.33.0, no re-export",
    scope=Scope.WORKER,
    vllm=SpecifierSet(">=0.33.0"),
    verified_through="0.34.0",  # ran on the H200 under 0.34.0, generator states = HF (docs/compatibility.md)
    evidence="docs/drift-atlas.md, \"KV-cache planning moves to its own module (0.33.0)\": "
             "vllm/v1/core/kv_cache_utils.py:1260,1588,1799 (0.32.0) -> "
             "vllm/v1/core/kv_cache_planning.py:314,642,853 (0.33.0)",
)
