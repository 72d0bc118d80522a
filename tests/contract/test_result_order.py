import pytest
import torch

from tests.contract.base import AdapterContract

from vllm_compat.adapters.result_order import input_order


class TestResultOrder(AdapterContract):
    adapter_id = "result_order"
    negative = 'wrong'

    def test_patched_call(self):
        inputs = [[i + 10] * (i + 1) for i in range(12)]
        string_sorted = sorted(range(12), key=lambda i: f"req_0_{i}")  # what 0.4.0 returns
        returned = [{"input_ids": torch.tensor(inputs[i])} for i in string_sorted]
        ordered = input_order(lambda token_ids: returned, None, (inputs,), {})
        assert [r["input_ids"].tolist() for r in ordered] == inputs

    def test_mismatch_raises_instead_of_misleading(self):
        inputs = [[1], [2]]
        with pytest.raises(RuntimeError, match="result 0 does not hold input 0"):
            input_order(lambda token_ids: [{"input_ids": torch.tensor([2])}, {"input_ids": torch.tensor([1])}],
                        None, (inputs,), {})
