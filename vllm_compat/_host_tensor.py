"""Tensors that cross vLLM's RPC reply channel without copies, and arrive in the parent on the CPU.

vLLM pickles worker replies with protocol 5 and ships out-of-band buffers of 1 MiB and more as
separate zero-copy frames. A torch tensor does not use that: it pickles its whole storage in-band
through ``torch.save``, and a CUDA tensor comes back *on the GPU* in the parent (which then has to
initialise CUDA, copy it there, and copy it back to the host). :class:`HostTensor` pickles its bytes
as one out-of-band buffer and unpickles as a plain CPU ``torch.Tensor`` sharing that buffer.
"""
from __future__ import annotations

import pickle
import warnings


def _rebuild(buffer, dtype_name: str, shape: tuple[int, ...]):
    import torch

    dtype = getattr(torch, dtype_name)
    with warnings.catch_warnings():  # the received frame is read-only; consumers copy what they keep
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(buffer, dtype=torch.uint8) if len(memoryview(buffer)) else torch.empty(0, dtype=torch.uint8)
    return flat.view(dtype).reshape(shape)


class HostTensor:
    """A CPU tensor that pickles as an out-of-band buffer and unpickles as ``torch.Tensor``."""

    __slots__ = ("tensor",)

    def __init__(self, tensor):
        self.tensor = tensor.contiguous()

    def __reduce_ex__(self, protocol):
        import torch

        tensor = self.tensor
        raw = tensor.reshape(-1).view(torch.uint8).numpy() if tensor.numel() else tensor.new_empty(0, dtype=torch.uint8).numpy()
        dtype_name = str(tensor.dtype).removeprefix("torch.")
        buffer = pickle.PickleBuffer(raw) if protocol >= 5 else raw.tobytes()
        return _rebuild, (buffer, dtype_name, tuple(tensor.shape))


def to_host(obj):
    """``obj`` with every tensor inside (lists, tuples, dicts) replaced by a :class:`HostTensor`;
    device tensors are copied to pinned host memory first, in one batch, one synchronisation."""
    import torch

    copies = []

    def convert(item):
        if isinstance(item, torch.Tensor):
            if item.device.type == "cpu":
                return HostTensor(item)
            host = torch.empty(item.shape, dtype=item.dtype, pin_memory=True)
            host.copy_(item, non_blocking=True)
            copies.append(item.device)
            return HostTensor(host)
        if isinstance(item, (list, tuple)):
            return type(item)(convert(x) for x in item)
        if isinstance(item, dict):
            return {key: convert(value) for key, value in item.items()}
        return item

    converted = convert(obj)
    for device in set(copies):
        torch.cuda.synchronize(device)
    return converted
