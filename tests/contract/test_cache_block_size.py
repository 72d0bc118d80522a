from tests.contract.base import AdapterContract

from vllm_compat.adapters.cache_block_size import backend_chooses_block_size


class TestCacheBlockSize(AdapterContract):
    adapter_id = "cache_block_size"
    first_new = "0.18.0"
    negative = 'No common block size'

    def test_patched_call(self):
        from vllm.config import CacheConfig

        config = backend_chooses_block_size(CacheConfig, None, (), {"block_size": 16, "gpu_memory_utilization": 0.5})
        assert config.gpu_memory_utilization == 0.5
        assert getattr(config, "user_specified_block_size", False) is False
