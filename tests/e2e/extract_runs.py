"""Running ``hidden-states extract`` as its users do, in a subprocess on real vLLM: the command, its
environment, its arguments for the tiny models, and the input files (support module of the end-to-end
tests)."""
from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT
from tests.e2e import harness


LAYERS = ["0", "2", "3", "5"]

SPECULATORS = "0.3.0"


def write_jsonl(path: Path, n: int, seed: int = 3, long_every: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        length = 1100 if long_every and i % long_every == long_every - 1 else rng.randrange(1, 600)
        row = {"input_ids": [rng.randrange(4, 512) for _ in range(length)]}
        if i % 2 == 0:
            cut = rng.randrange(0, length)
            row["loss_mask"] = [0] * cut + [1] * (length - cut)
        rows.append(row)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def cli(*args, env_extra=None, kv_cache=True):
    """The extract command and its environment; ``kv_cache`` False: without VLLM_CPU_KVCACHE_SPACE, which
    the extractor then sets from its estimate (as for the command the demo prints)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in [str(harness.speculators_path(SPECULATORS)), ROOT,
                                                                   os.environ.get("PYTHONPATH", "")] if p),
           "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", **(env_extra or {})}
    env.pop("VLLM_COMPAT_APPLY", None)
    if not kv_cache:
        env.pop("VLLM_CPU_KVCACHE_SPACE")
    return [sys.executable, "-m", "hidden_states", "extract", *args], env


# where each CLI run's whole stderr is kept (the device's test stages set it): an assertion shows the
# last few thousand characters, and a vLLM engine that fails to start names its cause far above them
STDERR_DIR = os.environ.get("E2E_STDERR_DIR")


def run_cli(*args, env_extra=None, timeout=900, kv_cache=True):
    command, env = cli(*args, env_extra=env_extra, kv_cache=kv_cache)
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    if STDERR_DIR:
        out = args[args.index("--output-dir") + 1] if "--output-dir" in args else "run"
        name = re.sub(r"[^\w.-]+", "_", str(out)).strip("_")[-120:]
        Path(STDERR_DIR).mkdir(parents=True, exist_ok=True)
        (Path(STDERR_DIR) / f"{name}.rc{proc.returncode}.txt").write_text(proc.stderr)
    return proc


def extract_args(model, data, out, *extra):
    """A run of the tiny model: the unmodified generator (``--backend speculators``, named: the runs built
    here are the shim's coverage, which the default backend no longer is), unless ``extra`` names
    another backend (the last flag given wins)."""
    return ["--model-path", str(model), "--prepared-data", str(data), "--output-dir", str(out),
            "--preset", "cpu-tiny", "--format", "speculators-0.3", "--layer-ids", *LAYERS, "--progress-interval", "1",
            "--backend", "speculators", *extra]


def shared_core_binding(ranks: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``ranks`` workers on this host's cores, shared round-robin.

    vLLM's CPU worker binds each rank's OpenMP threads to a core list, the list's entry at its rank
    (``--tp-size`` x ``--pp-size`` ranks, tensor-parallel ranks fastest: ``v1/worker/cpu_worker.py``);
    its ``auto`` binding wants one NUMA node per rank and refuses more ranks than nodes. Rank r gets
    core r mod cores ("0|1|0|1|...").
    """
    cores = sorted(os.sched_getaffinity(0))
    return "|".join(str(cores[rank % len(cores)]) for rank in range(ranks))


def failure_line(err: str) -> str:
    """The run's one ``hidden-states: failed:`` line in its stderr ``err`` (asserted to be one)."""
    failed = [line for line in err.splitlines() if line.startswith("hidden-states: failed:")]
    assert len(failed) == 1, err[-3000:]
    return failed[0]


def data_files(out: Path) -> dict[int, os.stat_result]:
    return {int(p.stem.split("_")[1]): p.stat() for p in out.glob("data_*.pt")}
