"""What one served row costs the writer: ``torch.save`` of a row that is the first rows of a longer
row's states, its layers cloned first (before) or put on their slice of the longer row's storage
(``own_storage``, now). CPU only; files into a RAM folder, so the disk is not what is timed.

    python bench/served_row_save.py [--tokens 2048] [--longer 8192] [--hidden 4096] [--layers 4] [--dir /dev/shm]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv=None) -> int:
    import torch

    from hidden_states.output.formats.speculators_03 import Speculators03, own_storage

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--longer", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dir", default="/dev/shm")
    args = parser.parse_args(argv)
    longer = [torch.randn(args.longer, args.hidden).to(torch.bfloat16) for _ in range(args.layers)]
    served = [layer[:args.tokens] for layer in longer]
    ids = torch.zeros(args.tokens, dtype=torch.long)
    fmt = Speculators03(Path(args.dir), None)
    mb = args.tokens * args.hidden * 2 * args.layers / 1e6
    ways = {"clone, then save (before)": lambda: [layer.clone() for layer in served],
            "own_storage, then save (now)": lambda: [own_storage(layer) for layer in served]}
    for name, layers in ways.items():
        times = []
        for i in range(args.repeats):
            path = Path(args.dir) / f"served-row-{os.getpid()}-{i}.pt"
            began = time.perf_counter()
            with open(path, "wb") as handle:
                fmt.save({"input_ids": ids, "hidden_states": layers(), "loss_mask": ids}, handle)
            times.append(time.perf_counter() - began)
            path.unlink()
        median = statistics.median(times)
        print(f"{name}: {median * 1000:.1f} ms for {mb:.0f} MB ({mb / 1000 / median:.2f} GB/s), median of {args.repeats}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
