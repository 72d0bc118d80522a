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

Under vLLM's pipeline parallelism each stage's worker stores the layers it runs (at their slots of
the run's layers) into the same region, and keeps counters and token ids of its own: a region then
starts with one 64-byte header per capturing stage (``stages`` of them, in stage order: block ``k``
at ``k * HEADER``), then one token-id array per capturing stage, then the scales and the layers as
above. A request's rows are stored once every stage counted them (the least count), the stages must
agree on the first row they stored, and each stage's ids are checked. With one stage the layout is
the one described above, byte for byte.
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


def ids_start(length: int, stage: int = 0, stages: int = 1) -> int:
    """Where capturing stage ``stage``'s token ids of a ``length``-token region start (of ``stages``)."""
    return HEADER * stages + _per_row(length) * stage


def scales_start(length: int, stages: int = 1) -> int:
    """Where a ``length``-token region's row scales start (FP8 states), after the token ids."""
    return ids_start(length, stages, stages)


def layer_start(length: int, index: int, row_bytes: int, scales: bool = False, stages: int = 1) -> int:
    """Where layer ``index`` of a ``length``-token region starts, from the region's start (after the
    headers, the token ids and, with ``scales``, the row scales, padded to a whole row)."""
    before = HEADER * stages + _per_row(length) * (stages + (1 if scales else 0))
    return -(-before // row_bytes) * row_bytes + index * length * row_bytes


def region_bytes(length: int, layers: int, row_bytes: int, scales: bool = False, stages: int = 1) -> int:
    return layer_start(length, layers, row_bytes, scales, stages)


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
    bytes (and of 64). ``stages``: the pipeline stage of each counter block (one per capturing
    stage, in order; ``(0,)`` without pipeline parallelism). ``nonce``: written in the file's first
    bytes (the regions start after them, at ``base``), which a worker that opens the file checks: it
    maps this run's pool, not another file of that name (another host's ``/dev/shm``)."""

    def __init__(self, capacity: int, align: int = ALIGN, stages: tuple[int, ...] = (0,), nonce: bytes = b""):
        self.capacity, self.align = capacity, math.lcm(ALIGN, align)
        self.stages = tuple(stages)
        self.base = -(-len(nonce) // self.align) * self.align
        self.failure: str | None = None  # set by ``fail``: every wait for rows raises it
        fd, self.path = tempfile.mkstemp(prefix="hidden-states-regions-", dir=regions_root(capacity + self.base))
        try:
            os.ftruncate(fd, capacity + self.base)
            self.mapping = mmap.mmap(fd, capacity + self.base)
        finally:
            os.close(fd)
        self.mapping[:len(nonce)] = nonce
        self._free = [(self.base, capacity)]  # (offset, size), sorted by offset
        self._reserved: dict[int, int] = {}  # offset -> size of each region handed out
        self._room = threading.Condition()
        # the time ``reserve`` spent waiting for room, and how often it waited: where the extraction
        # could not submit because the states handed out were not released yet
        self.waited_s, self.waits = 0.0, 0

    def reserve(self, nbytes: int, timeout: float) -> int:
        nbytes = -(-nbytes // self.align) * self.align
        if nbytes > self.capacity:
            raise ExtractError(f"a sequence needs {nbytes} bytes of states, the region pool holds {self.capacity}")
        with self._room:
            index = self._fit(nbytes)
            if index is None:
                started = time.monotonic()
                waited = self._room.wait_for(lambda: self._fit(nbytes) is not None, timeout)
                self.waited_s += time.monotonic() - started
                self.waits += 1
                if not waited:
                    raise RuntimeError(f"no region of {nbytes} bytes freed within {timeout:.0f} s: the states "
                                       f"handed out are not being released (is the writer stuck?)")
                index = self._fit(nbytes)
            offset, size = self._free[index]
            if size == nbytes:
                del self._free[index]
            else:
                self._free[index] = (offset + nbytes, size - nbytes)
            self._reserved[offset] = nbytes
            # no rows stored yet, none taken from a cache, none stored again: in every stage's block
            for block in range(len(self.stages)):
                struct.pack_into("<qqqqq", self.mapping, offset + block * HEADER, 0, 0, 0, 0, UNREWRITTEN)
            return offset

    def waited(self) -> str:
        """What ``reserve``'s waits for room came to, as a line ends."""
        return (f"waited {self.waited_s:.2f} s in all ({self.waits} times) for room in the states' pool of "
                f"{self.capacity / 2**20:.0f} MiB, until the rows handed out were released")

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

    def reserved_size(self, offset: int) -> int | None:
        """The size of the region reserved at ``offset`` (None: none is)."""
        with self._room:
            return self._reserved.get(offset)

    def fail(self, why: str) -> None:
        """A stage can no longer store rows (``region_sink``): every wait for rows, now or later, raises ``why``."""
        if self.failure is None:
            self.failure = why

    def _fit(self, nbytes: int) -> int | None:
        return next((i for i, (_, size) in enumerate(self._free) if size >= nbytes), None)

    def _counts(self, at: int) -> list[int]:
        """The int64 at ``at`` (a place in a counter block) in every stage's block."""
        return [struct.unpack_from("<q", self.mapping, at + block * HEADER)[0] for block in range(len(self.stages))]

    def rows_stored(self, offset: int, expected: int, timeout: float) -> int:
        """The row count the workers wrote into the region at ``offset`` (the least over the capturing
        stages: a row is stored once every stage stored its layers), once it is at least ``expected``
        or ``timeout`` seconds have passed (a GPU worker writes it when the copies have landed, which
        may be a moment after the engine reports the request finished)."""
        deadline = time.monotonic() + timeout
        while (stored := min(self._counts(offset))) < expected and time.monotonic() < deadline:
            if self.failure is not None:
                raise RuntimeError(self.failure)
            time.sleep(0.0005)
        return stored

    def first_row(self, offset: int, settled: bool = True) -> int:
        """The first prompt position the workers stored a row at in the region at ``offset`` (read once
        its rows are all stored: every stage must have stored from the same one). ``settled`` False:
        while rows are still being stored, the highest any stage stored from so far (a stage that has
        not stored yet reads 0)."""
        firsts = self._counts(offset + FIRST_ROW)
        if not settled or len(set(firsts)) == 1:
            return max(firsts)
        said = ", ".join(f"stage {stage}: {first}" for stage, first in zip(self.stages, firsts))
        raise RuntimeError(f"the pipeline stages disagree on the first stored row of a region ({said})")

    def rewritten_from(self, offset: int) -> int:
        """The lowest position of the region at ``offset`` stored at again after it was counted, by any
        stage (``UNREWRITTEN``: none)."""
        return min(self._counts(offset + REWRITTEN))

    def ids_disagree(self, offset: int, length: int, ids: list[int]) -> str | None:
        """None if every stage's stored token ids of the ``length``-token region at ``offset`` are
        ``ids`` (its first ``len(ids)`` rows), else what disagrees: the stage, from which token on."""
        import torch

        for block, stage in enumerate(self.stages):
            stored = self.view(offset + ids_start(length, block, len(self.stages)), torch.int32, len(ids)).tolist()
            if stored != ids:
                wrong = next(i for i, (a, b) in enumerate(zip(stored, ids)) if a != b)
                where = f" by pipeline stage {stage}" if len(self.stages) > 1 else ""
                return f"from token {wrong} of {len(ids)} on, stored{where}"
        return None

    def copy_rows(self, into: int, into_length: int, source: int, source_length: int, rows: int, row_bytes: int,
                  layers: int, scales: bool) -> None:
        """Copy the first ``rows`` rows (every stage's token ids, FP8 scales, every layer of
        ``row_bytes`` a row) of the region at ``source`` (laid out for ``source_length`` rows) into the
        region at ``into`` (``into_length`` rows)."""
        import torch

        blocks = len(self.stages)
        for block in range(blocks):
            self.view(into + ids_start(into_length, block, blocks), torch.int32, rows).copy_(
                self.view(source + ids_start(source_length, block, blocks), torch.int32, rows))
        if scales:  # a token's FP8 scale is its own rows' (over its layers): the source's is its
            self.view(into + scales_start(into_length, blocks), torch.float32, rows).copy_(
                self.view(source + scales_start(source_length, blocks), torch.float32, rows))
        size = rows * row_bytes
        for index in range(layers):
            self.view(into + layer_start(into_length, index, row_bytes, scales, blocks), torch.uint8, size).copy_(
                self.view(source + layer_start(source_length, index, row_bytes, scales, blocks), torch.uint8, size))

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


class Countdown:
    """Calls ``action(*args)`` on its ``count``-th call (a region's last layer tensor gone)."""

    def __init__(self, count: int, action, *args):
        self._left, self._action, self._args = count, action, args
        self._lock = threading.Lock()

    def __call__(self) -> None:
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            self._action(*self._args)
