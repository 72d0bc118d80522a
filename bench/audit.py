#!/usr/bin/env python3
"""How long `vllm-compat audit` takes: the installed vLLM (static and live) and wheels (static).

    .cache/venvs/vllm-0.17.0/bin/python bench/audit.py [--consumer-source DIR] [WHEEL ...]

Each row is the median of 3 runs of the CLI in a fresh process (what a user waits for: interpreter
start, import of vllm_compat, reading vLLM's files), on this machine. Targets: under 3 s for the
installed vLLM, under 5 s for a wheel, with the call-site checks on (``--consumer-source DIR``:
the speculators whose ``data_generation`` modules are read; the adapters' call sites are always read).
"""
import statistics
import subprocess
import sys
import time
from pathlib import Path


def timed(args: list[str]) -> tuple[float, int]:
    runs, code = [], 0
    for _ in range(3):
        started = time.perf_counter()
        code = subprocess.run([sys.executable, "-m", "vllm_compat", "audit", *args],
                              capture_output=True).returncode
        runs.append(time.perf_counter() - started)
    return statistics.median(runs), code


def main() -> int:
    args = sys.argv[1:]
    consumer: list[str] = []
    if args[:1] == ["--consumer-source"]:
        consumer, args = args[:2], args[2:]
    sites = f", call sites of {Path(consumer[1]).name} + adapters" if consumer else ", call sites of the adapters"
    rows = [(f"installed vLLM, static (default){sites}", consumer, 3.0),
            ("installed vLLM, --live (imports vLLM)", ["--live", *consumer], None)]
    rows += [(f"wheel {Path(w).name}{sites}", ["--vllm", w, *consumer], 5.0) for w in args]
    print("| audit of | seconds (median of 3) | exit code | target |\n|---|---|---|---|")
    for label, args, target in rows:
        seconds, code = timed(args)
        verdict = "-" if target is None else (f"< {target:.0f} s: {'met' if seconds < target else 'MISSED'}")
        print(f"| {label} | {seconds:.2f} | {code} | {verdict} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
