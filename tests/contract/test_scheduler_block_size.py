from types import SimpleNamespace

from tests.contract.base import AdapterContract

from vllm_compat.adapters.scheduler_block_size import block_size_from_config


class TestSchedulerBlockSize(AdapterContract):
    adapter_id = "scheduler_block_size"
    first_new = "0.11.1"
    negative = 'block_size'
    same_value_on_cpu = frozenset({'0.4.0'})  # 0.4 passes block_size=16, the config's block size on CPU

    def test_patched_call(self):
        from vllm.config import CacheConfig, ParallelConfig

        config = SimpleNamespace(cache_config=CacheConfig(block_size=64), parallel_config=ParallelConfig())
        seen = {}

        def scheduler(**kwargs):
            seen.update(kwargs)

        block_size_from_config(scheduler, None, (), {"vllm_config": config, "block_size": 16})
        assert seen["block_size"] == 64  # the built config wins over the consumer's constant
