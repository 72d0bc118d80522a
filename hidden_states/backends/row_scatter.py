"""A step's rows of many requests moved to their regions at once (the worker side of ``vllm-engine``).

A decode step gives each running request one row; a copy per request and layer (and one for its
token id) costs more in launches and Python than the step's forward itself once a few hundred
requests decode together. Rows of requests with at most :data:`GATHER_ROWS` rows in a step are
instead gathered: on a GPU picked out of the step's layers on the copies' stream (``index_select``)
into one page-locked staging tensor per kind (layers, token ids, FP8 scales), which crosses to the
host in one copy each; then placed with one indexed copy per kind into the region file seen as rows
(``regions``: every stored row is a whole row of that view), on the thread that waits for the
step's copies. Requests with longer runs of rows (prompt chunks) keep their direct copies: straight
into the region, no copy through the CPU.
"""
from __future__ import annotations

from .regions import HEADER, layer_start, scales_start

GATHER_ROWS = 32  # rows of one request in one step at most, for the gathered path


class GatheredRows:
    """Where a step's gathered rows come from (rows of the forward) and go (rows of the region file).

    Args:
        layers: layers captured.
        row_bytes: bytes of one stored row of one layer.
        scales: FP8 states, with one scale per row.
    """

    def __init__(self, layers: int, row_bytes: int, scales: bool):
        self.row_bytes, self.scales = row_bytes, scales
        self.rows: list[int] = []  # the forward's rows, in the order they are gathered
        self.ids_at: list[int] = []  # each row's token id: its int32 index in the file
        self.scales_at: list[int] = []  # each row's scale: its float32 index in the file
        self.layers_at: list[list[int]] = [[] for _ in range(layers)]  # per layer: its row of the file's rows

    def __bool__(self) -> bool:
        return bool(self.rows)

    def add(self, row: int, take: int, offset: int, length: int, start: int) -> None:
        """Rows ``row .. row + take`` of the forward go to positions ``start ..`` of the
        ``length``-token region at ``offset``."""
        self.rows.extend(range(row, row + take))
        ids = (offset + HEADER) // 4 + start
        self.ids_at.extend(range(ids, ids + take))
        if self.scales:
            first = (offset + scales_start(length)) // 4 + start
            self.scales_at.extend(range(first, first + take))
        for index, at in enumerate(self.layers_at):
            first, misaligned = divmod(offset + layer_start(length, index, self.row_bytes, self.scales), self.row_bytes)
            if misaligned:
                raise RuntimeError(f"hidden-states vllm-engine capture: the region at {offset} does not start its "
                                   f"layers on a whole row of {self.row_bytes} bytes (the regions' layout differs "
                                   f"between the parent and this worker?)")
            at.extend(range(first + start, first + start + take))

    def stage(self, layers, input_ids, scales, stream):
        """Pick the rows out of the step's tensors and start their copy to the host: on a GPU, the
        token ids on the compute stream (the runner rewrites their buffer in the next step), the
        rest on ``stream``, which the copies run on; on the host (``stream`` None) nothing is left
        to wait for. Returns what :meth:`place` needs."""
        import torch

        rows = torch.tensor(self.rows, dtype=torch.int64)
        if stream is None:
            picked = [torch.stack([layer.index_select(0, rows) for layer in layers]),
                      input_ids.index_select(0, rows).to(torch.int32)]
            return picked + ([scales.index_select(0, rows)] if self.scales else [])
        rows = rows.pin_memory().to(layers[0].device, non_blocking=True)  # no sync: page-locked
        ids = input_ids.index_select(0, rows).to(torch.int32)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            rows.record_stream(stream)
            ids.record_stream(stream)
            picked = [torch.stack([layer.index_select(0, rows) for layer in layers]), ids]
            if self.scales:
                picked.append(scales.index_select(0, rows))
            staged = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in picked]
            for host, source in zip(staged, picked):
                host.copy_(source, non_blocking=True)
        return staged

    def place(self, host, staged) -> None:
        """Put the staged rows into the region file (``host``: the whole file, uint8), once they are
        on the host."""
        import torch

        layers, ids = staged[0], staged[1]
        wide = torch.int64 if self.row_bytes % 8 == 0 else torch.uint8  # fewer, wider items copy faster
        file_rows = host[:host.numel() // self.row_bytes * self.row_bytes].view(wide).view(
            -1, self.row_bytes // wide.itemsize)
        at = torch.tensor([i for layer in self.layers_at for i in layer], dtype=torch.int64)
        file_rows.index_copy_(0, at, layers.contiguous().view(torch.uint8).view(-1, self.row_bytes).view(wide))
        as_int32 = host[:host.numel() // 4 * 4].view(torch.int32)
        as_int32.index_copy_(0, torch.tensor(self.ids_at, dtype=torch.int64), ids)
        if self.scales:
            as_float = host[:host.numel() // 4 * 4].view(torch.float32)
            as_float.index_copy_(0, torch.tensor(self.scales_at, dtype=torch.int64), staged[2].float())
