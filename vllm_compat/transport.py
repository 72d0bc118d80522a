"""Captured states from a vLLM worker to the parent: through shared memory, not the RPC socket.

vLLM pickles worker replies (protocol 5) and sends anything over its shared-memory ring through a
ZeroMQ socket. Tensors make that slow: a tensor pickles its whole storage in-band via
``torch.save``, a CUDA tensor is rebuilt *on the parent's GPU* (the parent initialises CUDA, copies
the states up, and the generator copies them down again), and gigabytes through a local socket move
at a few GB/s at best.

Here the worker copies every tensor of the reply into one file-backed shared-memory segment
(``/dev/shm``; page-locked for the GPU, so the device-to-host copy runs at full DMA speed) and
replies with a few hundred bytes saying where each tensor lies. In the parent, unpickling maps the
segment (once; it is kept and reused while its size suffices) and hands back CPU tensors viewing
it. The parent never touches CUDA.

The views are valid until the next reply from the same worker overwrites the segment: the
speculators generators copy (``.clone()``) every slice they keep before they return, so nothing
outlives that. Where ``/dev/shm`` cannot be used, each tensor travels as one zero-copy out-of-band
pickle buffer instead (:class:`HostTensor`), still arriving on the CPU.
"""
from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import itertools
import mmap
import os
import pickle
import warnings

ALIGN = 4096
SHM_DIR = "/dev/shm"

# --------------------------------------------------------------------------------------------
# parent side


_mappings: dict[str, mmap.mmap] = {}  # segment id -> this process's mapping of it

# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
_kept: bool | None = None  # None: not tried yet in this process


def keep_freed_host_memory() -> bool:
    """Let this process reuse the memory of freed tensors instead of faulting in fresh pages.

    The consumer clones every slice it keeps out of the segment: a [2048 x 4096] bf16 slice is a
    16 MiB allocation, which glibc serves with a fresh ``mmap`` and unmaps again on ``free`` (and
    freed heap tops above 32 MiB are trimmed). Every byte of every clone then lands on a page the
    kernel must fault in and zero first, and the copy runs at a small fraction of the speed the
    same bytes come off the GPU (docs/reports/2026-12-01-generator-host-copy-and-overlap.md,
    "The parent's copy lands on fresh pages"; bench/host_copy.py reproduces it on any Linux CPU). With
    mmap off for malloc and no trimming, the next call's clones reuse the previous calls' freed
    pages (no faults once warm); the price is that the process keeps its peak heap. Process-wide,
    so only the process that receives captured states (the generator's) asks for it. glibc only;
    elsewhere nothing changes. Returns whether it applied.
    """
    global _kept
    if _kept is None:
        _kept = False
        name = ctypes.util.find_library("c")
        if name and os.environ.get("VLLM_COMPAT_KEEP_FREED_HOST_MEMORY", "1") != "0":
            try:
                mallopt = ctypes.CDLL(name).mallopt
            except (OSError, AttributeError):  # not glibc (musl has no mallopt)
                return False
            mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
            # mallopt takes an int; glibc reads the trim threshold as a size_t: -1 is "never trim"
            _kept = bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, -1))
    return _kept


def _map(path: str, segment: str, nbytes: int) -> mmap.mmap:
    mapping = _mappings.get(segment)
    if mapping is None or len(mapping) < nbytes:
        for stale in [key for key in _mappings if key.split(":")[0] == segment.split(":")[0]]:
            try:
                _mappings.pop(stale).close()
            except BufferError:  # a caller still holds views of the old segment: it goes with them
                pass
        fd = os.open(path, os.O_RDWR)  # writable, so in-place ops on a view cannot fault
        try:
            mapping = mmap.mmap(fd, 0)
        finally:
            os.close(fd)
        os.unlink(path)  # both sides hold mappings: the name is no longer needed, and nothing leaks
        _mappings[segment] = mapping
    return mapping


def _tensors(buffer, layout):
    import torch

    with warnings.catch_warnings():  # out-of-band frames are read-only; consumers copy what they keep
        warnings.simplefilter("ignore", UserWarning)
        out = []
        for offset, nbytes, dtype_name, shape in layout:
            if nbytes == 0:
                out.append(torch.empty(shape, dtype=getattr(torch, dtype_name)))
                continue
            flat = torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes, offset=offset)
            out.append(flat.view(getattr(torch, dtype_name)).reshape(shape))
        return out


def _rebuild(structure, leaves):
    if isinstance(structure, int):
        return leaves[structure]
    kind, items = structure
    if kind == "dict":
        return {key: _rebuild(value, leaves) for key, value in items}
    rebuilt = [_rebuild(value, leaves) for value in items]
    return tuple(rebuilt) if kind == "tuple" else rebuilt


def _attach(path, segment, nbytes, layout, structure):
    keep_freed_host_memory()
    return _rebuild(structure, _tensors(_map(path, segment, nbytes), layout))


