"""The extensible KV cache is on by default on CUDA (vLLM 0.34.0): build the generator's cache without it.

Drift: vLLM 0.34.0 added ``CacheConfig.enable_extensible_kv_cache`` (``vllm/config/cache.py:395``),
left unset and settled to on for CUDA and ROCm when the ``VllmConfig`` is built
(``vllm/config/vllm.py:3180-3254``). With it on, a worker's ``initialize_from_config`` only reserves
the cache's address range (``vllm/v1/worker/gpu_worker.py:909-952``), warm-up commits memory for a
few blocks and gives it back (``:1080-1098``), and vLLM's engine core puts memory behind the final
block count with a step of its own, ``executor.extend_kv_cache(num_blocks)`` after warm-up
(``vllm/v1/engine/core.py:404-418``). The speculators generator builds its executor and scheduler
by hand, sizes the cache itself from free memory, and never takes that step: its scheduler hands out
blocks no memory stands behind. No signature changed; the audit's engine-step comparison names the
step (docs/audit.md, "Behaviour drift: engine steps and config fields").

What it does: the generator's ``CacheConfig`` is built with ``enable_extensible_kv_cache=False``,
vLLM's estimate-sized cache (what it does everywhere the extensible cache is unsupported, and what
the generator's own sizing assumes), so ``initialize_from_config`` allocates every block it is
given. An explicit value from the caller is kept.

Scope: consumer (the ``CacheConfig`` name inside the speculators generator module).
Disable: ``VLLM_COMPAT_DISABLE=extensible_kv_cache``.
"""
from packaging.specifiers import SpecifierSet

from ..adapter import Expect, Scope
from ..consumer import IN_PROCESS_SPECULATORS, generator_name
from ..factories import default_keyword
from ..probes.shapes import ABSENT, FieldDefault

ADAPTER = default_keyword(
    id="extensible_kv_cache",
    at=generator_name("CacheConfig"),
    keyword="enable_extensible_kv_cache",
    value=False,
    expect=Expect(FieldDefault("vllm.config:CacheConfig", "enable_extensible_kv_cache"),
                  old={ABSENT}, new={"None", "True"}),
    summary="build the generator's CacheConfig with enable_extensible_kv_cache=False",
    drift="CacheConfig.enable_extensible_kv_cache (on by default on CUDA) in 0.34.0: memory behind the "
          "KV cache only after the engine core's extend_kv_cache step, which the generator lacks",
    scope=Scope.CONSUMER,
    # with the cache sized up front, none of the engine core's extensible-cache steps has work to do
    bridges_steps=("executor.extensible_kv_cache_unsupported_reason", "executor.disable_extensible_kv_cache",
                   "kv_cache.finalize_extensible_kv_cache", "executor.extend_kv_cache"),
    vllm=SpecifierSet(">=0.34.0"),
    speculators=SpecifierSet(IN_PROCESS_SPECULATORS),
    # ran on the H200 under 0.34.0 (generator states = HF); the fault it prevents was not reproduced there
    # (docs/compatibility.md)
    verified_through="0.34.0",
    evidence="docs/drift-atlas.md, \"Extensible KV cache (0.34.0)\": "
             "vllm/config/cache.py:395; vllm/config/vllm.py:3180-3254; "
             "vllm/v1/engine/core.py:404-418; vllm/v1/worker/gpu_worker.py:909-952, 1080-1098",
)
