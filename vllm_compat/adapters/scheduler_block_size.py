"""``Scheduler.__init__`` requires ``block_size`` (vLLM 0.11.1); it must be the config's, not a constant.

Drift: ``Scheduler(vllm_config, kv_cache_config, structured_output_manager, ...)`` up to 0.11.0
(``vllm/v1/core/sched/scheduler.py:45``) gained a required ``block_size`` in 0.11.1 (``:53-58``).
speculators 0.3.0 never passes it (``TypeError``); 0.4.0 passes the constant 16, which disagrees
with the real KV block size wherever the platform changes it (MLA models get 64/128 on CUDA before
0.18, or whatever the attention backend picks once ``cache_block_size`` lets it). vLLM's engine
passes the KV-cache block size times the context-parallel sizes (``vllm/v1/engine/core.py:133-146``
in 0.16.0; from 0.32 it first sets ``cache_config.block_size`` to the smallest block size of the KV
cache groups, ``:339-379``). This adapter does the same from the ``kv_cache_config`` the generator
passes in, and replaces a disagreeing constant.

Scope: consumer (the ``Scheduler`` name inside the speculators generator module; vLLM's engine
always passes the right value itself). Disable: ``VLLM_COMPAT_DISABLE=scheduler_block_size``.
"""
import logging

from packaging.specifiers import SpecifierSet

from ..adapter import Adapter, Expect, Patch, Scope
from ..consumer import IN_PROCESS_SPECULATORS, generator_name
from ..probes.shapes import ABSENT, OPTIONAL, REQUIRED, Param
from ..wrapping import function_wrapper

logger = logging.getLogger("vllm_compat")
BLOCK_SIZE_POSITION = 3  # (vllm_config, kv_cache_config, structured_output_manager, block_size, ...)


def config_block_size(vllm_config, kv_cache_config=None) -> int:
    """The scheduler block size vLLM's own engine derives: the KV-cache groups' (smallest) block
    size, or the cache config's, times the context-parallel sizes."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    sizes = [group.kv_cache_spec.block_size for group in groups]
    block = min(sizes) if sizes else vllm_config.cache_config.block_size
    if vllm_config.cache_config.block_size is None:  # as the engine core records it (0.32+)
        vllm_config.cache_config.block_size = block
    parallel = vllm_config.parallel_config
    return (
        block
        * getattr(parallel, "decode_context_parallel_size", 1)
        * getattr(parallel, "prefill_context_parallel_size", 1)
    )


def block_size_from_config(wrapped, instance, args, kwargs):
    vllm_config = kwargs["vllm_config"] if "vllm_config" in kwargs else args[0]
    kv_cache_config = kwargs["kv_cache_config"] if "kv_cache_config" in kwargs else (args[1] if len(args) > 1 else None)
    size = config_block_size(vllm_config, kv_cache_config)
    if len(args) > BLOCK_SIZE_POSITION:
        given = args[BLOCK_SIZE_POSITION]
        args = (*args[:BLOCK_SIZE_POSITION], size, *args[BLOCK_SIZE_POSITION + 1:])
    else:
        given = kwargs.get("block_size")
        kwargs["block_size"] = size
    if given is not None and given != size:
        logger.info("vllm-compat: Scheduler(block_size=%s) -> %s, the KV-cache block size of this config", given, size)
    return wrapped(*args, **kwargs)


ADAPTER = Adapter(
    id="scheduler_block_size",
    summary="pass Scheduler(block_size=) from the built config (not a constant)",
    drift="block_size became a required Scheduler parameter in 0.11.1",
    scope=Scope.CONSUMER,
    vllm=SpecifierSet(">=0.11.1"),
    expect=Expect(Param("vllm.v1.core.sched.scheduler:Scheduler.__init__", "block_size"),
                  old={ABSENT}, new={REQUIRED, OPTIONAL}),
    speculators=SpecifierSet(IN_PROCESS_SPECULATORS),
    patches=(Patch(generator_name("Scheduler"), function_wrapper(block_size_from_config)),),
    verified_through="0.34.0",  # ran on the H200 under 0.34.0, generator states = HF (docs/compatibility.md)
    bridges_steps=("kv_cache.resolve_kv_cache_block_sizes",),  # the scheduler block size, derived as vLLM does
    evidence="docs/drift-atlas.md, \"Scheduler needs `block_size` (0.11.1)\": "
             "vllm/v1/core/sched/scheduler.py:45 (0.11.0) -> :53-58 (0.11.1)",
)
