"""The backends' two sides (docs/architecture.md): the worker side (``hidden_states/backends/worker/``,
imported inside vLLM's processes by the dotted paths the parent hands vLLM) imports only itself,
``backends/shared/`` and what lies outside ``backends``, never the parent side (``backends``' own
modules, its ``__init__`` included); ``backends/shared/`` imports neither side. Read with ``ast``,
every import counted, at module level or inside a function."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from hidden_states.backends import vllm_engine
from tests.conftest import ROOT

BACKENDS = "hidden_states.backends"
WORKER, SHARED = f"{BACKENDS}.worker", f"{BACKENDS}.shared"
# what each side may import of hidden_states.backends
MAY_IMPORT = {WORKER: (WORKER, SHARED), SHARED: (SHARED,)}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(dotted: str) -> bool:
    path = Path(ROOT).joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imported(module: str, source: str, is_package: bool = False) -> list[tuple[str, int]]:
    """(module imported, line) for every import in ``source`` (``module``'s), relative ones resolved."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")
                parts = parts[: len(parts) - node.level + (1 if is_package else 0)]
                base = ".".join(parts + ([node.module] if node.module else []))
            # `from . import x` imports the module x; `from .x import y` imports from x
            found += [(t, node.lineno) for t in
                      ([f"{base}.{a.name}" for a in node.names if is_module(f"{base}.{a.name}")] or [base])]
    return found


def side_of(module: str) -> str | None:
    """WORKER, SHARED, or None (the parent side) for a module of hidden_states.backends."""
    return next((side for side in (WORKER, SHARED) if module == side or module.startswith(f"{side}.")), None)


def violations(module: str, source: str, is_package: bool = False) -> list[str]:
    side = side_of(module)
    if side is None:
        return []
    return [f"{module}:{line} imports {target}" for target, line in imported(module, source, is_package)
            if (target == BACKENDS or target.startswith(f"{BACKENDS}."))
            and not any(target == allowed or target.startswith(f"{allowed}.") for allowed in MAY_IMPORT[side])]


def backend_modules() -> dict[str, tuple[str, bool]]:
    folder = Path(ROOT) / "hidden_states" / "backends"
    return {module_name(p): (p.read_text(encoding="utf-8"), p.name == "__init__.py") for p in sorted(folder.rglob("*.py"))}


def test_the_worker_side_never_imports_the_parent_side():
    modules = backend_modules()
    assert any(side_of(m) == WORKER for m in modules) and any(side_of(m) == SHARED for m in modules)
    found = [v for module, (source, is_package) in modules.items() for v in violations(module, source, is_package)]
    assert found == [], "\n".join(found)


@pytest.mark.parametrize("module, source, caught", [
    (f"{WORKER}.planted", "def f():\n    from ..vllm_engine import EXTENSIONS\n", [f"{BACKENDS}.vllm_engine"]),
    (f"{WORKER}.planted", "from .. import BackendSettings\n", [BACKENDS]),
    (f"{WORKER}.planted", "import hidden_states.backends.engine_feed\n", [f"{BACKENDS}.engine_feed"]),
    (f"{WORKER}.planted", "from hidden_states.backends import engine_base\n", [f"{BACKENDS}.engine_base"]),
    (f"{SHARED}.planted", "from ..worker.engine_capture import StreamingStates\n", [f"{WORKER}.engine_capture"]),
    (f"{SHARED}.planted", "def f():\n    from .. import vllm_engine\n", [f"{BACKENDS}.vllm_engine"]),
    (f"{WORKER}.planted", "from ..shared.regions import HEADER\nfrom . import engine_capture\n"
                          "from ... import fp8_states\nfrom ...errors import ExtractError\n", []),
    (f"{BACKENDS}.planted", "from .worker import engine_capture\nfrom . import Backend\n", []),  # the parent may
])
def test_the_check_catches_what_it_looks_for(module, source, caught):
    assert [v.split(" imports ")[1] for v in violations(module, source)] == caught


def test_the_classes_handed_to_vllm_are_on_the_worker_side():
    """What ``vllm_engine`` names to vLLM (``worker_extension_cls``) is a class of a module under
    ``backends/worker/`` (read, not imported: speculators' capture imports speculators)."""
    handed = [*vllm_engine.EXTENSIONS.values(), vllm_engine.GRAPH_EXTENSION]
    for path in handed:
        module, _, cls = path.rpartition(".")
        assert side_of(module) == WORKER and is_module(module), path
        tree = ast.parse((Path(ROOT).joinpath(*module.split(".")).with_suffix(".py")).read_text(encoding="utf-8"))
        assert cls in {node.name for node in tree.body if isinstance(node, ast.ClassDef)}, path
