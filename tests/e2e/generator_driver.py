"""Runs the *unmodified* speculators generator in its own process and saves what it returns.

    python generator_driver.py SPEC.json OUT.pt

SPEC.json: {"model": dir, "layer_ids": [...], "calls": [[[ids...], ...], ...],
            "apply": true, "generator_kwargs": {...}}
OUT.pt (torch.save): {"calls": [[{"input_ids": [...], "hidden_states": [tensor per layer]}, ...], ...],
                      "report": str or None, "error": traceback or None,
                      "ended_children": ["<name> (pid N): exit code C" or "...: killed by SIGNAME", ...]}
The test process compares OUT.pt with HF transformers; this process never sees the reference.
"""
import gc
import json
import multiprocessing.process
import signal
import sys
import traceback


def main(spec_path: str, out_path: str) -> int:
    import torch

    spec = json.loads(open(spec_path).read())
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
        saved["ended_children"] = ended_children()
    torch.save(saved, out_path)
    return 0


def ended_children() -> list[str]:
    """The processes this one started that have ended, and how. A worker the kernel killed (the OOM
    killer's SIGKILL) leaves vLLM an EOF on its pipe ("WorkerProc initialization failed ... See stack
    trace for root cause.") and no trace in any log; its exit code is the only witness. Called while
    the exception's frames still hold vLLM's process handles."""
    ended = []
    for process in gc.get_objects():
        if isinstance(process, multiprocessing.process.BaseProcess) and process.exitcode is not None:
            code = process.exitcode
            how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            ended.append(f"{process.name} (pid {process.pid}): {how}")
    return ended


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
