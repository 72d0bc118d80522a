"""One decision rule for an adapter's shape, shared by apply()'s probe and the audit.

Verdicts: ``native`` (old API present: nothing to do), ``adapted`` (new API present: the adapter
applies), ``unknown drift`` (neither shape, or a release inside the adapter's range that still shows
the old one), ``missing`` (the symbol itself is gone). Live and static sources return the same
observations for the same release, so both callers reach the same verdict.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from packaging.version import Version

from ..versions import in_range
from .shapes import MISSING, Source

if TYPE_CHECKING:  # the declaration judged; read, never built here (adapter.py builds on this layer)
    from ..adapter import Adapter

NATIVE = "native"
ADAPTED = "adapted"
# The audit's word (its text and JSON say it in capitals). apply()'s report gives this verdict (and
# ``missing``) a status of its own vocabulary, report.UNKNOWN_DRIFT ("unknown_drift"): two values.
UNKNOWN_DRIFT_VERDICT = "UNKNOWN DRIFT"
MISSING_SYMBOL = "missing"


@dataclass(frozen=True)
class Verdict:
    verdict: str
    reason: str
    found: str = ""
    where: str = ""


def is_nightly(version: Version) -> bool:
    return version.is_devrelease or version.is_prerelease or bool(version.local and "g" in version.local)


def judge(adapter: Adapter, source: Source, vllm: Version | None) -> Verdict:
    """Read ``adapter``'s expectation against ``source``. ``vllm`` may be None (a source tree
    without a version file): then only the shape decides."""
    expected_new = vllm is not None and in_range(adapter.vllm, vllm)
    release = f"vllm {vllm}" if vllm is not None else "this vLLM"
    if adapter.expect is None:
        if vllm is None or expected_new:
            return Verdict(ADAPTED, f"{release}: {adapter.drift}")
        return Verdict(NATIVE, f"{release} is outside {adapter.vllm}")
    expect = adapter.expect
    seen = expect.check.observe(source)
    shape = f"{expect.check.describe()} is {seen.value}"
    if seen.value in expect.new:
        note = "" if vllm is None or expected_new else f" (earlier than {adapter.vllm}: a nightly?)"
        return Verdict(ADAPTED, f"{release}: {shape}{note}", seen.value, seen.where)
    if seen.value == MISSING and MISSING not in expect.old:
        return Verdict(MISSING_SYMBOL, f"{release}: {expect.check.target} not found", seen.value, seen.where)
    if seen.value in expect.old:
        if expected_new and not is_nightly(vllm):
            return Verdict(UNKNOWN_DRIFT_VERDICT,
                           f"expected the new shape for vllm {adapter.vllm} (docs/drift-atlas.md), "
                           f"but on {release} {shape}", seen.value, seen.where)
        return Verdict(NATIVE, f"native on {release}: {shape}", seen.value, seen.where)
    return Verdict(UNKNOWN_DRIFT_VERDICT, f"{release}: {shape}; expected {sorted(expect.old)} (old) or "
                   f"{sorted(expect.new)} (new)", seen.value, seen.where)
