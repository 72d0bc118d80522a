"""Captured states travel from the worker to the parent through shared memory.

Not a drift but the generators' main cost on a GPU (without it they extract at a small fraction
of vLLM's prefill speed: docs/reports/2026-11-30-first-gpu-runs.md, "The unmodified generator's first run on
the GPU (2026-11-30)" and the table atop that report): the worker returns its captured states as CUDA tensors
through ``collective_rpc``. vLLM pickles the reply; a tensor pickles its whole storage in-band
through ``torch.save``, and a CUDA tensor is rebuilt *on the GPU in the parent*, which initialises
CUDA there, copies the states back up, and then copies them down again (``.clone().cpu()``).
Several copies of every state, through pageable memory.

What it does: inside the worker, every tensor of the ``_get_captured_states`` reply is copied into
one shared-memory segment (``/dev/shm``, page-locked for the GPU's DMA, reused across calls); the
reply itself is a few hundred bytes saying where each tensor lies, and unpickles in the parent as
ordinary CPU ``torch.Tensor`` views of that segment (bit-identical; valid until the worker's next
reply, and the generators copy every slice they keep before returning). Without a usable
``/dev/shm`` each tensor travels as one zero-copy out-of-band pickle frame instead. The parent never
touches CUDA. In the parent, the first reply also tells glibc's allocator to keep freed memory
(``mallopt``: no ``mmap`` for ``malloc``, no trimming), so the generator's ``.clone()`` of every
slice reuses the pages of the previous calls' freed clones instead of faulting in fresh 4 KiB pages
(a fault per page held that copy back: docs/reports/2026-12-01-generator-host-copy-and-overlap.md,
"The parent's copy lands on fresh pages"); the process keeps its peak heap instead.
``VLLM_COMPAT_KEEP_FREED_HOST_MEMORY=0`` leaves the allocator alone.
See ``vllm_compat/transport.py``.

Scope: worker, both in-process speculators releases. Disable: ``VLLM_COMPAT_DISABLE=capture_transport``.
"""
from packaging.specifiers import SpecifierSet

from ..adapter import Adapter, Patch, Phase, Scope
from ..consumer import IN_PROCESS_SPECULATORS, WORKER_EXTENSION
from ..transport import to_host
from ..wrapping import function_wrapper


def states_to_host(wrapped, worker, args, kwargs):
    return to_host(wrapped(*args, **kwargs))


ADAPTER = Adapter(
    id="capture_transport",
    summary="ship captured states to the parent through shared memory, not pickled into the RPC reply",
    # said on every host: the CUDA-only cost (states rebuilt on the parent's GPU) is in the docstring
    drift="collective_rpc pickles every captured tensor in-band into the worker's reply",
    scope=Scope.WORKER,
    vllm=SpecifierSet(">=0.10.0"),
    speculators=SpecifierSet(IN_PROCESS_SPECULATORS),
    deferred=True,
    phase=Phase.TRANSPORT,  # outermost: after capture_attribution has regrouped the rows
    patches=(Patch(f"{WORKER_EXTENSION}._get_captured_states", function_wrapper(states_to_host)),),
    verified_through="0.34.0",  # ran on the H200 under 0.34.0, generator states = HF (docs/compatibility.md)
    evidence="docs/reports/2026-11-30-first-gpu-runs.md, \"The unmodified generator's first run on the GPU (2026-11-30)\"; "
             "vllm/distributed/device_communicators/shm_broadcast.py enqueue()",
)
