import pytest

from tests.contract.base import AdapterContract

import vllm_compat


class TestExtensibleKvCache(AdapterContract):
    adapter_id = "extensible_kv_cache"
    first_new = "0.34.0"
    # vLLM turns the extensible cache on only where it finds CUDA or ROCm (vllm/config/vllm.py:3194):
    # a CPU run of the generator never reserves without committing. The fault it prevents is shown on
    # the H200 (bench/device/stages.sh release-quick, its fault step; docs/compatibility.md, 0.34.0).
    not_observable_on_cpu = "the extensible KV cache is on only on CUDA/ROCm; the fault is reproduced on the H200"

    def test_patched_call(self, generator_module):
        if vllm_compat.apply()[self.adapter_id].status != "applied":
            pytest.skip("not applied for this vLLM / speculators pair")
        built = generator_module.CacheConfig(block_size=16)
        assert built.enable_extensible_kv_cache is False
        kept = generator_module.CacheConfig(block_size=16, enable_extensible_kv_cache=True)
        assert kept.enable_extensible_kv_cache is True  # the caller's own choice stands
        from vllm.config import CacheConfig

        # vLLM's own default is left alone: unset, for VllmConfig to settle per platform
        assert CacheConfig(block_size=16).enable_extensible_kv_cache is None

    def test_unpatched_generator_leaves_the_choice_to_vllm(self, generator_module):
        """The negative proof's first half, on any host: without the adapter the generator's cache
        is unset, which vLLM settles to on wherever it finds CUDA."""
        if self.expected_verdict() != "adapted":
            pytest.skip("vLLM before 0.34.0 has no extensible KV cache")
        assert generator_module.CacheConfig(block_size=16).enable_extensible_kv_cache is None
