import pytest
import torch

from tests.contract.base import AdapterContract

import vllm_compat
from vllm_compat.adapters.cpu_rotary_head_layout import kernel_mishandles_heads


def _rope():
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    with set_current_vllm_config(VllmConfig()):  # custom-op dispatch reads it
        return get_rope(64, max_position=256, is_neox_style=False, dtype=torch.float32,
                        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})


def _relative(got, want) -> float:
    return float((got - want).norm() / want.norm())


class TestCpuRotaryHeadLayout(AdapterContract):
    adapter_id = "cpu_rotary_head_layout"
    first_new = "0.14.0"
    negative = 'wrong'
    family = 'deepseek'  # llama attention passes 2-D tensors

    def test_patched_call(self):
        if not kernel_mishandles_heads()[0]:
            pytest.skip(kernel_mishandles_heads()[1])
        positions = torch.arange(17)
        q = torch.randn(17, 4, 96, generator=torch.Generator().manual_seed(1))
        query = q[..., 32:]  # MLA's q_pe: a strided slice, no flat view of it exists
        key = torch.randn(17, 1, 64, generator=torch.Generator().manual_seed(2))
        want_query, want_key = _rope().forward_native(positions, query.clone(), key.clone())
        broken_query, _ = _rope().forward_cpu(positions, query.clone(), key.clone())
        assert _relative(broken_query, want_query) > 0.3  # what the adapter exists for

        assert vllm_compat.apply()[self.adapter_id].status == "applied"
        rope = _rope()
        got_q, got_key = q.clone(), key.clone()
        got_query = got_q[..., 32:]
        returned = rope.forward_cpu(positions, got_query, key=got_key)
        assert returned[0] is got_query and returned[1] is got_key  # rotated in place, as the kernel does
        assert _relative(got_query, want_query) < 1e-5 and _relative(got_key, want_key) < 1e-5
        assert torch.equal(got_q[..., :32], q[..., :32])  # the rest of the row is left alone
        contiguous = query.contiguous()
        rope.forward_cpu(positions, contiguous, key.clone())
        assert _relative(contiguous, want_query) < 1e-5
        flat = query.reshape(17, 256).clone()  # 2-D inputs are the kernel's own: untouched
        rope.forward_cpu(positions, flat, key.reshape(17, 64).clone())
        assert _relative(flat, want_query.reshape(17, 256)) < 1e-5
