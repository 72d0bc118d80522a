#!/usr/bin/env python3
"""Where the generator's time goes: the unmodified speculators 0.3.0
``VllmHiddenStatesGenerator`` through ``vllm_compat.apply()``, as ``bench/gpu.py generator`` runs it,
with timing wrappers installed by this bench alone (nothing in vllm_compat/ or hidden_states/ changes).

    python bench/timeline.py --model M --configs 8x2048,32x2048 --samples 64 --length 2048

Parent (wrapt on the objects the generator built): per step ``schedule``, ``execute_model``,
``sample_tokens`` (vllm_compat's deferred_sampling flushes it before the next step),
``finish_requests``, ``update_from_output``, every ``collective_rpc``; per call the RPC that fetches
the captured states, the mapping of the shared segment (``vllm_compat.transport._attach``), and the
parent's copy out of it (from that RPC's return to ``generate()``'s: speculators' ``.clone()`` of
every slice). Workers (``bench/timeline_hook/sitecustomize.py``): ``execute_model``, the model forward
(``torch.cuda.synchronize``-bounded), ``sample_tokens``, the ``_get_captured_states`` RPC, inside it
speculators' concatenation and the transport's device-to-host copy into the shared segment, and the
reply send.

Per config: one model load for all configs; a warm-up call of the config's shape; an untimed pass
(wrappers off, no synchronisation: the plain rate); then the timed pass, whose tokens/s and table
are reported. Different random tokens in each pass (no prefix cache anyway).
"""
from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
HOOK = BENCH / "timeline_hook"
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(HOOK))

from gpu import SETTINGS, default_layers, emit, load_generator, model_config, sequences, sweep  # noqa: E402
from timeline_spans import ENV_DIR, Spans, read_worker_events, set_enabled  # noqa: E402

COPY = "parent copy"  # opened when the states' RPC returns, closed when generate() returns


def rpc_name(args, kwargs) -> str:
    method = args[0] if args else kwargs.get("method")
    return f"rpc:{method if isinstance(method, str) else getattr(method, '__name__', 'callable')}"


def instrument_rpcs(spans: Spans) -> None:
    """On the executor class, before the generator builds its executor: vllm_compat's
    rpc_single_reply wraps the instance's ``collective_rpc`` and tells the generator's calls by
    their caller, so a wrapper of ours must sit inside it, not around it."""
    import wrapt
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    def collective_rpc(wrapped, instance, args, kwargs):
        if not spans.enabled:
            return wrapped(*args, **kwargs)
        name = rpc_name(args, kwargs)
        with spans.span(name):
            reply = wrapped(*args, **kwargs)
        if name == "rpc:_get_captured_states":  # minor page faults: does the copy land on fresh pages?
            spans.open(COPY, {"minflt": resource.getrusage(resource.RUSAGE_SELF).ru_minflt})
        return reply

    wrapt.wrap_function_wrapper(MultiprocExecutor, "collective_rpc", collective_rpc)


def instrument(generator, spans: Spans) -> None:
    import torch
    import wrapt

    import vllm_compat.transport as transport

    def schedule(wrapped, instance, args, kwargs):
        if not spans.enabled:
            return wrapped(*args, **kwargs)
        with spans.span("schedule") as info:
            output = wrapped(*args, **kwargs)
            info["tokens"] = output.total_num_scheduled_tokens
            info["requests"] = len(output.num_scheduled_tokens)
        return output

    wrapt.wrap_function_wrapper(generator.scheduler, "schedule", schedule)
    for method in ("finish_requests", "add_request", "update_from_output"):
        wrapt.wrap_function_wrapper(generator.scheduler, method, spans.wrapper(method))
    for method in ("execute_model", "sample_tokens"):
        wrapt.wrap_function_wrapper(generator.executor, method, spans.wrapper(method))
    # unpickling the reply looks _attach up by name in the module: mapping (or remapping) the segment
    wrapt.wrap_function_wrapper(transport, "_attach", spans.wrapper("attach"))
    wrapt.wrap_function_wrapper(torch.cuda, "empty_cache", spans.wrapper("empty_cache"))


