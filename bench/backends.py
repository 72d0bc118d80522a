#!/usr/bin/env python3
"""The two extractor backends side by side, on whatever this machine has (CPU: the tiny model).

    PYTHONPATH=.cache/speculators/0.3.0 .cache/venvs/vllm-0.32.0/bin/python bench/backends.py \\
        [--model .cache/models/llama] [--samples 64] [--length 512] [--batch 16]

Runs `bench/gpu.py extract` once per backend (the extractor CLI end to end: model load excluded,
files written) and prints a table.
"""
import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=str(ROOT / ".cache" / "models" / "llama"))
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--gpu-memory-utilization", default="0.02")
    args = parser.parse_args()
    print("| backend | tokens | seconds | tokens/s | model load s |\n|---|---|---|---|---|")
    for backend in ("speculators", "vllm-native"):
        proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu.py"), "extract", "--backend", backend,
                               "--model", args.model, "--samples", str(args.samples), "--length", str(args.length),
                               "--batch", str(args.batch), "--gpu-memory-utilization", args.gpu_memory_utilization,
                               "--work", f"/tmp/bench-backends-{backend}"],
                              capture_output=True, text=True, env={**os.environ, "OUT": ""})
        line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
        result = json.loads(line[7:]) if line else {"error": proc.stderr[-500:]}
        if "error" in result:
            print(f"| {backend} | failed: {result['error'][-200:]!r} | | | |")
        else:
            print(f"| {backend} | {result['tokens']:,} | {result['seconds']} | {result['tokens_per_s']:,} | "
                  f"{result['load_seconds']} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
