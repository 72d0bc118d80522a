#!/usr/bin/env python3
"""A tiny EAGLE-3 draft trained on CPU by speculators 0.9's own trainer, on bf16 and on FP8 states of
the same samples: the two loss curves side by side.

    python bench/fp8_training.py                       # 64 samples, 6 epochs: the table in docs/benchmarks.md
    python bench/fp8_training.py --samples 16 --epochs 2   # quick

Run with the vLLM 0.32.0 venv's python (speculators 0.9 needs Python >= 3.11 and transformers >= 5).
The states come from the extractor on CPU vLLM (the tiny Llama of the e2e suite, speculators 0.3.0's
generator), written twice: ``--state-dtype model`` (the model's bf16) and ``--state-dtype fp8``, the
same samples in the same batches, so the FP8 files are the bf16 ones through the per-token quantizer.
The trainer (``tests/e2e/trainer_driver.py``, as a user drives ``python -m speculators.train``) runs
with the same seed on each, ``--hidden-states-backend fp8`` for the FP8 files (its ``FP8Transfer``
dequantizes them to bf16). Writes the per-step losses (JSON) and prints the side-by-side table.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

from provenance import provenance

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("VLLM_COMPAT_CACHE", ROOT / ".cache"))
IDS_05 = [1, 3, 4, 6]  # the e2e suite's layers of the 6-layer tiny model, counted as layers done
GENERATOR = "0.3.0"  # the speculators release whose generator extracts (the default backend)
TRAINER = "0.9.0"  # the one whose trainer reads FP8


def write_samples(path: Path, count: int, seed: int) -> None:
    """Random-token samples of 64-320 tokens; the loss on each one's last two thirds (a reply after a prompt)."""
    rng = random.Random(seed)
    lengths = [rng.randrange(64, 320) for _ in range(count)]
    path.write_text("".join(json.dumps({"input_ids": [rng.randrange(4, 512) for _ in range(n)],
                                        "loss_mask": [int(i >= n // 3) for i in range(n)]}) + "\n" for n in lengths))


def extract(model: Path, data: Path, out: Path, state_dtype: str) -> float:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
           "PYTHONPATH": os.pathsep.join([str(CACHE / "speculators" / GENERATOR), str(CACHE / "speculators" / TRAINER),
                                          str(ROOT)])}
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "hidden_states", "extract", "--model-path", str(model),
                           "--prepared-data", str(data), "--output-dir", str(out), "--preset", "cpu-tiny",
                           "--format", "speculators-0.5", "--layer-ids", *map(str, IDS_05),
                           "--state-dtype", state_dtype], capture_output=True, text=True, env=env, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"extract --state-dtype {state_dtype} failed:\n{proc.stderr[-3000:]}")
    return time.perf_counter() - started


def train(model: Path, data_dir: Path, work: Path, epochs: int, fp8: bool) -> list[dict]:
    result = work / "losses.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(CACHE / "speculators" / TRAINER), str(ROOT)])}
    flags = ["--speculator-type", "eagle3", "--verifier-name-or-path", str(model), "--data-path", str(data_dir),
             "--target-layer-ids", *map(str, IDS_05[:-1]), "--num-layers", "1", "--total-seq-len", "512",
             "--epochs", str(epochs), "--train-data-ratio", "0.75", "--save-path", str(work / "checkpoints"),
             "--num-workers", "0", "--on-missing", "raise", "--lr", "3e-3", "--log-freq", "1", "--logger", "",
             "--draft-attn-impl", "sdpa", "--loss-implementation", "eager", "--scheduler-type", "none",
             "--seed", "0"] + (["--hidden-states-backend", "fp8"] if fp8 else [])
    work.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "e2e" / "trainer_driver.py"), "0.9", str(result),
                           "--", *flags], capture_output=True, text=True, env=env, cwd=work)
    if proc.returncode != 0 or not result.exists():
        raise SystemExit(f"training on {data_dir.name} failed:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
    return json.loads(result.read_text())


def state_bytes(out: Path) -> int:
    return sum(path.stat().st_size for path in (out / "hidden_states").glob("hs_*.safetensors"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--seed", type=int, default=31)
    parser.add_argument("--work", default="/tmp/fp8-training")
    parser.add_argument("--results", help="where the JSON goes (default: WORK/fp8-training.json)")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from hidden_states.fixtures.tiny_model import build

    model = build("llama", CACHE / "models" / "llama")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    write_samples(work / "data.jsonl", args.samples, args.seed)
    runs = {}
    for name, state_dtype in (("bf16", "model"), ("fp8", "fp8")):
        out = work / name
        seconds = extract(model, work / "data.jsonl", out, state_dtype)
        steps = train(model, out, work / f"train-{name}", args.epochs, fp8=state_dtype == "fp8")
        runs[name] = {"extract_seconds": round(seconds, 1), "state_bytes": state_bytes(out), "steps": steps}
    report = {"samples": args.samples, "epochs": args.epochs, "seed": args.seed, "layers": IDS_05,
              "generator": GENERATOR, "trainer": TRAINER, "runs": runs, "provenance": provenance(vars(args))}
    results = Path(args.results or work / "fp8-training.json")
    results.write_text(json.dumps(report, indent=1))
    bf16, fp8 = runs["bf16"]["steps"], runs["fp8"]["steps"]
    print(f"state bytes: bf16 {runs['bf16']['state_bytes']:,}, fp8 {runs['fp8']['state_bytes']:,} "
          f"({runs['fp8']['state_bytes'] / runs['bf16']['state_bytes']:.3f}x)")
    print("| step | loss, bf16 states | loss, FP8 states | FP8 - bf16 |")
    print("|---:|---:|---:|---:|")
    for step, (a, b) in enumerate(zip(bf16, fp8, strict=True), start=1):
        print(f"| {step} | {a['loss']:.4f} | {b['loss']:.4f} | {b['loss'] - a['loss']:+.4f} |")
    print(f"results: {results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
