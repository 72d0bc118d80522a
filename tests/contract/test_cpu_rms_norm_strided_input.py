import pytest
import torch

from tests.contract.base import AdapterContract

import vllm_compat
from vllm_compat.adapters.cpu_rms_norm_strided_input import kernel_ignores_strides


def _relative(got, want) -> float:
    return float((got - want).norm() / want.norm())


class TestCpuRmsNormStridedInput(AdapterContract):
    adapter_id = "cpu_rms_norm_strided_input"
    last_new = "0.13.0"  # 0.14.0: CustomOp.forward_cpu runs forward_native, the kernel is not reached
    negative = "wrong"
    family = "qwen3"  # llama has no q/k-norm: its RMSNorm inputs are packed

    def test_patched_call(self):
        if self.expected_verdict() != "adapted" or not kernel_ignores_strides()[0]:
            pytest.skip("RMSNorm does not reach a stride-blind CPU kernel here")
        from vllm.model_executor.layers import layernorm

        generator = torch.Generator().manual_seed(3)
        qkv = torch.randn(11, 4 * 32 + 2 * 2 * 32, generator=generator)  # Qwen3's fused projection
        by_head = qkv[:, :128].view(11, 4, 32)
        weight = 1 + 0.1 * torch.randn(32, generator=generator)
        want = by_head * torch.rsqrt(by_head.pow(2).mean(-1, keepdim=True) + 1e-6) * weight
        broken = layernorm.rms_norm(by_head, weight, 1e-6)
        assert _relative(broken[0], want[0]) < 1e-5  # the first token is read right...
        assert _relative(broken, want) > 0.3  # ...the rest is not: what the adapter exists for

        assert vllm_compat.apply()[self.adapter_id].status == "applied"
        assert _relative(layernorm.rms_norm(by_head, weight, 1e-6), want) < 1e-5
        packed = by_head.contiguous()
        assert _relative(layernorm.rms_norm(packed, weight, 1e-6), want) < 1e-5
        assert torch.equal(qkv[:, :128].view(11, 4, 32), by_head)  # the input is left as it was
