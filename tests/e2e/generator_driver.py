"""Runs the *unmodified* speculators generator in its own process and saves what it returns.

    python generator_driver.py SPEC.json OUT.pt

SPEC.json: {"model": dir, "layer_ids": [...], "calls": [[[ids...], ...], ...],
            "apply": true, "generator_kwargs": {...}, "kv_cache_bytes": int or absent}
OUT.pt (torch.save): {"calls": [[{"input_ids": [...], "hidden_states": [tensor per layer]}, ...], ...],
                      "report": str or None, "error": traceback or None, "kv_cache_blocks": int or None,
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
    saved = {"calls": [], "report": None, "error": None, "kv_cache_blocks": None}
    try:
        if spec.get("apply", True):
            import vllm_compat

            saved["report"] = str(vllm_compat.apply())
        from speculators.data_generation import vllm_hidden_states_generator as module

        kwargs = sized_kv_cache(spec.get("generator_kwargs", {}), spec.get("kv_cache_bytes"),
                                module.CACHE_MEMORY_FRACTION)
        generator = module.VllmHiddenStatesGenerator(spec["model"], layer_ids=spec["layer_ids"], **kwargs)
        saved["kv_cache_blocks"] = generator.vllm_config.cache_config.num_gpu_blocks
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


def sized_kv_cache(kwargs: dict, kv_cache_bytes: int | None, fraction: float) -> dict:
    """The generator's kwargs with ``gpu_memory_utilization`` chosen so that its KV cache, ``free
    memory x utilization x fraction`` (speculators 0.3/0.4's ``CACHE_MEMORY_FRACTION``), comes to
    ``kv_cache_bytes`` on a host without a CUDA device. There the free memory it asks is the host's
    ``MemAvailable`` (``host_memory_info``), which every other process on the host moves: a smaller
    KV cache admits fewer prompts per step, and a cache under one step's token budget never splits a
    prompt across steps, which is what the ``capture_attribution`` and ``prefill_abort_deferral``
    negative proofs need to see go wrong. Read here, a moment before the generator reads it, the
    answer moves only by what starting vLLM's worker costs: the sizes the harness asks for leave
    room for that many times over. On a CUDA device the kwargs stay as given (asking torch here
    would break the fork of vLLM's workers, ``vllm_compat.host``)."""
    if kv_cache_bytes is None:
        return kwargs
    from vllm_compat.host import host_memory, vllm_device_type

    if vllm_device_type() == "cuda":
        return kwargs
    return {**kwargs, "gpu_memory_utilization": kv_cache_bytes / (host_memory()[0] * fraction)}


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
