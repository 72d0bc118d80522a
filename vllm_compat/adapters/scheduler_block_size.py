"""``Scheduler.__init__`` requires ``block_size`` (vLLM 0.11.1); it must be the config's, not a constant.

Drift: ``Scheduler(vllm_config, kv_cache_config, structured_output_manager, ...)`` up to 0.11.0
(``vllm/v1/core/sched/scheduler.py:45``) gained a required ``block_size`` in 0.11.1 (``:53-58``).
speculators 0.3.0 never passes it (``TypeError``); 0.4.0 passes the constant 16, which disagrees
with the real KV block size wherever the platform changes it (MLA models get 64/128 on CUDA before
0.18). vLLM's engine passes ``cache_config.block_size * dcp * pcp`` (``vllm/v1/engine/core.py``);
this adapter passes the same, read from the built config, and replaces a disagreeing constant.

Scope: consumer (the ``Scheduler`` name inside the speculators generator module; vLLM's engine
always passes the right value itself). Disable: ``VLLM_COMPAT_DISABLE=scheduler_block_size``.
"""
import logging

from packaging.specifiers import SpecifierSet

from .._targets import IN_PROCESS_SPECULATORS, generator_name
from .._wrapping import function_wrapper
from ..adapter import Adapter, Expect, Patch, Scope
from ..shapes import ABSENT, OPTIONAL, REQUIRED, Param

logger = logging.getLogger("vllm_compat")
BLOCK_SIZE_POSITION = 3  # (vllm_config, kv_cache_config, structured_output_manager, block_size, ...)


def config_block_size(vllm_config) -> int:
    """The scheduler block size vLLM's own engine derives from a built config."""
    parallel = vllm_config.parallel_config
    return (
        vllm_config.cache_config.block_size
        * getattr(parallel, "decode_context_parallel_size", 1)
        * getattr(parallel, "prefill_context_parallel_size", 1)
    )


def block_size_from_config(wrapped, instance, args, kwargs):
    vllm_config = kwargs["vllm_config"] if "vllm_config" in kwargs else args[0]
    size = config_block_size(vllm_config)
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
    evidence="DRIFT.md §1: vllm/v1/core/sched/scheduler.py:45 (0.11.0) -> :53-58 (0.11.1)",
)
