#!/usr/bin/env python3
"""The README's demo command: a CPU extraction on a tiny local model, checked against HF.

Builds (or reuses) the vLLM venv under .cache/ (scripts/vllm_venv.py), then runs
``python -m hidden_states demo`` inside it with speculators 0.3.0 on the path.
"""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import vllm_venv  # noqa: E402

VLLM = os.environ.get("DEMO_VLLM", "0.17.0")
SPECULATORS = os.environ.get("DEMO_SPECULATORS", "0.3.0")

if __name__ == "__main__":
    python = vllm_venv.build_venv(VLLM, rebuild=False)
    speculators = vllm_venv.build_speculators(SPECULATORS)
    env = {**os.environ, "PYTHONPATH": str(speculators), "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    sys.exit(subprocess.run([str(python), "-m", "hidden_states", "demo", *sys.argv[1:]], cwd=ROOT, env=env).returncode)
