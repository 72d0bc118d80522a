#!/usr/bin/env python3
"""The two extractor backends side by side, on whatever this machine has (CPU: the tiny model).

    PYTHONPATH=.cache/speculators/0.3.0 .cache/venvs/vllm-0.32.0/bin/python bench/backends.py \\
        [--model .cache/models/llama] [--samples 64] [--length 512] [--batch 16]

Runs `bench/gpu.py extract` once per backend (the extractor CLI end to end: model load excluded,
files written) and prints a table.
"""
import argparse
import sys

from extract_workload import add_arguments, run_extract


def main() -> int:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args()
    print("| backend | tokens | seconds | tokens/s | model load s |\n|---|---|---|---|---|")
    for backend in ("speculators", "vllm-native"):
        result = run_extract(args, backend, f"/tmp/bench-backends-{backend}")
        if "error" in result:
            print(f"| {backend} | failed: {result['error'][-200:]!r} | | | |")
        else:
            print(f"| {backend} | {result['tokens']:,} | {result['seconds']} | {result['tokens_per_s']:,} | "
                  f"{result['load_seconds']} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
