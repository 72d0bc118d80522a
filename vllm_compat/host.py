"""What the host runs vLLM on, asked without touching CUDA in this process.

``torch.cuda.is_available()`` calls ``cudaGetDeviceCount``, after which torch refuses CUDA in any
child this process forks ("Cannot re-initialize CUDA in forked subprocess"; ``bench/fork_safety.py``
on an H200), and ``torch.accelerator``'s queries reach the same runtime. vLLM forks its engine core
by default, so a host probe run before ``vllm.LLM(...)`` must not ask torch: seen with the
extractor's ``vllm-native`` backend. vLLM's own platform detection asks NVML and is fork-safe.

Public: the host-dependent adapters and the extractor (``hidden_states``) ask here.
"""
from __future__ import annotations

import os


def vllm_device_type() -> str:
    """The device vLLM runs on here: ``"cuda"`` (also ROCm), ``"cpu"``, ``"xpu"``, ``"tpu"``, ..."""
    from vllm.platforms import current_platform

    return current_platform.device_type


def device_total_memory() -> int | None:
    """Total bytes of the first device vLLM would use (``CUDA_VISIBLE_DEVICES`` honoured), from
    ``current_platform.get_device_total_memory(0)`` where vLLM answers it through NVML: its NVIDIA
    platform when NVML loads. None elsewhere, since the other answers cost a CUDA context or mean
    something else: without NVML (Jetson) vLLM asks ``torch.cuda.get_device_properties``, and so does
    ROCm (0.16; later releases try amdsmi first); on the CPU backend it is the KV-cache space up to
    0.17 and the NUMA node's memory later (ask :func:`host_memory` there)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():  # vllm.platforms.cuda may import only on an NVIDIA build
        return None
    from vllm.platforms.cuda import NvmlCudaPlatform

    if not isinstance(current_platform, NvmlCudaPlatform):
        return None
    return int(current_platform.get_device_total_memory(0))


def device_name() -> str | None:
    """The name of the first device vLLM would use (``"NVIDIA H200"``), where vLLM's NVIDIA platform
    answers through NVML; ``"cpu"`` on its CPU backend; None elsewhere (as :func:`device_total_memory`)."""
    from vllm.platforms import current_platform

    if current_platform.device_type == "cpu":
        return "cpu"
    if not current_platform.is_cuda():
        return None
    from vllm.platforms.cuda import NvmlCudaPlatform

    if not isinstance(current_platform, NvmlCudaPlatform):
        return None
    return str(current_platform.get_device_name(0))


def host_memory() -> tuple[int, int]:
    """(available, total) bytes of host memory: ``MemAvailable`` and ``MemTotal`` of /proc/meminfo,
    else the physical pages ``sysconf`` counts."""
    fields = {}
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                key, _, rest = line.partition(":")
                fields[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    page = os.sysconf("SC_PAGE_SIZE")
    total = fields.get("MemTotal") or page * os.sysconf("SC_PHYS_PAGES")
    available = fields.get("MemAvailable") or page * os.sysconf("SC_AVPHYS_PAGES")
    return available, total
