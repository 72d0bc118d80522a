from tests.contract.base import AdapterContract

import vllm_compat


class TestTransformersConfigAnnotations(AdapterContract):
    adapter_id = "transformers_config_annotations"
    negative = "name 'torch' is not defined"

    def test_patched_call(self):
        import transformers.configuration_utils as module

        had_torch = "torch" in vars(module)
        result = vllm_compat.apply()[self.adapter_id]
        if result.status == "applied":
            import torch

            assert module.torch is torch
            vllm_compat.revert()
            assert "torch" not in vars(module)
        else:
            assert had_torch or "no torch annotations" in result.reason or "speculators" in result.reason
