import importlib
import inspect

import pytest

import vllm_compat
from tests.contract.base import AdapterContract, host_vllm_config
from vllm_compat.probes.verdicts import ADAPTED

NAMES = ("get_kv_cache_config_from_groups", "_get_kv_cache_groups_uniform_spec", "unify_hybrid_kv_cache_specs")


class TestKvCachePlanningNames(AdapterContract):
    adapter_id = "kv_cache_planning_names"
    first_new = "0.33.0"
    negative = "cannot import name"

    def kv_cache_utils(self):
        utils = importlib.import_module("vllm.v1.core.kv_cache_utils")
        if self.expected_verdict() != ADAPTED:
            assert all(hasattr(utils, name) for name in NAMES)
            pytest.skip("the names are still defined in kv_cache_utils")
        assert not any(hasattr(utils, name) for name in NAMES)
        return utils

    def test_patched_call(self):
        """Applied, each moved name is there again at its old address, as the very function of its
        new one (``kv_cache_specs_kwarg``, applied after it, wraps one of them there); reverted,
        the names are gone again."""
        utils = self.kv_cache_utils()
        planning = importlib.import_module("vllm.v1.core.kv_cache_planning")
        vllm_compat.apply()
        assert all(inspect.unwrap(getattr(utils, name)) is getattr(planning, name) for name in NAMES)
        vllm_compat.revert()
        assert not any(hasattr(utils, name) for name in NAMES)

    def test_call_through_the_old_address(self):
        """The generator's call, through the old address and with the keyword kv_cache_specs_kwarg
        drops, builds a KV-cache config (vLLM's attention-free path: a real call without a model)."""
        utils = self.kv_cache_utils()
        vllm_compat.apply()
        config = utils.get_kv_cache_config_from_groups(
            vllm_config=host_vllm_config(), kv_cache_groups=[], kv_cache_specs={}, available_memory=0)
        assert config.num_blocks == 1
