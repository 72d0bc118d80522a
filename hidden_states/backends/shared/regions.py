"""Where ``--backend vllm-engine``'s states meet: one shared-memory file cut into a region per
request, and the layout of a region, which this process (``vllm_engine``) and the worker
(``engine_capture``) both follow.

A region: a 64-byte header whose first int64 is the number of prompt rows stored so far and whose
second is the first prompt position the worker stored a row at (0 unless vLLM's prefix cache gave the
request its first tokens: those rows are left to this process, ``cached_rows.py``); a second pair of
the same counters at ``SECOND`` for a second request storing into the region (``hidden-states
generate``'s training row, prefilled where its reply's rows already are: a late count of the reply's
own last step lands in the first pair, never in the row's); the token id of
every stored row (int32), padded to 64 bytes; with FP8 states (``--state-dtype fp8``), each row's
scale (float32), padded to 64 bytes; all that padded to a whole number of rows; then the layers one
after the other, each ``[prompt_len, hidden]`` contiguous. Regions start at a multiple of a row's
bytes too, so every stored row of every region is one row of the file seen as ``[rows, row_bytes]``:
the worker moves a step's scattered rows (one per decoding request) with one indexed copy.
"""
from __future__ import annotations

import math
import mmap
import os
import struct
import tempfile
import threading
import time
import weakref

from ...errors import ExtractError

ALIGN = 64
# A request's region, shared by this process and the worker (engine_capture).
# the sampling parameters' extra_args key: (offset, rows the region is laid out for, which counters: 0 or SECOND)
REGION = "hidden_states_region"
HEADER = 64  # a region's first bytes: two pairs of counters (int64 rows stored, int64 first row stored), REWRITTEN
FIRST_ROW = 8  # where in a pair of counters the first row stored is
SECOND = 16  # the second request's pair of counters
REWRITTEN = 32  # the lowest position stored at again after it was counted (int64)
UNREWRITTEN = (1 << 63) - 1
SHM = "/dev/shm"


def _per_row(length: int) -> int:
    """Bytes of one 4-byte value per row (a token id, a scale), padded to 64."""
    return (4 * length + 63) // 64 * 64


def scales_start(length: int) -> int:
    """Where a ``length``-token region's row scales start (FP8 states), after the token ids."""
    return HEADER + _per_row(length)


