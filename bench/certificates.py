#!/usr/bin/env python3
"""What certificates cost: ``extract --backend vllm-engine`` with and without them, on the same rows,
alternating (off, on, off, on, ...), ``--repeats`` runs each, one process per run (``bench/gpu.py
extract``: the CLI end to end, the model load excluded from the rate). ``--with-prefill`` puts vLLM's
eager prefill of the same rows (``bench/gpu.py prefill``) before each pair, so that one call also
measures extract's ratio to vLLM's own path. Prints a table and appends a record (every run, and its
``provenance``: bench/provenance.py) to ``--out``.

    .cache/venvs/vllm-0.32.0/bin/python bench/certificates.py [--model .cache/models/llama] \\
        [--samples 64] [--length 512] [--batch 16] [--repeats 3] [--with-prefill] [--out bench/results/...jsonl]
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

from extract_workload import add_arguments, run_extract, run_prefill
from provenance import provenance


def run(args, certificates: bool) -> dict:
    result = run_extract(args, "vllm-engine", "/tmp/bench-certificates", *([] if certificates else ["--no-certificates"]))
    if "error" in result:
        raise SystemExit(f"bench/certificates.py: a run failed: {result['error'][-1500:]}")
    return {"side": "on" if certificates else "off", "certificates": certificates,
            "tokens_per_s": result["tokens_per_s"], "seconds": result["seconds"], "tokens": result["tokens"],
            "said": result.get("certificates")}


def prefill(args) -> dict:
    result = run_prefill(args)
    if "error" in result:
        raise SystemExit(f"bench/certificates.py: vLLM's prefill failed: {result['error'][-1500:]}")
    return {"side": "prefill", "tokens_per_s": result["tokens_per_s"], "seconds": result["seconds"],
            "tokens": result["tokens"], "load_seconds": result.get("load_seconds")}


def table(record: dict) -> str:
    """The medians (and ranges) per side, the certificates' overhead and, with the prefill, extract's
    ratio to it; the figures go into ``record`` too."""
    runs = {side: sorted(r["tokens_per_s"] for r in record["runs"] if r["side"] == side)
            for side in ("prefill", "off", "on")}
    rate = {side: statistics.median(values) for side, values in runs.items() if values}
    record["median_tokens_per_s"] = rate
    record["overhead_percent"] = round(100 * (1 - rate["on"] / rate["off"]), 1)
    lines = ["| run | runs | median tokens/s | range |", "|---|---|---|---|"]
    names = {"prefill": "vLLM's eager prefill", "off": "extract, certificates off", "on": "extract, certificates on"}
    lines += [f"| {names[side]} | {len(runs[side])} | {rate[side]:,.0f} | {runs[side][0]:,.0f}-{runs[side][-1]:,.0f} |"
              for side in rate]
    lines.append(f"overhead: {record['overhead_percent']} %")
    if "prefill" in rate:
        record["extract_vs_prefill"] = {side: round(rate[side] / rate["prefill"], 3) for side in ("off", "on")}
        lines.append(f"extract / vLLM's eager prefill: {record['extract_vs_prefill']['off']}x certificates off, "
                     f"{record['extract_vs_prefill']['on']}x on")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--with-prefill", action="store_true",
                        help="vLLM's eager prefill of the same rows before each off/on pair")
    parser.add_argument("--out", help="append the record to this JSONL file")
    args = parser.parse_args()
    record = {"bench": "certificates", "model": Path(args.model).name, "samples": args.samples,
              "length": args.length, "batch": args.batch, "runs": [],
              "provenance": provenance({**vars(args), "backend": "vllm-engine"})}
    for _ in range(args.repeats):
        for side in (["prefill"] if args.with_prefill else []) + ["off", "on"]:
            record["runs"].append(prefill(args) if side == "prefill" else run(args, side == "on"))
            print(json.dumps(record["runs"][-1]), flush=True)
    print(table(record))
    if args.out:
        with open(args.out, "a") as handle:
            handle.write(json.dumps(record) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
