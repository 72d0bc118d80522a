"""What ``generate``'s copying thread (``hidden_states/backends/reply_streams.py``) costs: rounds of
``--replies`` regions each gaining ``--rows`` rows (``--layers`` x ``--hidden`` bf16) copied to their
files, the milliseconds and CPU a round takes, then the main thread's Python while rounds run back
to back, as a share of its speed alone (the copies hold the GIL only between torch calls).

    python bench/reply_streams.py [--replies 256] [--rows 12] [--hidden 4096] [--layers 4] [--rounds 20]
"""
from __future__ import annotations

import argparse
import struct
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def spin(seconds: float) -> int:
    """Python loop iterations in ``seconds``."""
    count, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        count += 1
    return count


def main(argv=None) -> int:
    import torch

    from hidden_states.backends.shared.regions import RegionPool, layer_start, region_bytes
    from hidden_states.backends.reply_streams import ReplyStreams
    from hidden_states.output.formats.speculators_05 import StreamedFile

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replies", type=int, default=256)
    parser.add_argument("--rows", type=int, default=12, help="rows a reply gains per round (0.25 s of decode at 48 steps/s)")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # the driver process's share: one thread copies
    row_bytes = args.hidden * 2
    capacity = args.rows * (2 * args.rounds + 2)
    size = region_bytes(capacity, args.layers, row_bytes)
    pool = RegionPool(args.replies * size, align=row_bytes)
    try:
        offsets = [pool.reserve(size, timeout=10) for _ in range(args.replies)]

        def read(offset, length, start, stop):
            span = (stop - start) * row_bytes
            return torch.stack([pool.view(offset + layer_start(length, i, row_bytes) + start * row_bytes, torch.uint8,
                                          span).view(-1, row_bytes) for i in range(args.layers)], dim=1)

        streams = ReplyStreams(lambda offset: (pool.rows_stored(offset, 0, timeout=0), 0), read, interval=3600)
        with tempfile.TemporaryDirectory() as folder:
            for index, offset in enumerate(offsets):
                streams.follow(offset, capacity, StreamedFile(Path(folder) / f"hs_{index}"))
            counted = 0

            def one_round() -> None:
                nonlocal counted
                counted += args.rows
                for offset in offsets:
                    struct.pack_into("<q", pool.mapping, offset, counted)
                streams.copy_round()

            wall = cpu = 0.0
            for _ in range(args.rounds):
                started, used = time.perf_counter(), time.process_time()
                one_round()
                wall, cpu = wall + time.perf_counter() - started, cpu + time.process_time() - used
            megabytes = args.replies * args.rows * args.layers * row_bytes / 1e6
            print(f"a round of {args.replies} replies x {args.rows} rows ({megabytes:.0f} MB): "
                  f"{wall / args.rounds * 1000:.1f} ms, {cpu / args.rounds * 1000:.1f} ms of CPU")
            alone = spin(1.0)
            done = threading.Event()

            def rounds() -> None:
                while not done.is_set() and counted + args.rows <= capacity:
                    one_round()

            thread = threading.Thread(target=rounds)
            thread.start()
            beside = spin(1.0)
            done.set()
            thread.join()
            print(f"the main thread's Python beside rounds back to back: {beside / alone:.2f} of its speed alone")
            streams.close()
    finally:
        pool.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
