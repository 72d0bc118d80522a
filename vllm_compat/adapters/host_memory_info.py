"""Free memory for the KV-cache budget on a host without a CUDA device (vLLM's CPU backend).

Not a vLLM drift but a host case: the generators size the KV cache from the accelerator's free
memory. speculators 0.3.0 calls ``torch.cuda.mem_get_info()``, which raises on a machine without
a CUDA driver; 0.4.0 calls its own ``mem_get_info()``, which raises the same way with a CUDA build
of torch and returns ``(0, 0)`` (a zero KV cache) with a CPU build. On vLLM's CPU backend the KV
cache lives in host memory, so the honest answer is host memory: ``(MemAvailable, MemTotal)``.

Scope: consumer (names inside the speculators generator module only: its ``torch`` is seen through
a proxy whose ``cuda.mem_get_info`` answers for the host, and 0.4's ``mem_get_info``); applied
only when no CUDA device is available. Disable: ``VLLM_COMPAT_DISABLE=host_memory_info``.
"""
import wrapt
from packaging.specifiers import SpecifierSet

from ..adapter import Adapter, Patch, Scope
from ..consumer import IN_PROCESS_SPECULATORS, generator_name
from ..host import host_memory, vllm_device_type


class _CudaOnHost(wrapt.ObjectProxy):
    def mem_get_info(self, device=None):
        return host_memory()


class _TorchOnHost(wrapt.ObjectProxy):
    """The generator's ``torch``: everything passes through except ``torch.cuda.mem_get_info``."""

    @property
    def cuda(self):
        return _CudaOnHost(self.__wrapped__.cuda)


def no_cuda_device() -> tuple[bool, str]:
    device = vllm_device_type()
    if device == "cuda":
        return False, "vLLM runs on a CUDA device: torch.cuda.mem_get_info answers"
    return True, f"vLLM runs on {device}, no CUDA device: KV-cache memory is host memory"


ADAPTER = Adapter(
    id="host_memory_info",
    summary="answer the generator's device-memory query with host memory on CPU-only hosts",
    drift="torch.cuda.mem_get_info() raises (or 0.4's helper returns (0, 0)) without a CUDA device",
    scope=Scope.CONSUMER,
    vllm=SpecifierSet(">=0.10.0"),
    speculators=SpecifierSet(IN_PROCESS_SPECULATORS),
    host_note="on hosts without a CUDA device",
    host_probe=no_cuda_device,
    patches=(
        Patch(generator_name("torch"), _TorchOnHost),
        Patch(generator_name("mem_get_info"), lambda original: wrapt.FunctionWrapper(
            original, lambda wrapped, instance, args, kwargs: host_memory()), optional=True),
    ),
    verified_through="0.32.0",
    evidence="docs/cpu-vllm.md, \"Running\"; speculators 0.4.0 speculators/utils/util.py:34-43",
)