def _from_buffer(buffer, dtype_name, shape):
    return _tensors(buffer, [(0, len(memoryview(buffer)), dtype_name, shape)])[0]


# --------------------------------------------------------------------------------------------
# worker side


class HostTensor:
    """A CPU tensor that pickles as one out-of-band buffer and unpickles as ``torch.Tensor``."""

    __slots__ = ("tensor",)

    def __init__(self, tensor):
        self.tensor = tensor.contiguous()

    def __reduce_ex__(self, protocol):
        import torch

        raw = self.tensor.reshape(-1).view(torch.uint8).numpy()
        buffer = pickle.PickleBuffer(raw) if protocol >= 5 else raw.tobytes()
        return _from_buffer, (buffer, str(self.tensor.dtype).removeprefix("torch."), tuple(self.tensor.shape))


class SharedStates:
    """The reply: where each tensor lies in this worker's segment, and the reply's shape."""

    __slots__ = ("path", "segment", "nbytes", "layout", "structure")

    def __init__(self, path, segment, nbytes, layout, structure):
        self.path, self.segment, self.nbytes, self.layout, self.structure = path, segment, nbytes, layout, structure

    def __reduce__(self):
        return _attach, (self.path, self.segment, self.nbytes, self.layout, self.structure)


class _Segment:
    """This worker's shared-memory segment, grown when a reply does not fit, page-locked for DMA."""

    _counter = itertools.count()

    def __init__(self):
        self.path = None
        self.segment = None
        self.mapping = None
        self.host = None  # torch uint8 view of the mapping
        self.pinned = False
        self.registered = False

    def ensure(self, nbytes: int, want_pinned: bool):
        import torch

        if self.mapping is not None and len(self.mapping) >= nbytes:
            return
        self.release()
        size = max(nbytes, 1 << 20)
        size = 1 << (size - 1).bit_length()  # powers of two: few regrowths
        number = next(self._counter)
        if not self.registered:
            atexit.register(self.release)  # the name goes away with the worker, even if never mapped
            self.registered = True
        self.path = os.path.join(SHM_DIR, f"vllm-compat-states-{os.getpid()}-{number}")
        self.segment = f"{os.getpid()}:{number}"
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            self.mapping = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.host = torch.frombuffer(self.mapping, dtype=torch.uint8)
        if want_pinned:
            self.pinned = pin_host_memory(self.host)

    def release(self):
        if self.mapping is None:
            return
        if self.pinned:
            import torch

            torch.cuda.cudart().cudaHostUnregister(self.host.data_ptr())
        self.host = None
        try:
            self.mapping.close()
        except BufferError:  # a view is still alive somewhere: leave it to the process's exit
            pass
        if self.path and os.path.exists(self.path):
            os.unlink(self.path)
        self.mapping = self.path = None
        self.pinned = False


_segment = _Segment()


def pin_host_memory(host) -> bool:
    """Page-lock the memory under the CPU tensor ``host`` for the GPU's DMA (device-to-host copies
    into it run at full speed and may be non-blocking). Whether it worked; the memory stays usable
    either way, as pageable memory."""
    import torch

    return int(torch.cuda.cudart().cudaHostRegister(host.data_ptr(), host.numel() * host.element_size(), 0)) == 0


def _flatten(obj, leaves):
    import torch

    if isinstance(obj, torch.Tensor):
        leaves.append(obj)
        return len(leaves) - 1
    if isinstance(obj, dict):
        return ("dict", [(key, _flatten(value, leaves)) for key, value in obj.items()])
    if isinstance(obj, (list, tuple)):
        return ("tuple" if isinstance(obj, tuple) else "list", [_flatten(value, leaves) for value in obj])
    raise TypeError(f"cannot ship {type(obj).__name__} in captured states")


def to_host(obj):
    """Ship ``obj`` (tensors in lists / tuples / dicts; None passes through) to the parent."""
    import torch

    if obj is None:
        return None
    leaves: list = []
    structure = _flatten(obj, leaves)
    layout, offset = [], 0
    for tensor in leaves:
        nbytes = tensor.numel() * tensor.element_size()
        layout.append((offset, nbytes, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape)))
        offset += (nbytes + ALIGN - 1) // ALIGN * ALIGN
    on_gpu = [t.device for t in leaves if t.device.type == "cuda"]
    try:
        _segment.ensure(offset, want_pinned=bool(on_gpu))
    except OSError:  # no usable /dev/shm here: out-of-band pickle buffers instead
        return _rebuild(structure, [HostTensor(t.to("cpu")) for t in leaves])
    for tensor, (start, nbytes, _, _) in zip(leaves, layout):
        if nbytes:
            target = _segment.host[start:start + nbytes].view(tensor.dtype).view(tensor.shape)
            target.copy_(tensor, non_blocking=_segment.pinned)
    for device in set(on_gpu):
        torch.cuda.synchronize(device)
    return SharedStates(_segment.path, _segment.segment, offset, layout, structure)
