import sys

import pytest

from tests.contract.base import AdapterContract

import vllm_compat
from vllm_compat.adapters.transformers_attn_mask_utils import MODULE, stand_in


class TestTransformersAttnMaskUtils(AdapterContract):
    adapter_id = "transformers_attn_mask_utils"
    negative = "No module named 'transformers.modeling_attn_mask_utils'"

    def test_stand_in_says_why(self):
        module = stand_in(None)
        with pytest.raises(NotImplementedError, match="_prepare_4d_causal_attention_mask is not in transformers"):
            module._prepare_4d_causal_attention_mask(None, (1, 2), None, 0)

    def test_patched_import(self):
        result = vllm_compat.apply()[self.adapter_id]
        if result.status != "applied":
            pytest.skip(result.reason)
        from transformers.modeling_attn_mask_utils import _prepare_4d_causal_attention_mask  # noqa: F401

        vllm_compat.revert()
        assert MODULE not in sys.modules
