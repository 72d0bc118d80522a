"""Runs the *unmodified* speculators generator in its own process and saves what it returns.

    python generator_driver.py SPEC.json OUT.pt

SPEC.json: {"model": dir, "layer_ids": [...], "calls": [[[ids...], ...], ...],
            "apply": true, "generator_kwargs": {...}}
OUT.pt (torch.save): {"calls": [[{"input_ids": [...], "hidden_states": [tensor per layer]}, ...], ...],
                      "report": str or None, "error": traceback or None,
                      "ended_children": [hidden_states.processes.Exit.explain() of each, ...]}
The test process compares OUT.pt with HF transformers; this process never sees the reference.
"""
import gc
import json
import multiprocessing.process
import sys
import traceback

from hidden_states.processes import Exit, oom_kills, oom_kills_since


def main(spec_path: str, out_path: str) -> int:
    import torch

    spec = json.loads(open(spec_path).read())
    oom_kills_before = oom_kills()
    saved = {"calls": [], "report": None, "error": None}
    try:
        if spec.get("apply", True):
            import vllm_compat

            saved["report"] = str(vllm_compat.apply())
        from speculators.data_generation.vllm_hidden_states_generator import VllmHiddenStatesGenerator

        generator = VllmHiddenStatesGenerator(spec["model"], layer_ids=spec["layer_ids"],
                                              **spec.get("generator_kwargs", {}))
        for call in spec["calls"]:
            results = generator.generate(call)
            saved["calls"].append([
                {"input_ids": r["input_ids"].tolist(), "hidden_states": [h.float() for h in r["hidden_states"]]}
                for r in results
            ])
        if spec.get("apply", True):
            import vllm_compat

            saved["report"] = str(vllm_compat.status())
    except BaseException:  # the test asserts on this text
        saved["error"] = traceback.format_exc()
        saved["ended_children"] = ended_children(oom_kills_since(oom_kills_before))
    torch.save(saved, out_path)
    return 0


def ended_children(oom_kills_during: int | None) -> list[str]:
    """The processes this one started that have ended, how, and what that most likely means. A
    worker the kernel killed (the OOM killer's SIGKILL) leaves vLLM an EOF on its pipe ("WorkerProc
    initialization failed ... See stack trace for root cause.") and no trace in any log; its exit
    code and the kernel's OOM count are the only witnesses. Called while the exception's frames
    still hold vLLM's process handles."""
    return [Exit(process.name, process.pid, process.exitcode).explain(oom_kills_during)
            for process in gc.get_objects()
            if isinstance(process, multiprocessing.process.BaseProcess) and process.exitcode is not None]


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