def timed_generate(generator, spans: Spans, batch) -> int:
    with spans.span("generate") as info:
        results = generator.generate(batch)
        if spans.is_open(COPY):
            copy = spans.open_info()
            copy["minflt"] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - copy["minflt"]
            spans.close(COPY)
        info["tokens"] = sum(r["input_ids"].numel() for r in results)
    return info["tokens"]


# ----------------------------------------------------------------------------------------------
# analysis


def overlap(start: float, end: float, events) -> float:
    return sum(max(0.0, min(end, e["end"]) - max(start, e["start"])) for e in events)


def breakdown(parent: list[dict], worker: list[dict]) -> dict:
    """Rows that add up to the wall time of the timed calls (the parent waits in every RPC, and the
    workers work only inside RPCs)."""
    calls = [e for e in parent if e["name"] == "generate"]
    wall = sum(e["end"] - e["start"] for e in calls)
    windows = [(c["start"], c["end"]) for c in calls]
    inside = [e for e in worker if any(s <= e["start"] < t for s, t in windows)]
    worker_top = [e for e in inside if e["depth"] == 0]
    steps = sum(1 for e in parent if e["name"] == "schedule" and e.get("info", {}).get("tokens", 0) > 0)

    def p_self(*names):
        return sum(e["self"] for e in parent if e["name"] in names), sum(1 for e in parent if e["name"] in names)

    rpcs = [e for e in parent if e["name"].startswith("rpc:")]

    def clipped(event):  # worker time while the parent waits in an RPC (a reply's tail may run past it)
        return sum(overlap(r["start"], r["end"], [event]) for r in rpcs)

    def w_dur(name):
        chosen = [e for e in inside if e["name"] == name]
        return sum(clipped(e) for e in chosen), len(chosen)

    def w_self(name):
        chosen = [e for e in inside if e["name"] == name]
        children = [c for e in chosen for c in inside
                    if c["depth"] == e["depth"] + 1 and e["start"] <= c["start"] and c["end"] <= e["end"]]
        return sum(clipped(e) for e in chosen) - sum(clipped(c) for c in children), len(chosen)

    step_rpcs = [e for e in rpcs if e["name"] in ("rpc:execute_model", "rpc:sample_tokens")]
    call_rpcs = [e for e in rpcs if e not in step_rpcs]

    def messaging(chosen):
        return sum(e["self"] - overlap(e["start"], e["end"], worker_top) for e in chosen), len(chosen)

    forward = w_dur("w:forward")
    execute = w_dur("w:execute_model")
    get_states = w_self("w:_get_captured_states")
    ensure = w_dur("w:segment ensure")
    to_host = w_dur("w:to_host")
    rows = [
        ("P", "scheduler: schedule", "step", p_self("schedule")),
        ("P", "scheduler: finish_requests, add_request, update_from_output", "call",
         p_self("finish_requests", "add_request", "update_from_output")),
        ("P", "executor: execute_model / sample_tokens outside their RPCs", "step", p_self("execute_model", "sample_tokens")),
        ("R", "step RPCs (execute_model, sample_tokens): send + wait + receive, not worker work", "step", messaging(step_rpcs)),
        ("W", "model forward (synchronized)", "step", forward),
        ("W", "execute_model outside the forward (inputs, bookkeeping)", "step", (execute[0] - forward[0], execute[1])),
        ("W", "sample_tokens (logits, sampling of the deferred step)", "step", w_dur("w:sample_tokens")),
        ("W", "reply send (pickle, message queue)", "rpc", w_dur("w:reply send")),
        ("W", "_reset_capture", "call", w_dur("w:_reset_capture")),
        ("W", "capture: speculators' torch.cat of the steps' states", "call", w_dur("w:cat")),
        ("W", "capture: regroup rows per request (capture_attribution) and rest", "call", get_states),
        ("W", "transport: segment grow + pin", "call", ensure),
        ("W", "transport: D2H copy into the shared segment", "call", (to_host[0] - ensure[0], to_host[1])),
        ("R", "per-call RPCs (_reset_capture, _get_captured_states): not worker work", "call", messaging(call_rpcs)),
        ("P", "attach: map the shared segment (unpickling the reply)", "call", p_self("attach")),
        ("P", "parent copy out of the segment (speculators' slice .clone())", "call", p_self(COPY)),
        ("P", "torch.cuda.empty_cache (parent)", "call", p_self("empty_cache")),
        ("P", "rest of generate() (Requests, loop, results)", "call", p_self("generate")),
    ]
    accounted = sum(seconds for _, _, _, (seconds, _) in rows)
    state_bytes = sum(e.get("info", {}).get("bytes", 0) for e in inside if e["name"] == "w:to_host")
    copy_faults = sum(e.get("info", {}).get("minflt", 0) for e in parent if e["name"] == COPY)
    return {"wall": wall, "calls": len(calls), "steps": steps, "rows": rows, "unaccounted": wall - accounted,
            "copy_faults": copy_faults,
            "tokens": sum(e["info"]["tokens"] for e in calls), "state_bytes": state_bytes,
            "forward_tokens": sum(e.get("info", {}).get("tokens", 0) for e in inside if e["name"] == "w:forward")}


