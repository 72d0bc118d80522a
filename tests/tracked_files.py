"""The files a checkout of the repository tracks, and the text of each (support module of the unit
tests that read the whole repository: tests/unit/test_docs.py, tests/unit/test_repository_speaks_of_itself.py)."""
from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# what a copied working tree (not a git checkout) is read as: the folders and files a checkout tracks
TRACKED_DIRS = ("vllm_compat", "hidden_states", "scripts", "tests", "bench", "docs", ".ci")
TRACKED_TOP = ("README.md", "CHANGELOG.md", "pyproject.toml")


def tracked_files() -> list[str]:
    """Paths relative to the repository's root, sorted."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True)
    if listed.returncode == 0:
        return sorted(name for name in listed.stdout.split("\0") if name)
    found = [p for d in TRACKED_DIRS for p in (ROOT / d).rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    return sorted([str(p.relative_to(ROOT)) for p in found] + list(TRACKED_TOP))


def tracked_texts():
    """(path, text) of every tracked text file: binary ones (a NUL early on, or not UTF-8) and files
    deleted but not yet committed are left out."""
    for name in tracked_files():
        path = ROOT / name
        if not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue
        try:
            yield name, data.decode("utf-8")
        except UnicodeDecodeError:
            continue
