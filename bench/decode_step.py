"""What the vllm-engine worker spends on one decode step's rows: ``_store_captured_states`` for a step
in which every running request feeds one token, on the host (CPU tensors, so the copies are memcpy
and the rest is the Python a GPU worker also runs), gathered (now) against one copy per request and
layer (``--direct``: the path before ``row_scatter``). Prints the mean milliseconds per step and the
Python calls per step.

    python bench/decode_step.py [--requests 256] [--hidden 4096] [--layers 4] [--steps 50] [--direct]
"""
from __future__ import annotations

import argparse
import cProfile
import importlib
import pstats
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv=None) -> int:
    import torch

    from hidden_states.backends.shared.regions import region_bytes

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--length", type=int, default=1536, help="each request's region, in tokens")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--direct", action="store_true", help="one copy per request and layer (no gathering)")
    args = parser.parse_args(argv)
    capture = importlib.import_module("hidden_states.backends.worker.engine_capture")
    if args.direct:
        capture.GATHER_ROWS = 0
    row_bytes = args.hidden * 2
    size = region_bytes(args.length, args.layers, row_bytes)
    order = [f"r{i}" for i in range(args.requests)]
    worker = object.__new__(capture.StreamingStates)
    worker._hidden_states_host = torch.zeros(args.requests * size, dtype=torch.uint8)
    worker._hidden_states_regions = {r: (i * size, args.length, 0) for i, r in enumerate(order)}
    worker._hidden_states_prompts, worker._hidden_states_first = {}, {}
    worker._hidden_states_copies = worker._hidden_states_done = None
    worker.model_runner = SimpleNamespace(input_batch=SimpleNamespace(req_ids=order))
    layers = [torch.randn(args.requests, args.hidden).to(torch.bfloat16) for _ in range(args.layers)]

    def step(position: int) -> None:
        worker._hidden_states_step = (dict.fromkeys(order, 1), dict.fromkeys(order, position))
        worker._hidden_states_input_ids = torch.arange(args.requests)
        worker._hidden_states_positions = torch.full((args.requests,), position)
        worker._store_captured_states(layers)

    for position in range(5):  # every page of the regions touched once
        step(position)
    started = time.perf_counter()
    for position in range(5, 5 + args.steps):
        step(position)
    per_step = (time.perf_counter() - started) / args.steps * 1000
    profile = cProfile.Profile()
    profile.enable()
    for position in range(5 + args.steps, 5 + 2 * args.steps):
        step(position)
    profile.disable()
    calls = pstats.Stats(profile).total_calls / args.steps
    print(f"{'direct' if args.direct else 'gathered'}: {args.requests} decoding requests, {args.layers} layers of "
          f"{args.hidden}: {per_step:.2f} ms a step, {calls:,.0f} Python calls a step")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
