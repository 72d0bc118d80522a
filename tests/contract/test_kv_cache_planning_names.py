import pytest

from tests.contract.base import AdapterContract
from vllm_compat.verdicts import ADAPTED

NAMES = ("get_kv_cache_config_from_groups", "_get_kv_cache_groups_uniform_spec", "unify_hybrid_kv_cache_specs")


class TestKvCachePlanningNames(AdapterContract):
    adapter_id = "kv_cache_planning_names"
    first_new = "0.33.0"
    negative = "cannot import name"

    def test_patched_call(self):
        """Applied, each moved name is there again at its old address, as the very function of its
        new one (``kv_cache_specs_kwarg``, applied after it, wraps one of them there), and the
        generator's call through the old address, with the keyword it drops, builds a KV-cache
        config; reverted, the names are gone again."""
        import importlib
        import inspect

        import vllm_compat

        utils = importlib.import_module("vllm.v1.core.kv_cache_utils")
        if self.expected_verdict() != ADAPTED:
            assert all(hasattr(utils, name) for name in NAMES)
            pytest.skip("the names are still defined in kv_cache_utils")
        planning = importlib.import_module("vllm.v1.core.kv_cache_planning")
        assert not any(hasattr(utils, name) for name in NAMES)
        vllm_compat.apply()
        assert all(inspect.unwrap(getattr(utils, name)) is getattr(planning, name) for name in NAMES)
        from vllm.config import VllmConfig

        config = utils.get_kv_cache_config_from_groups(
            vllm_config=VllmConfig(), kv_cache_groups=[], kv_cache_specs={}, available_memory=0)
        assert config.num_blocks == 1
        vllm_compat.revert()
        assert not any(hasattr(utils, name) for name in NAMES)
