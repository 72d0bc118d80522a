#!/usr/bin/env python3
"""Where a run's wall time goes, step by step on the GPU: vLLM's prefill alone against the
extractor, measured the same way.

    BENCH_STEPS_DIR=D1 PYTHONPATH=bench/timeline_hook:$PYTHONPATH python bench/gpu.py prefill ...
    BENCH_STEPS_DIR=D2 PYTHONPATH=bench/timeline_hook:$PYTHONPATH python bench/gpu.py extract --backend vllm-engine ...
    python bench/steps.py D1 D2        # a table, one column per run; RESULT lines as bench/gpu.py's

``bench/timeline_hook/step_events.py`` writes the steps (CUDA events, no synchronisation in the
timed steps) and the timed span (``generate()`` for the prefill, the extractor's own ``seconds``).
The wall of the span splits into: the GPU running steps (``execute_model`` to the end of
``sample_tokens``), the GPU idle between steps, before the first step, and after the last one (the
extractor's last files, vLLM's last output).
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu import SETTINGS, emit  # noqa: E402


def read_jsonl(paths) -> list[dict]:
    return [json.loads(line) for path in paths for line in path.read_text().splitlines() if line.strip()]


class Unreadable(ValueError):
    """A run with nothing to tabulate (it failed before its timed span, or ran no step in it)."""


def analyse(directory: Path) -> dict:
    parent = read_jsonl(sorted(directory.glob("parent-*.jsonl")))
    spans = [r for r in parent if "span" in r]
    if len(spans) != 1:
        raise Unreadable(f"{directory}: expected one timed span, found {len(spans)}")
    (start, end), tokens = spans[0]["span"], spans[0]["tokens"]
    steps = sorted((s for s in read_jsonl(sorted(directory.glob("steps-*.jsonl"))) if s["cpu_start"] >= start),
                   key=lambda s: s["gpu"]["start"])
    if not steps:
        raise Unreadable(f"{directory}: no step inside the timed span")

    def step_end(step):
        return step["gpu"].get("sampled", step["gpu"]["executed"])

    busy = sum(step_end(s) - s["gpu"]["start"] for s in steps)
    executing = sum(s["gpu"]["executed"] - s["gpu"]["start"] for s in steps)
    gaps = [max(0.0, b["gpu"]["start"] - step_end(a)) for a, b in zip(steps, steps[1:])]
    full = max(s["tokens"] for s in steps)
    full_steps = [step_end(s) - s["gpu"]["start"] for s in steps if s["tokens"] == full]
    copies = [s["gpu"]["copied"] - s["gpu"]["executed"] for s in steps if "copied" in s["gpu"]]
    wall = end - start
    result = {
        "run": directory.name, "tokens": tokens, "wall_s": round(wall, 3), "tokens_per_s": round(tokens / wall),
        "steps": len(steps), "step_tokens": full, "full_steps": len(full_steps),
        "gpu_steps_s": round(busy, 3), "gpu_execute_s": round(executing, 3),
        "full_step_ms_median": round(1000 * statistics.median(full_steps), 2),
        "head_s": round(steps[0]["gpu"]["start"] - start, 3),
        "gaps_s": round(sum(gaps), 3), "gaps_over_1ms": sum(1 for g in gaps if g > 0.001),
        "largest_gap_ms": round(1000 * max(gaps, default=0.0), 2),
        "tail_s": round(end - step_end(steps[-1]), 3),
        "tokens_per_gpu_s": round(sum(s["tokens"] for s in steps) / busy),
    }
    if copies:
        result["copy_after_step_ms_median"] = round(1000 * statistics.median(copies), 2)
        result["last_copy_ms"] = round(1000 * copies[-1], 2)
    resolves = [r["resolve"] for r in parent if "resolve" in r]
    if resolves:
        result["last_resolve_to_end_s"] = round(end - resolves[-1][1], 3)
    return result


ROWS = [("tokens/s (tokens / wall)", "tokens_per_s"), ("wall of the timed span, s", "wall_s"),
        ("steps (full: tokens each)", lambda r: f"{r['steps']} ({r['full_steps']}: {r['step_tokens']})"),
        ("GPU running steps, s", "gpu_steps_s"), ("  of it execute_model (inputs + forward + capture), s", "gpu_execute_s"),
        ("a full step on the GPU, median ms", "full_step_ms_median"),
        ("tokens per GPU-second of steps", "tokens_per_gpu_s"),
        ("GPU idle before the first step, s", "head_s"),
        ("GPU idle between steps, s (gaps > 1 ms; largest ms)",
         lambda r: f"{r['gaps_s']} ({r['gaps_over_1ms']}; {r['largest_gap_ms']})"),
        ("after the last step, s", "tail_s"),
        ("  from the last batch's states to the end (files), s", "last_resolve_to_end_s"),
        ("capture copies after a step's GPU work, median ms (last)",
         lambda r: f"{r['copy_after_step_ms_median']} ({r['last_copy_ms']})" if "last_copy_ms" in r else "-")]


def table(results: list[dict]) -> str:
    lines = ["| | " + " | ".join(r["run"] for r in results) + " |", "|---|" + "---|" * len(results)]
    for label, key in ROWS:
        cells = [key(r) if callable(key) else str(r.get(key, "-")) for r in results]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    """One column per run that can be read; a run that cannot (a failed step of a device stage) is
    named and left out, and the others still make the table."""
    SETTINGS["runs"] = sys.argv[1:]
    results = []
    for directory in sys.argv[1:]:
        try:
            results.append(analyse(Path(directory)))
        except Unreadable as exc:
            print(f"left out: {exc}", file=sys.stderr)
    for result in results:
        emit("steps", **result)
    print(table(results))


if __name__ == "__main__":
    main()
