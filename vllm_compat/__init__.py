"""vllm-compat: keep speculators' hidden-state extraction working while vLLM's internals drift.

    import vllm_compat
    report = vllm_compat.apply()     # idempotent; returns what was applied and why
    ...                              # unmodified speculators code, any supported vLLM
    vllm_compat.revert()             # everything back as it was

Importing this package is cheap: it imports neither vLLM nor torch. ``apply()`` imports the vLLM
modules it probes; the audit (``vllm-compat audit``) reads vLLM's source without importing it.

Other code may also use ``vllm_compat.host``, ``versions``, ``consumer`` and ``report``; the bundled
extractor uses ``vllm_compat.extractor_api`` alone (docs/usage.md, "What other code may use"); the
layers: docs/architecture.md.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

# The one place the version is written: pyproject.toml reads it, both CLIs print it (--version), and
# tests/unit/test_version.py holds it to the newest release heading of CHANGELOG.md.
__version__ = "0.10.0"
__all__ = ["apply", "revert", "status", "audit", "__version__"]

if TYPE_CHECKING:
    from .audit import audit
    from .registry import apply, revert, status


def __getattr__(name: str) -> Any:
    # Lazy: the registry pulls in packaging and wrapt, the audit pulls in ast walking.
    if name in ("apply", "revert", "status"):
        from . import registry

        return getattr(registry, name)
    if name == "audit":
        from .audit import audit

        return audit
    raise AttributeError(f"module 'vllm_compat' has no attribute {name!r}")
