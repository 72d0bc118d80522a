"""Exceptions raised by vllm-compat. Expected skips are report entries, never exceptions."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .report import AdapterResult


class VllmCompatError(Exception):
    """Base class of every error vllm-compat raises on purpose."""


class UnknownDriftError(VllmCompatError):
    """Raised in strict mode when the installed vLLM matches neither the old nor the new shape.

    Attributes:
        results: the report entries with status ``unknown_drift``.
    """

    def __init__(self, results: list[AdapterResult]):
        self.results = results
        lines = "\n".join(f"  {r}" for r in results)
        super().__init__(f"unknown vLLM drift (strict mode):\n{lines}")


class NotVerifiedError(VllmCompatError):
    """Raised in strict mode when the installed vLLM is newer than the newest release an adapter
    it needs was verified on.

    Attributes:
        results: the report entries marked "not verified".
    """

    def __init__(self, results: list[AdapterResult]):
        self.results = results
        lines = "\n".join(f"  {r}" for r in results)
        super().__init__(f"vLLM newer than verified (strict mode):\n{lines}")


class AdapterNotApplicable(VllmCompatError):
    """An adapter the user named explicitly cannot be applied (unknown id, or its probe says no)."""


class UnsupportedVersionError(VllmCompatError):
    """A version string that ``packaging`` cannot parse, named with where it came from."""
