"""What the host runs vLLM on, asked without touching CUDA in this process.

``torch.cuda.is_available()`` calls ``cudaGetDeviceCount``, after which torch refuses CUDA in any
child this process forks ("Cannot re-initialize CUDA in forked subprocess"; ``bench/fork_safety.py``
on an H200), and ``torch.accelerator``'s queries reach the same runtime. vLLM forks its engine core
by default, so a host probe run before ``vllm.LLM(...)`` must not ask torch: seen with the
extractor's ``vllm-native`` backend. vLLM's own platform detection asks NVML and is fork-safe.

Public: the host-dependent adapters and the extractor (``hidden_states``) ask here.
"""
from __future__ import annotations


def vllm_device_type() -> str:
    """The device vLLM runs on here: ``"cuda"`` (also ROCm), ``"cpu"``, ``"xpu"``, ``"tpu"``, ..."""
    from vllm.platforms import current_platform

    return current_platform.device_type
