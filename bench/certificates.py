#!/usr/bin/env python3
"""What certificates cost: ``extract --backend vllm-engine`` with and without them, on the same rows,
alternating (off, on, off, on, ...), ``--repeats`` runs each, one process per run (``bench/gpu.py
extract``: the CLI end to end, the model load excluded from the rate). Prints a table and appends a
record (every run, and its ``provenance``: bench/provenance.py) to ``--out``.

    .cache/venvs/vllm-0.32.0/bin/python bench/certificates.py [--model .cache/models/llama] \\
        [--samples 64] [--length 512] [--batch 16] [--repeats 3] [--out bench/results/...jsonl]
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

from extract_workload import add_arguments, run_extract
from provenance import provenance


def run(args, certificates: bool) -> dict:
    result = run_extract(args, "vllm-engine", "/tmp/bench-certificates", *([] if certificates else ["--no-certificates"]))
    if "error" in result:
        raise SystemExit(f"bench/certificates.py: a run failed: {result['error'][-1500:]}")
    return {"certificates": certificates, "tokens_per_s": result["tokens_per_s"], "seconds": result["seconds"],
            "tokens": result["tokens"], "said": result.get("certificates")}


def main() -> int:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", help="append the record to this JSONL file")
    args = parser.parse_args()
    record = {"bench": "certificates", "model": Path(args.model).name, "samples": args.samples,
              "length": args.length, "batch": args.batch, "runs": [],
              "provenance": provenance({**vars(args), "backend": "vllm-engine"})}
    for _ in range(args.repeats):
        for certificates in (False, True):
            record["runs"].append(run(args, certificates))
            print(json.dumps(record["runs"][-1]), flush=True)
    rate = {flag: statistics.median(r["tokens_per_s"] for r in record["runs"] if r["certificates"] is flag)
            for flag in (False, True)}
    record["median_tokens_per_s"] = {"off": rate[False], "on": rate[True]}
    record["overhead_percent"] = round(100 * (1 - rate[True] / rate[False]), 1)
    print(f"| certificates | runs | median tokens/s |\n|---|---|---|\n| off | {args.repeats} | {rate[False]:,.0f} |\n"
          f"| on | {args.repeats} | {rate[True]:,.0f} |\noverhead: {record['overhead_percent']} %")
    if args.out:
        with open(args.out, "a") as handle:
            handle.write(json.dumps(record) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
