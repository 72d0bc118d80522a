#!/usr/bin/env python3
"""What an extraction's first engine step costs on vLLM's CPU backend with vLLM's sampler compiled and
without (the extractor's default there: ``TORCHDYNAMO_DISABLE=1``, docs/cpu-vllm.md, "Running",
the sampler's two compiled helpers): ``extract --backend vllm-engine`` on the same small workload, alternating
(compiled, default, compiled, ...), ``--repeats`` runs each, one process per run; the wall-clock
seconds of each whole run, the model load included, since that is where the compile is paid. Prints
a table and appends a record (every run, and its ``provenance``: bench/provenance.py) to ``--out``.

    .cache/venvs/vllm-0.17.0/bin/python bench/engine_start.py [--samples 16] [--length 128] [--repeats 3] \\
        [--out bench/results/...jsonl]
"""
import argparse
import json
import os
import statistics
import time
from pathlib import Path

from extract_workload import add_arguments, run_extract
from provenance import provenance

SIDES = {"compiled": "0", "default": None}  # TORCHDYNAMO_DISABLE: "0" keeps vLLM's compile; unset, the extractor's choice


def run(args, side: str) -> dict:
    value = SIDES[side]
    if value is None:
        os.environ.pop("TORCHDYNAMO_DISABLE", None)
    else:
        os.environ["TORCHDYNAMO_DISABLE"] = value
    started = time.monotonic()
    result = run_extract(args, "vllm-engine", "/tmp/bench-engine-start")
    wall = time.monotonic() - started
    if "error" in result:
        raise SystemExit(f"bench/engine_start.py: a run failed: {result['error'][-1500:]}")
    return {"side": side, "wall_s": round(wall, 2), "tokens_per_s": result["tokens_per_s"],
            "certificates": result.get("certificates")}


def main() -> int:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    parser.set_defaults(samples=16, length=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    runs = [run(args, side) for _ in range(args.repeats) for side in SIDES]
    lines = ["| side | wall-clock s, each run | median |", "|---|---|---|"]
    medians = {}
    for side in SIDES:
        walls = [r["wall_s"] for r in runs if r["side"] == side]
        medians[side] = statistics.median(walls)
        lines.append(f"| {side} | {' · '.join(f'{w:.1f}' for w in walls)} | {medians[side]:.1f} |")
    lines.append(f"default / compiled: {medians['default'] / medians['compiled']:.3f}x of the wall-clock time")
    print("\n".join(lines))
    if args.out:
        record = {"bench": "engine_start", "model": args.model, "samples": args.samples, "length": args.length,
                  "batch": args.batch, "runs": runs, "median_wall_s": medians,
                  "provenance": provenance({"backend": "vllm-engine", "batch": args.batch})}
        with args.out.open("a") as out:
            out.write(json.dumps(record) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
