"""Host probes must not ask torch whether CUDA is there.

``torch.cuda.is_available()`` calls ``cudaGetDeviceCount``, after which torch refuses CUDA in every
child the process forks (``bench/fork_safety.py`` on an H200; ``torch.accelerator``'s queries reach
the same runtime, so they are refused here too), and vLLM forks its engine core: a probe asking
it breaks ``vllm.LLM(...)`` after ``apply()`` on a GPU host (docs/reports/2026-11-30-first-gpu-runs.md,
"Fork safety (found on the GPU)"). Here each of those torch entry points raises while every adapter's host probe runs
against the installed vLLM; vLLM's platform (fork-safe, NVML) is resolved first, as vLLM does.
"""
import pytest
import torch

from vllm_compat.registry import adapters

PROBED = [adapter for adapter in adapters() if adapter.host_probe is not None]
FORK_POISONING = [
    (torch.cuda, "is_available"),
    (torch.cuda, "device_count"),
    (torch._C, "_cuda_getDeviceCount"),
    (torch.accelerator, "is_available"),
    (torch.accelerator, "device_count"),
    (torch.accelerator, "current_accelerator"),
]


@pytest.mark.parametrize("adapter", PROBED, ids=[adapter.id for adapter in PROBED])
def test_host_probe_leaves_cuda_alone(adapter, monkeypatch):
    from vllm.platforms import current_platform

    device = current_platform.device_type
    for owner, name in FORK_POISONING:
        if hasattr(owner, name):
            def refuse(*args, name=name, **kwargs):
                raise AssertionError(f"host probe called torch {name}(), which poisons fork for vLLM")

            monkeypatch.setattr(owner, name, refuse)

    needed, detail = adapter.host_probe()

    assert isinstance(needed, bool) and detail
    if device == "cpu" and adapter.id in ("host_memory_info", "native_connector_host_memory"):
        assert needed, detail
