import pytest

from tests.contract.base import AdapterContract

import vllm_compat
from vllm_compat.host import host_memory


class TestHostMemoryInfo(AdapterContract):
    adapter_id = "host_memory_info"
    negative = 'error'

    def test_patched_call(self, generator_module):
        if vllm_compat.apply()[self.adapter_id].status != "applied":
            pytest.skip("a CUDA device is present or the consumer does not need it")
        free, total = generator_module.torch.cuda.mem_get_info()
        assert 0 < free <= total == host_memory()[1]
        assert generator_module.torch.tensor([1, 2]).sum().item() == 3  # everything else passes through
        import torch

        assert generator_module.torch.cuda.mem_get_info is not torch.cuda.mem_get_info  # the real torch untouched
