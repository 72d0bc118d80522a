"""Exact pins a vLLM wheel asks for that the package index does not serve, and what each becomes.

A release may pin a version of a dependency that was never published, or was pulled, by the time
the venv is built: ``vllm==0.34.0`` pins ``flashinfer-python==0.7.3`` while the index has 0.7.2.post1
and 0.7.4. Such a pin cannot install; it is relaxed to one available version by one rule:

1. the newest release with the same major.minor as the pin (a later patch of the same line keeps
   its API; an earlier one is the line the release was developed against);
2. else the nearest release above the pin;
3. else the nearest release below it.

Pre-releases and development releases are candidates only when the pin is one itself. Only ``==``
pins whose environment marker holds for the venv are looked at; ranges are the resolver's job.
"""
from __future__ import annotations

import re
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterable

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.version import InvalidVersion, Version

SAME_MINOR = "the newest release of the same minor"
NEXT_ABOVE = "the nearest release above (none of the same minor)"
NEXT_BELOW = "the nearest release below (none of the same minor, none above)"


@dataclass(frozen=True)
class Relaxed:
    """One pin the index lacks, and the version that replaced it."""

    name: str
    pinned: str
    chosen: str
    rule: str
    requirement: str  # the replacement requirement, marker and extras kept

    def line(self) -> str:
        return f"relaxed pin {self.name}=={self.pinned} -> {self.name}=={self.chosen} " \
               f"(the index has no {self.pinned}; rule: {self.rule})"


def nearest_available(pinned: str, available: Iterable[str]) -> tuple[str, str] | None:
    """The version ``pinned`` is relaxed to among ``available`` and the rule that chose it; None when
    no candidate is left (the package is not on the index at all)."""
    want = Version(pinned)
    candidates = []
    for text in available:
        try:
            version = Version(text)
        except InvalidVersion:
            continue
        if version.is_prerelease and not want.is_prerelease:
            continue
        candidates.append((version, text))
    same_minor = [c for c in candidates if c[0].release[:2] == want.release[:2]]
    if same_minor:
        return max(same_minor)[1], SAME_MINOR
    above = [c for c in candidates if c[0] > want]
    if above:
        return min(above)[1], NEXT_ABOVE
    below = [c for c in candidates if c[0] < want]
    if below:
        return max(below)[1], NEXT_BELOW
    return None


def exact_pins(requirements: Iterable[str], python_version: str) -> list[tuple[str, Requirement, str]]:
    """``(text, parsed, version)`` for each requirement pinned with ``==`` to one version (no
    wildcard, no local label) whose marker holds on x86-64 Linux with ``python_version``."""
    environment = {**default_environment(), "python_version": python_version,
                   "python_full_version": f"{python_version}.0", "platform_machine": "x86_64",
                   "sys_platform": "linux", "platform_system": "Linux"}
    pins = []
    for text in requirements:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate(environment):
            continue
        specs = list(req.specifier)
        if len(specs) == 1 and specs[0].operator == "==" and not re.search(r"[*+]", specs[0].version):
            pins.append((text, req, specs[0].version))
    return pins


def relax_unavailable(requirements: list[str], versions_of: Callable[[str], list[str]],
                      python_version: str) -> tuple[list[str], list[Relaxed]]:
    """``requirements`` with each exact pin the index lacks replaced by the rule's choice, and what
    was replaced. ``versions_of(name)`` lists the versions the index serves (asked once per pin, in
    parallel). A pin is left as it is when the index lists nothing for its package; it is an error
    when the index lists versions of which none is a candidate."""
    pins = exact_pins(requirements, python_version)
    with ThreadPoolExecutor(max_workers=8) as pool:
        served = dict(zip([text for text, _, _ in pins], pool.map(lambda p: versions_of(p[1].name), pins)))
    relaxed, out = [], list(requirements)
    for text, req, pinned in pins:
        available = served[text]
        if not available:  # no answer (unreachable, or no such package): the installer will say which
            continue
        if any(Version(v) == Version(pinned) for v in available if _valid(v)):
            continue
        choice = nearest_available(pinned, available)
        if choice is None:
            raise SystemExit(f"{req.name}=={pinned} is pinned; the index lacks it and serves no release to relax it to")
        chosen, rule = choice
        extras = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
        marker = f"; {req.marker}" if req.marker is not None else ""
        replacement = f"{req.name}{extras}=={chosen}{marker}"
        out[out.index(text)] = replacement
        relaxed.append(Relaxed(req.name, pinned, chosen, rule, replacement))
    return out, relaxed


def _valid(text: str) -> bool:
    try:
        Version(text)
    except InvalidVersion:
        return False
    return True


def index_versions(pip_python: str, name: str, python_version: str) -> list[str]:
    """The versions of ``name`` pip's configured index and find-links serve as wheels for
    ``python_version`` on this platform (``pip index versions``); [] when it serves none."""
    proc = subprocess.run([pip_python, "-m", "pip", "index", "versions", "--pre", "--only-binary=:all:",
                           "--python-version", python_version, name], capture_output=True, text=True)
    match = re.search(r"^Available versions: (.*)$", proc.stdout, flags=re.MULTILINE)
    return [v.strip() for v in match.group(1).split(",")] if match else []
