"""The extract workload the CPU benches compare on (``bench/backends.py``, ``bench/certificates.py``):
its arguments, and one run of ``bench/gpu.py extract`` (the extractor's CLI end to end, the model load
excluded from the rate) or of ``bench/gpu.py prefill`` (vLLM's own path on the same rows) in a process
of its own."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def add_arguments(parser) -> None:
    """The model, the rows (``--samples`` of ``--length`` tokens), the batch and vLLM's memory share."""
    parser.add_argument("--model", default=str(ROOT / ".cache" / "models" / "llama"))
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--gpu-memory-utilization", default="0.02")


def run_extract(args, backend: str, work: str, *flags: str) -> dict:
    """``bench/gpu.py extract``'s RESULT record for one run, or ``{"error": its stderr's tail}``."""
    command = [sys.executable, str(ROOT / "bench" / "gpu.py"), "extract", "--backend", backend,
               "--model", args.model, "--samples", str(args.samples), "--length", str(args.length),
               "--batch", str(args.batch), "--gpu-memory-utilization", args.gpu_memory_utilization,
               "--work", work, *flags]
    return result_of(command)


def run_prefill(args) -> dict:
    """``bench/gpu.py prefill``'s RESULT record (vLLM's eager prefill of the same rows, its own process),
    or ``{"error": its stderr's tail}``."""
    return result_of([sys.executable, str(ROOT / "bench" / "gpu.py"), "prefill", "--model", args.model,
                      "--samples", str(args.samples), "--length", str(args.length),
                      "--gpu-memory-utilization", args.gpu_memory_utilization])


def result_of(command: list[str]) -> dict:
    proc = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OUT": ""})
    line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
    return json.loads(line[7:]) if line else {"error": proc.stderr[-2000:]}
