from tests.contract.base import AdapterContract, host_vllm_config

import vllm_compat


class TestKvCacheSpecsKwarg(AdapterContract):
    adapter_id = "kv_cache_specs_kwarg"
    first_new = "0.12.0"
    negative = 'kv_cache_specs'
    not_called_by = frozenset({'0.4.0'})  # 0.4 never passes kv_cache_specs

    def test_patched_call(self):
        vllm_compat.apply()
        from vllm.v1.core import kv_cache_utils

        # No KV-cache groups: vLLM's own attention-free path, a real call without a model.
        config = kv_cache_utils.get_kv_cache_config_from_groups(
            vllm_config=host_vllm_config(), kv_cache_groups=[], kv_cache_specs={}, available_memory=0)
        assert config.num_blocks == 1
