import importlib
import importlib.util
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

    @pytest.mark.parametrize("disabled", ["", "kv_cache_planning_names"], ids=["applied", "disabled"])
    def test_worker_process_imports_speculators_worker_extension(self, disabled):
        """A vLLM worker applies only what its ``vllm.general_plugins`` hook applies, then imports
        speculators' worker extension, whose package imports the generator module and with it the
        moved names. Run as a worker is: a fresh process, the plugin's ``register()``, the import.
        Applied, the import works; disabled, it fails as a real worker does (docs/drift-atlas.md,
        "KV-cache planning moves to its own module (0.33.0)")."""
        import os
        import subprocess
        import sys

        self.kv_cache_utils()
        if importlib.util.find_spec("speculators") is None or not self.consumer_needs_it():
            pytest.skip("no speculators 0.3/0.4 on the path")
        code = ("from vllm_compat.plugin import register; register(); "
                "import speculators.data_generation.custom_worker")
        env = {**os.environ, "VLLM_COMPAT_APPLY": "1", "VLLM_COMPAT_DISABLE": disabled}
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        if disabled:
            assert done.returncode != 0 and "cannot import name" in done.stderr, done.stderr[-2000:]
        else:
            assert done.returncode == 0, done.stderr[-3000:]
