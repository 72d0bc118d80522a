"""Planted drift in a released vLLM's source, without copying it: an overlay :class:`Tree` for the
audit's readers, and a ``vllm/`` folder of symlinks (with the patched files written in place) for the
``vllm-compat audit --vllm DIR`` command line."""
from __future__ import annotations

import os
from pathlib import Path

from tests.conftest import CACHE

# the matrix's cache (VLLM_COMPAT_CACHE, else the checkout's .cache/): its venvs and speculators folders
VENVS = Path(CACHE) / "venvs"
SITE_0340 = VENVS / "vllm-0.34.0-cuda" / "lib" / "python3.11" / "site-packages"
HS = Path(CACHE) / "speculators" / "0.9.0" / "hs_connectors"


class OverlayTree:
    """``tree``'s files, with some replaced."""

    def __init__(self, tree, replaced: dict[str, str]):
        self.tree, self.replaced, self.label = tree, replaced, tree.label

    def read(self, relpath):
        return self.replaced.get(relpath, self.tree.read(relpath))


def line_of(text: str, needle: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if needle in line)


def plant(site: Path, relpath: str, old: str, new: str) -> dict[str, str]:
    """{relpath: the file with its one ``old`` replaced by ``new``}; fails when ``old`` is not there once."""
    text = (site / relpath).read_text()
    assert text.count(old) == 1, f"{relpath} changed shape: the planted drift needs a new anchor ({old!r})"
    return {relpath: text.replace(old, new)}


def symlinked(site: Path, into: Path, replaced: dict[str, str]) -> Path:
    """``into``/vllm/: links to ``site``/vllm/'s entries; the folders above each replaced file are real
    folders of links, and the replaced files are written in place. Returns ``into``."""
    real = {Path(rel).parent for rel in replaced}
    real |= {parent for folder in list(real) for parent in folder.parents if parent != Path(".")}

    def fill(rel: Path) -> None:
        (into / rel).mkdir(parents=True, exist_ok=True)
        for entry in sorted((site / rel).iterdir()):
            name = rel / entry.name
            if name in real:
                fill(name)
            elif name.as_posix() not in replaced:
                os.symlink(entry, into / name)
    fill(Path("vllm"))
    for rel, text in replaced.items():
        (into / rel).write_text(text)
    return into