def render(result: dict) -> str:
    wall, calls, steps = result["wall"], result["calls"], max(result["steps"], 1)
    lines = [f"wall {wall:.3f} s over {calls} calls, {result['steps']} steps with tokens "
             f"({result['tokens']:,} tokens, {result['tokens'] / wall:,.0f} tokens/s timed)",
             "| side | stage | n | per call (s) | per step (ms) | total (s) | % of wall |",
             "|---|---|---|---|---|---|---|"]
    for side, stage, unit, (seconds, count) in result["rows"]:
        per_step = f"{seconds / steps * 1000:.1f}" if unit == "step" else ""
        lines.append(f"| {side} | {stage} | {count} | {seconds / calls:.4f} | {per_step} | {seconds:.3f} | "
                     f"{100 * seconds / wall:.1f} |")
    lines.append(f"| | unaccounted (wall less the rows) | | "
                 f"{result['unaccounted'] / calls:.4f} | | {result['unaccounted']:.3f} | "
                 f"{100 * result['unaccounted'] / wall:.1f} |")
    rows = {stage: seconds for _, stage, _, (seconds, _) in result["rows"]}
    gb = result["state_bytes"] / 1e9
    d2h = rows["transport: D2H copy into the shared segment"]
    copy = rows["parent copy out of the segment (speculators' slice .clone())"]
    if gb and d2h and copy:
        lines.append(f"captured states {gb:.2f} GB: D2H {gb / d2h:.1f} GB/s, parent copy {gb / copy:.1f} GB/s; "
                     f"forward {result['forward_tokens'] / max(rows['model forward (synchronized)'], 1e-9):,.0f} tokens/s "
                     f"while it runs; parent copy {result['copy_faults'] / (gb * 1e9 / 2**20):.1f} minor page faults "
                     "per MiB (256: every 4 KiB page fresh)")
    return "\n".join(lines)


