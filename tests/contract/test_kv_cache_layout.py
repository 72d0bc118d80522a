from tests.contract.base import AdapterContract


class TestKvCacheLayout(AdapterContract):
    adapter_id = "kv_cache_layout"
    first_new = "0.29.0"
