"""The optional packages a command needs (vllm-compat's extras), checked before any work.

Each is named with the ``pip install`` that brings it into this environment without moving what the
installed vLLM runs with (``vllm_compat.environment.install_command``: transformers and
huggingface_hub held at their versions; ``datasets`` alone pulls a huggingface_hub with which
transformers 4 no longer imports).
"""
from __future__ import annotations

import importlib.util

from vllm_compat.extractor_api import install_command

from .errors import UsageError

# module -> (the requirement to install, the extra of pyproject.toml that holds it)
OPTIONAL = {
    "datasets": ("datasets>=4", "speculators-05"),
    "pyarrow": ("pyarrow", "speculators-05"),  # datasets requires it
}


def install_hint(module: str) -> str:
    requirement, extra = OPTIONAL[module]
    return f"{install_command(requirement)} (vllm-compat's extra [{extra}])"


def require(module: str, purpose: str, error: type[Exception] = UsageError) -> None:
    """Raise ``error`` naming ``purpose`` and what to install when ``module`` is not importable here."""
    if importlib.util.find_spec(module) is None:
        raise error(f"{purpose} needs the '{module}' package, not installed here: {install_hint(module)}")
