import pytest

from tests.contract.base import AdapterContract

import vllm_compat


class TestPrefixCachingDefault(AdapterContract):
    adapter_id = "prefix_caching_default"
    first_new = "0.12.0"
    negative = 'error'

    def test_patched_call(self, generator_module):
        if vllm_compat.apply()[self.adapter_id].status != "applied":
            pytest.skip("not applied for this vLLM / speculators pair")
        assert generator_module.CacheConfig(block_size=16).enable_prefix_caching is False
        assert generator_module.CacheConfig(block_size=16, enable_prefix_caching=True).enable_prefix_caching is True
        from vllm.config import CacheConfig

        assert CacheConfig(block_size=16).enable_prefix_caching is True  # vLLM's engine keeps its default
