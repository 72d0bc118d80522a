#!/usr/bin/env python3
"""How long `vllm-compat audit` takes: the installed vLLM (static and live) and wheels (static).

    .cache/venvs/vllm-0.17.0/bin/python bench/audit.py [WHEEL ...]

Each row is the median of 3 runs of the CLI in a fresh process (what a user waits for: interpreter
start, import of vllm_compat, reading vLLM's files), on this machine. Targets: under 3 s for the
installed vLLM, under 5 s for a wheel.
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
    rows = [("installed vLLM, static (default)", [], 3.0), ("installed vLLM, --live (imports vLLM)", ["--live"], None)]
    rows += [(f"wheel {Path(w).name}", ["--vllm", w], 5.0) for w in sys.argv[1:]]
    print("| audit of | seconds (median of 3) | exit code | target |\n|---|---|---|---|")
    for label, args, target in rows:
        seconds, code = timed(args)
        verdict = "-" if target is None else (f"< {target:.0f} s: {'met' if seconds < target else 'MISSED'}")
        print(f"| {label} | {seconds:.2f} | {code} | {verdict} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
