import pytest

from tests.contract.base import AdapterContract
from vllm_compat.probes.verdicts import ADAPTED


class TestKvCacheLayout(AdapterContract):
    adapter_id = "kv_cache_layout"
    first_new = "0.29.0"
    negative = 'KV cache layout has not been resolved'

    def test_patched_call(self):
        """The wrapper's two calls on a real executor whose worker RPCs are answered here, as one
        worker would: vLLM's own resolve_kv_cache_layout and set_kv_cache_layout run, and the RPC
        carries the context-parallel interleave size exactly where the method takes it (0.33+)."""
        if self.expected_verdict() != ADAPTED:
            pytest.skip("no KV-cache layout to resolve before 0.29.0")
        import inspect
        from types import SimpleNamespace

        from vllm.config import CacheConfig, ParallelConfig
        from vllm.v1.executor.multiproc_executor import MultiprocExecutor
        from vllm.v1.kv_cache_interface import KVCacheLayout

        from vllm_compat.adapters.kv_cache_layout import resolve_layout

        layout = next(iter(KVCacheLayout)).name
        sent = []

        class AnsweredHere(MultiprocExecutor):
            def collective_rpc(self, method, timeout=None, args=(), kwargs=None, **_):
                sent.append((method, args))
                return {"get_kv_cache_spec": [{}], "get_supported_kv_cache_layouts": [[layout]]}.get(method)

        executor = object.__new__(AnsweredHere)
        # the config parts these calls read, real ones (a whole VllmConfig needs a device platform,
        # which 0.33.0's CUDA wheel lacks on a host without a GPU)
        executor.vllm_config = SimpleNamespace(cache_config=CacheConfig(), parallel_config=ParallelConfig(),
                                               kv_transfer_config=None)
        executor.vllm_config.parallel_config.cp_kv_cache_interleave_size = 4
        assert resolve_layout(lambda: executor, None, (), {}) is executor
        takes_interleave = "cp_kv_cache_interleave_size" in inspect.signature(MultiprocExecutor.set_kv_cache_layout).parameters
        assert sent[-1] == ("set_kv_cache_layout", (layout, 4) if takes_interleave else (layout,))
        assert executor.vllm_config.cache_config.kv_cache_layout == layout