def call_timeline(parent: list[dict], worker: list[dict], call: dict) -> str:
    """Every span of one call on one clock (ms from the call's start); repeats of one span in a row
    are folded into one line with their count."""
    chosen = [e for e in parent if call["start"] <= e["start"] and e["end"] <= call["end"] and e is not call]
    chosen += [e for e in worker if call["start"] <= e["start"] < call["end"]]
    chosen.sort(key=lambda e: (e["start"], e["depth"]))
    lines = ["| ms from call start | side | span | n | ms | info |", "|---|---|---|---|---|---|"]
    folded: list[list] = []
    for e in chosen:
        side = "W" if e["process"] == "worker" else "P"
        if folded and folded[-1][1] == side and folded[-1][2] == e["name"] and folded[-1][5] == e["depth"]:
            folded[-1][3] += 1
            folded[-1][4] += e["end"] - e["start"]
            continue
        folded.append([e["start"], side, e["name"], 1, e["end"] - e["start"], e["depth"], e.get("info", "")])
    for start, side, name, count, seconds, depth, info in folded:
        lines.append(f"| {1000 * (start - call['start']):9.1f} | {side} | {'  ' * depth}{name} | {count} | "
                     f"{1000 * seconds:.1f} | {info or ''} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--configs", default="8x2048,32x2048", help="batch x length, e.g. 8x2048,32x2048")
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.8)
    parser.add_argument("--tp", type=int, default=1)
    args = parser.parse_args(argv)
    SETTINGS.update(vars(args))

    events_dir = tempfile.mkdtemp(prefix="timeline-")
    # the spawned workers load bench/timeline_hook/sitecustomize.py, which installs their wrappers
    os.environ[ENV_DIR] = events_dir
    os.environ["PYTHONPATH"] = os.pathsep.join([str(HOOK)] + [p for p in [os.environ.get("PYTHONPATH")] if p])

    import vllm_compat

    report = vllm_compat.apply()  # before speculators is imported (load_generator imports it)
    configs = sweep(args.configs)
    spans = Spans("parent")
    spans.enabled = False
    instrument_rpcs(spans)
    generator, load = load_generator(args, configs)
    instrument(generator, spans)
    workers = generator.executor.collective_rpc(set_enabled, args=(False,))
    if not all(workers if isinstance(workers, list) else [workers]):
        raise RuntimeError("timeline: the workers did not load bench/timeline_hook/sitecustomize.py")
    hidden = int(model_config(args.model)["hidden_size"])
    print(f"model {args.model} hidden {hidden} layers {default_layers(args.model)} load {load:.1f} s; "
          f"vllm_compat applied {len(report.applied)}", flush=True)

    try:
        for batch, length in configs:
            count = max(batch, args.samples * args.length // length // batch * batch)
            generator.generate(sequences(args.model, batch, length, seed=1))  # warm-up, grows the segment
            plain = sequences(args.model, count, length, seed=3)
            started = time.perf_counter()
            tokens = sum(sum(r["input_ids"].numel() for r in generator.generate(plain[i:i + batch]))
                         for i in range(0, count, batch))
            plain_seconds = time.perf_counter() - started

            first = len(spans.events)
            spans.enabled = True
            generator.executor.collective_rpc(set_enabled, args=(True,))
            timed = sequences(args.model, count, length, seed=4)
            for i in range(0, count, batch):
                timed_generate(generator, spans, timed[i:i + batch])
            spans.enabled = False
            generator.executor.collective_rpc(set_enabled, args=(False,))
            time.sleep(0.2)  # the workers' last lines reach their files

            parent = spans.events[first:]
            worker = read_worker_events(events_dir)
            result = breakdown(parent, worker)
            print(f"\n## batch {batch} x {length}: {count} sequences, {count // batch} calls\n")
            print(f"untimed pass: {tokens:,} tokens in {plain_seconds:.3f} s = {tokens / plain_seconds:,.0f} tokens/s")
            print(render(result))
            last = [e for e in parent if e["name"] == "generate"][-1]
            print(f"\ntimeline of the last timed call ({1000 * (last['end'] - last['start']):.1f} ms):\n")
            print(call_timeline(parent, worker, last))
            emit("timeline", model=Path(args.model).name, batch=batch, length=length, calls=result["calls"],
                 steps=result["steps"], tokens=result["tokens"], untimed_tokens_per_s=round(tokens / plain_seconds),
                 timed_tokens_per_s=round(result["tokens"] / result["wall"]), wall_s=round(result["wall"], 4),
                 load_s=round(load, 1), state_gb=round(result["state_bytes"] / 1e9, 3),
                 rows={stage: round(seconds, 4) for _, stage, _, (seconds, _) in result["rows"]},
                 unaccounted_s=round(result["unaccounted"], 4), parent_copy_minor_faults=result["copy_faults"],
                 keep_freed_host_memory=os.environ.get("VLLM_COMPAT_KEEP_FREED_HOST_MEMORY", "1") != "0")
    finally:
        generator.executor.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
