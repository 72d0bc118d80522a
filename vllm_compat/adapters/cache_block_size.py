"""An explicit ``CacheConfig(block_size=)`` is honoured from vLLM 0.18.0: let the backend choose.

Drift: up to 0.17 the platform silently replaced the block size a caller passed when the
attention backend needed another (``vllm/platforms/cuda.py:226-249`` in 0.16.0 forced 64/128 for
MLA models). From 0.18.0 an explicit value marks ``user_specified_block_size`` and is honoured
(``vllm/config/cache.py:36-40,195-206``; ``vllm/v1/attention/selector.py:74-77``), so the speculators
generator's constant ``CacheConfig(block_size=16)`` now steers backend selection: MLA models lose
their kernels on CUDA, and vLLM 0.32's CPU attention refuses it outright (``No common block size
for 16 (CPU_ATTN: [MultipleOf(32)])``).

What it does: the generator's ``CacheConfig`` is built without that constant, so vLLM picks the
block size exactly as for its own engine; ``scheduler_block_size`` then hands the scheduler the
block size the KV cache really has.

Scope: consumer. Disable: ``VLLM_COMPAT_DISABLE=cache_block_size``.
"""
from packaging.specifiers import SpecifierSet

from ..adapter import Adapter, Expect, Patch, Scope
from ..consumer import IN_PROCESS_SPECULATORS, generator_name
from ..probes.shapes import ABSENT, FieldDefault
from ..wrapping import function_wrapper


def backend_chooses_block_size(wrapped, instance, args, kwargs):
    kwargs.pop("block_size", None)
    return wrapped(*args, **kwargs)


ADAPTER = Adapter(
    id="cache_block_size",
    summary="let vLLM pick the KV-cache block size instead of the generator's constant 16",
    drift="an explicit CacheConfig(block_size=) is honoured (user_specified_block_size) from 0.18.0",
    scope=Scope.CONSUMER,
    vllm=SpecifierSet(">=0.18.0"),
    expect=Expect(FieldDefault("vllm.config:CacheConfig", "user_specified_block_size"), old={ABSENT}, new={"False"}),
    speculators=SpecifierSet(IN_PROCESS_SPECULATORS),
    patches=(Patch(generator_name("CacheConfig"), function_wrapper(backend_chooses_block_size)),),
    verified_through="0.34.0",  # ran on the H200 under 0.34.0, generator states = HF (docs/compatibility.md)
    evidence="docs/drift-atlas.md, \"An explicit block size is honoured (0.18.0)\": "
             "vllm/config/cache.py:36-40,195-206; vllm/v1/attention/selector.py:74-77",
)