def layer_start(length: int, index: int, row_bytes: int, scales: bool = False) -> int:
    """Where layer ``index`` of a ``length``-token region starts, from the region's start (after the
    header, the token ids and, with ``scales``, the row scales, padded to a whole row)."""
    before = HEADER + _per_row(length) * (2 if scales else 1)
    return -(-before // row_bytes) * row_bytes + index * length * row_bytes


def region_bytes(length: int, layers: int, row_bytes: int, scales: bool = False) -> int:
    return layer_start(length, layers, row_bytes, scales)


def regions_root(needed_bytes: int) -> str | None:
    """Where the regions' file lives: ``/dev/shm`` (memory, never written back) where it has room
    for ``needed_bytes``, else the default temporary directory (None)."""
    try:
        stat = os.statvfs(SHM)
    except OSError:
        return None
    if stat.f_bavail * stat.f_frsize < needed_bytes or not os.access(SHM, os.W_OK):
        return None
    return SHM


class RegionPool:
    """A shared-memory file cut into regions: first fit, freed regions merged, ``reserve`` waits for
    room (the writer frees regions as it writes). Every region starts at a multiple of ``align``
    bytes (and of 64)."""

    def __init__(self, capacity: int, align: int = ALIGN):
        self.capacity, self.align = capacity, math.lcm(ALIGN, align)
        fd, self.path = tempfile.mkstemp(prefix="hidden-states-regions-", dir=regions_root(capacity))
        try:
            os.ftruncate(fd, capacity)
            self.mapping = mmap.mmap(fd, capacity)
        finally:
            os.close(fd)
        self._free = [(0, capacity)]  # (offset, size), sorted by offset
        self._reserved: dict[int, int] = {}  # offset -> size of each region handed out
        self._room = threading.Condition()

    def reserve(self, nbytes: int, timeout: float) -> int:
        nbytes = -(-nbytes // self.align) * self.align
        if nbytes > self.capacity:
            raise ExtractError(f"a sequence needs {nbytes} bytes of states, the region pool holds {self.capacity}")
        with self._room:
            if not self._room.wait_for(lambda: self._fit(nbytes) is not None, timeout):
                raise RuntimeError(f"no region of {nbytes} bytes freed within {timeout:.0f} s: the states "
                                   f"handed out are not being released (is the writer stuck?)")
            index = self._fit(nbytes)
            offset, size = self._free[index]
            if size == nbytes:
                del self._free[index]
            else:
                self._free[index] = (offset + nbytes, size - nbytes)
            self._reserved[offset] = nbytes
            # no rows stored yet, none taken from a cache, none stored again
            struct.pack_into("<qqqqq", self.mapping, offset, 0, 0, 0, 0, UNREWRITTEN)
            return offset

    def release(self, offset: int) -> None:
        with self._room:
            self._free.append((offset, self._reserved.pop(offset)))
            self._free.sort()
            merged = [self._free[0]]
            for start, size in self._free[1:]:
                last_start, last_size = merged[-1]
                if last_start + last_size == start:
                    merged[-1] = (last_start, last_size + size)
                else:
                    merged.append((start, size))
            self._free = merged
            self._room.notify_all()

    def _fit(self, nbytes: int) -> int | None:
        return next((i for i, (_, size) in enumerate(self._free) if size >= nbytes), None)

    def rows_stored(self, offset: int, expected: int, timeout: float) -> int:
        """The row count a worker wrote into the region at ``offset``, once it is at least ``expected``
        or ``timeout`` seconds have passed (a GPU worker writes it when the copies have landed, which
        may be a moment after the engine reports the request finished)."""
        deadline = time.monotonic() + timeout
        while (stored := struct.unpack_from("<q", self.mapping, offset)[0]) < expected and time.monotonic() < deadline:
            time.sleep(0.0005)
        return stored

    def first_row(self, offset: int) -> int:
        """The first prompt position the worker stored a row at in the region at ``offset`` (read once
        its rows are all stored)."""
        return struct.unpack_from("<q", self.mapping, offset + FIRST_ROW)[0]

    def rewritten_from(self, offset: int) -> int:
        """The lowest position of the region at ``offset`` stored at again after it was counted
        (``UNREWRITTEN``: none)."""
        return struct.unpack_from("<q", self.mapping, offset + REWRITTEN)[0]

    def view(self, offset: int, dtype, count: int, on_free=None):
        """``count`` items of ``dtype`` at ``offset``, as a tensor over the mapping (no copy);
        ``on_free`` is called once no tensor over these bytes is left (this one, and every view made
        of it: a row cut from a layer, a layer reshaped).

        Through a ``memoryview``: ``torch.frombuffer`` on the mapping itself does not hold it
        exported, so ``close`` would unmap it under a live tensor (reads and writes through it then
        hit unmapped or reused memory: a segfault, or another allocation's bytes). The memoryview
        each tensor keeps makes ``close`` leave the mapping to the last tensor instead.

        ``on_free`` watches the bytes' owner, not the tensor returned: a tensor's Python object dies
        while views made of it live on (``layer[:n]`` in the writer's queue), and a region released
        then is reserved again and overwritten under them. A numpy array owns the bytes here: the
        tensor's storage holds it until the last view of it is gone, and it can be watched."""
        import torch

        window = memoryview(self.mapping)[offset:offset + count * dtype.itemsize]
        if on_free is None:
            return torch.frombuffer(window, dtype=dtype)
        import numpy

        owner = numpy.frombuffer(window, dtype=numpy.uint8)
        weakref.finalize(owner, on_free)
        return torch.from_numpy(owner).view(dtype)

    def unlink(self) -> None:
        if os.path.exists(self.path):
            os.unlink(self.path)

    def close(self) -> None:
        try:
            self.mapping.close()
        except BufferError:  # states still held (views): unmapped when the last of them is gone
            pass
        self.unlink()
