"""Prefix caching is on by default (vLLM 0.12.0): turn it off for the generator's config.

Drift: ``CacheConfig.enable_prefix_caching`` defaulted to ``None`` (off for the hand-built
scheduler) and became ``True`` in 0.12.0 (``vllm/config/cache.py:76``). speculators 0.3.0 builds
``Request`` without a ``block_hasher``, so ``BlockPool.cache_full_blocks`` asserts as soon as a
prompt fills a block (``vllm/v1/core/block_pool.py:238``); and with a hasher, cache hits would skip
the forward pass whose hidden states the generator captures. Both are wrong for extraction.

Scope: consumer (the ``CacheConfig`` name inside the speculators generator module); an explicit
``enable_prefix_caching`` from the caller is kept. Disable: ``VLLM_COMPAT_DISABLE=prefix_caching_default``.
"""
from packaging.specifiers import SpecifierSet

from ..adapter import Expect, Scope
from ..consumer import SPECULATORS_03, generator_name
from ..factories import default_keyword
from ..probes.shapes import FieldDefault

ADAPTER = default_keyword(
    id="prefix_caching_default",
    at=generator_name("CacheConfig"),
    keyword="enable_prefix_caching",
    value=False,
    expect=Expect(FieldDefault("vllm.config:CacheConfig", "enable_prefix_caching"),
                  old={"None", "False"}, new={"True"}),
    summary="build the generator's CacheConfig with enable_prefix_caching=False",
    drift="CacheConfig.enable_prefix_caching default None -> True in 0.12.0",
    scope=Scope.CONSUMER,
    vllm=SpecifierSet(">=0.12.0"),
    speculators=SpecifierSet(SPECULATORS_03),  # 0.4 handles it itself
    verified_through="0.34.0",  # ran on the H200 under 0.34.0, generator states = HF (docs/compatibility.md)
    evidence="docs/drift-atlas.md, \"Prefix caching on by default (0.12.0)\": "
             "vllm/config/cache.py:76; vllm/v1/core/block_pool.py:238 (0.12.0)",
)
