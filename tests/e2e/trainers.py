"""The speculators releases whose trainers prove the output layouts, and a trainer run on a directory
the extractor wrote (support module of the end-to-end tests)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import CACHE, ROOT
from vllm_compat.consumer import TRAINER_PROOF_RELEASES


DRIVER = Path(__file__).with_name("trainer_driver.py")


def speculators_09() -> Path:
    """speculators 0.9.0 with the requirements this venv lacks (datasets, pyarrow, hs-connectors)."""
    release = TRAINER_PROOF_RELEASES["speculators-0.5"]
    target = Path(CACHE) / "speculators" / release
    subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "vllm_venv.py"), "--speculators-only", release,
                    "--with-requirements-of", sys.executable], check=True, capture_output=True)
    return target


def transformers_4_python() -> str:
    """The vLLM 0.17.0 matrix venv (transformers 4.57), built when missing."""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import vllm_venv

    return str(vllm_venv.build_venv("0.17.0", rebuild=False))


def run_trainer(python: str, path: Path, args: list[str], tmp_path: Path) -> list[float]:
    """``python -m hidden_states.train ARGS`` (through trainer_driver.py, which keeps each step's loss)."""
    result = tmp_path / "losses.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(path), ROOT]), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([python, str(DRIVER), str(result), *args], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=900)
    assert proc.returncode == 0 and result.exists(), proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "no accelerator here: the model trains on cpu" in proc.stderr, proc.stderr[-4000:]  # what it changed
    return [step["loss"] for step in json.loads(result.read_text())]
