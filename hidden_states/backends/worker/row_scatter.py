"""A step's rows of many requests moved to their regions at once (the worker side of ``vllm-engine``).

A decode step gives each running request one row; a copy per request and layer (and one for its
token id) costs more in launches and Python than the step's forward itself once a few hundred
requests decode together. Rows of requests with at most :data:`GATHER_ROWS` rows in a step are
instead gathered into one page-locked staging tensor per kind (layers, token ids, FP8 scales): on a
GPU a slice of each layer where they are the forward's first rows (a step of decoding requests),
else picked out with ``index_select``, on the copies' stream. Then, on the thread that waits for the
step's copies, they are placed with one indexed copy per kind into the region file seen as rows
(``regions``: every stored row is a whole row of that view). Requests with longer runs of rows
(prompt chunks) keep their direct copies: straight into the region, no copy through the CPU.
"""
from __future__ import annotations

from ..shared.regions import ids_start, layer_start, scales_start

GATHER_ROWS = 32  # rows of one request in one step at most, for the gathered path


class GatheredRows:
    """Where a step's gathered rows come from (rows of the forward) and go (rows of the region file).
    Each request adds five numbers; the indices are worked out for all of them at once, the
    destinations off the step's path (a decode step adds hundreds of requests: nothing per request
    may cost more than an append).

    Args:
        layers: layers captured.
        row_bytes: bytes of one stored row of one layer.
        scales: FP8 states, with one scale per row.
        slots: each captured layer's slot among the run's layers (None: its index).
        block, blocks: this pipeline stage's token-id array, of the regions' ``blocks``.
    """

    def __init__(self, layers: int, row_bytes: int, scales: bool, slots: list[int] | None = None, block: int = 0,
                 blocks: int = 1):
        self.layers, self.row_bytes, self.scales = layers, row_bytes, scales
        self.slots = list(range(layers)) if slots is None else slots
        self.block, self.blocks = block, blocks
        # per request: its first row in the forward, its rows, its region (offset, length), its first position
        self.first_rows: list[int] = []
        self.takes: list[int] = []
        self.offsets: list[int] = []
        self.lengths: list[int] = []
        self.starts: list[int] = []

    def __bool__(self) -> bool:
        return bool(self.takes)

    def add(self, row: int, take: int, offset: int, length: int, start: int) -> None:
        """Rows ``row .. row + take`` of the forward go to positions ``start ..`` of the
        ``length``-token region at ``offset``."""
        self.first_rows.append(row)
        self.takes.append(take)
        self.offsets.append(offset)
        self.lengths.append(length)
        self.starts.append(start)

    def _one_row_each(self) -> bool:
        """Every request has one row in the step (decoding): nothing to repeat per row."""
        return len(self.takes) == sum(self.takes)

    def leading_rows(self) -> int | None:
        """How many rows there are where they are the forward's first rows in order (a step of
        decoding requests alone: each layer's slice, no gather), else None."""
        total = sum(self.takes)  # rows of the forward below the last one's end, as many as there are below it
        return total if self.first_rows[-1] + self.takes[-1] == total else None

    def _for_each_row(self, values: list[int]):
        """Each gathered row's value of its request (``values``: one per request)."""
        import torch

        if self._one_row_each():
            return torch.tensor(values)
        return torch.tensor(values).repeat_interleave(torch.tensor(self.takes))

    def _into_request(self):
        """Each gathered row's place among its request's rows of the step (0 where each has one)."""
        import torch

        if self._one_row_each():
            return 0
        takes = torch.tensor(self.takes)
        ends = takes.cumsum(0)
        return torch.arange(int(ends[-1])) - (ends - takes).repeat_interleave(takes)

    def _destinations(self):
        """(each row's token id as an int32 index of the file, its scale as a float32 index, per layer
        its rows as rows of the file's ``[rows, row_bytes]`` view)."""
        offsets, lengths = self._for_each_row(self.offsets), self._for_each_row(self.lengths)
        positions = self._for_each_row(self.starts) + self._into_request()
        ids_at = (offsets + ids_start(lengths, self.block, self.blocks)) // 4 + positions
        scales_at = (offsets + scales_start(lengths, self.blocks)) // 4 + positions if self.scales else None
        layers_at = []
        for index in range(self.layers):
            first = offsets + layer_start(lengths, self.slots[index], self.row_bytes, self.scales, self.blocks)
            misaligned = first % self.row_bytes
            if bool(misaligned.any()):
                offset = int(offsets[misaligned.nonzero()[0, 0]])
                raise RuntimeError(f"hidden-states vllm-engine capture: the region at {offset} does not start its "
                                   f"layers on a whole row of {self.row_bytes} bytes (the regions' layout differs "
                                   f"between the parent and this worker?)")
            layers_at.append(first // self.row_bytes + positions)
        return ids_at, scales_at, layers_at

    def stage(self, layers, input_ids, scales, stream):
        """Take the rows out of the step's tensors and start their copy to the host: on a GPU, the
        token ids on the compute stream (the runner rewrites their buffer in the next step), the
        rest on ``stream``, which the copies run on; on the host (``stream`` None) nothing is left
        to wait for. Returns what :meth:`place` needs: [layers, ids] (+ [scales]), the layers a list on the host,
        one stacked tensor from a GPU."""
        import torch

        leading = self.leading_rows()
        if leading is not None:
            def take(tensor):
                return tensor[:leading]
        else:
            rows = self._for_each_row(self.first_rows) + self._into_request()
            if stream is not None:  # the indices travel without a sync: page-locked
                rows = rows.pin_memory().to(layers[0].device, non_blocking=True)

            def take(tensor):
                return tensor.index_select(0, rows)
        if stream is None:  # each layer's rows placed from where they are: no stacked copy on the host
            return [[take(layer) for layer in layers], take(input_ids).to(torch.int32)] + \
                ([take(scales)] if self.scales else [])
        ids = take(input_ids).to(torch.int32, copy=True)  # a copy: a slice of the runner's buffer is rewritten
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            ids.record_stream(stream)
            if leading is None:
                rows.record_stream(stream)
            picked = [torch.stack([take(layer) for layer in layers]), ids] + ([take(scales)] if self.scales else [])
            staged = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in picked]
            for host, source in zip(staged, picked):
                host.copy_(source, non_blocking=True)
        return staged

    def place(self, host, staged) -> None:
        """Put the staged rows into the region file (``host``: the whole file, uint8), once they are
        on the host."""
        import torch

        ids_at, scales_at, layers_at = self._destinations()
        layers, ids = staged[0], staged[1]
        wide = torch.int64 if self.row_bytes % 8 == 0 else torch.uint8  # fewer, wider items copy faster
        file_rows = host[:host.numel() // self.row_bytes * self.row_bytes].view(wide).view(
            -1, self.row_bytes // wide.itemsize)
        for at, layer in zip(layers_at, layers, strict=True):  # ``layers``: a list on the host, stacked from a GPU
            file_rows.index_copy_(0, at, layer.contiguous().view(torch.uint8).view(-1, self.row_bytes).view(wide))
        host[:host.numel() // 4 * 4].view(torch.int32).index_copy_(0, ids_at, ids)
        if self.scales:
            host[:host.numel() // 4 * 4].view(torch.float32).index_copy_(0, scales_at, staged[2].float())
