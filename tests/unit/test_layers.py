"""The layers of vllm_compat and of hidden_states (docs/architecture.md; the map is
``tests/unit/layer_map.py``), read with ``ast`` so the map cannot rot:

* inside each package, a module imports only from its own layer or the layers below it; every
  import counts, at module level or inside a function (imports under ``if TYPE_CHECKING:`` are
  annotations, not dependencies, and are exempt);
* no import circle between its modules, in either package (function-level and type-only imports
  included: an import deferred into a function still needs the other module whole when it runs);
* outside it (hidden_states/, bench/, scripts/, tests/), nothing imports a private module
  (``vllm_compat._x``), nor names one in a string (a post-import hook, code run in a subprocess).
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.unit.layer_map import EXTRACTOR_ALLOWED, EXTRACTOR_LAYERS, LAYERS

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "vllm_compat"

OUTSIDE = ("hidden_states", "bench", "scripts", "tests")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str, layers=LAYERS) -> int:
    """Index into ``layers`` of ``package.x...``."""
    parts = module.split(".")
    head = parts[1] if len(parts) > 1 else "__init__"
    for index, (_, names) in enumerate(layers):
        if head in names:
            return index
    raise AssertionError(f"{module} belongs to no layer: add it to the layers here (and to docs/architecture.md)")


def _type_only(tree: ast.Module) -> set[int]:
    """ids of the import nodes inside ``if TYPE_CHECKING:`` blocks."""
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            ids |= {id(sub) for stmt in node.body for sub in ast.walk(stmt)}
    return ids


def imports(module: str, tree: ast.Module, is_package: bool) -> list[tuple[str, bool, int]]:
    """(imported module of ``module``'s own package, type only, line) for every import in ``tree``."""
    type_only = _type_only(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            # `from . import x` imports the module x; `from .x import y` imports from x
            targets = [f"{source}.{a.name}" for a in node.names if _is_module(f"{source}.{a.name}")] or [source]
        else:
            continue
        package = module.split(".")[0]
        found += [(t, id(node) in type_only, node.lineno) for t in targets if t.split(".")[0] == package]
    return found


def _is_module(dotted: str) -> bool:
    path = ROOT.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def package_modules(package: Path = PACKAGE) -> dict[str, tuple[ast.Module, bool]]:
    return {module_name(p): (ast.parse(p.read_text(encoding="utf-8")), p.name == "__init__.py")
            for p in sorted(package.rglob("*.py"))}


def layer_violations(modules: dict[str, tuple[ast.Module, bool]], layers=LAYERS, allowed=frozenset()) -> list[str]:
    bad = []
    for module, (tree, is_package) in modules.items():
        own = layer_of(module, layers)
        for target, type_only, line in imports(module, tree, is_package):
            if not type_only and layer_of(target, layers) > own and (module, target) not in allowed:
                bad.append(f"{module}:{line} ({layers[own][0]}) imports {target} ({layers[layer_of(target, layers)][0]})")
    return bad


def cycles(modules: dict[str, tuple[ast.Module, bool]]) -> list[list[str]]:
    graph = {m: sorted({t for t, _, _ in imports(m, tree, pkg) if t in modules and t != m})
             for m, (tree, pkg) in modules.items()}
    found, state = [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in graph[node]:
            if state.get(nxt) == "open":
                found.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for module in graph:
        if module not in state:
            visit(module, [module])
    return found


_NAMED = re.compile(r"\bvllm_compat(?:\.\w+)+")


def private_module(dotted: str) -> str | None:
    """The private vllm_compat module ``dotted`` reaches into (``vllm_compat._x``), or None."""
    path = ROOT
    for part in dotted.split("."):
        if not (path / part / "__init__.py").is_file() and not (path / f"{part}.py").is_file():
            return None
        if part.startswith("_") and not part.startswith("__"):
            return dotted[: dotted.index(part) + len(part)]
        path = path / part
    return None


def private_uses(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, private module) for each import of, or string naming, a private vllm_compat module."""
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = _NAMED.findall(node.value)
        found += [(node.lineno, hit) for hit in map(private_module, names) if hit]
    return found


def test_every_module_has_a_layer_and_imports_only_downwards():
    assert layer_violations(package_modules()) == []


def test_no_import_circle_inside_the_package():
    assert cycles(package_modules()) == []


def test_the_extractor_imports_only_downwards():
    modules = package_modules(ROOT / "hidden_states")
    assert layer_violations(modules, EXTRACTOR_LAYERS, EXTRACTOR_ALLOWED) == []


def test_no_import_circle_inside_the_extractor():
    assert cycles(package_modules(ROOT / "hidden_states")) == []


def test_the_extractor_checks_catch_what_they_look_for():
    """Negative proof on planted modules: an upward import fails the layer check whether it sits at
    module level or inside a function; a circle closed by a function-level import fails the circle
    check; the CLI's one allowed import and a type-only one pass."""
    def planted(sources: dict[str, str]) -> dict[str, tuple[ast.Module, bool]]:
        return {f"hidden_states.{name}": (ast.parse(source), False) for name, source in sources.items()}

    upward = planted({
        "inputs.conversations": "from ..plan.preflight import human_size\n",  # inputs -> plan, at module level
        "inputs.tokenization": "def f():\n    from ..layer_conventions import X\n    from ..output import Y\n",  # -> output
        "backends.planted": "def f():\n    from ..output.formats.speculators_05 import StreamedFile\n",  # -> output
        "output": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .extraction import Extraction\n",
        "cli.tools": "def demo():\n    from ..fixtures.demo import run\n",
    })
    assert [v.split(" ")[0] for v in layer_violations(upward, EXTRACTOR_LAYERS, EXTRACTOR_ALLOWED)] == [
        "hidden_states.inputs.conversations:1", "hidden_states.inputs.tokenization:3",
        "hidden_states.backends.planted:2"]
    circle = planted({"inputs.identity": "from .conversations import open_source\n",
                      "inputs.conversations": "def digest():\n    from .identity import sha256_of\n"})
    assert cycles(circle) == [["hidden_states.inputs.identity", "hidden_states.inputs.conversations",
                               "hidden_states.inputs.identity"]]
    assert layer_violations(circle, EXTRACTOR_LAYERS) == []  # one layer: only the circle check sees it


@pytest.mark.parametrize("top", OUTSIDE)
def test_nothing_outside_imports_a_private_module(top):
    bad = [f"{path.relative_to(ROOT)}:{line}: {name}"
           for path in sorted((ROOT / top).rglob("*.py")) if ".cache" not in path.parts
           for line, name in private_uses(ast.parse(path.read_text(encoding="utf-8")))]
    assert bad == [], "use the public module (docs/usage.md, 'What other code may use')"


def test_the_checks_catch_what_they_look_for():
    private = "vllm_compat." + "_transformers_source"  # spelled in two pieces: this file is scanned too
    planted = ast.parse(f"import {private}\n"
                        f"from vllm_compat import {private.split('.')[1]}\n"
                        f"hook = '{private}'\n"
                        "fine = 'vllm_compat.transport._segment'\n"  # a private name, not a private module
                        "from vllm_compat.transport import to_host\n")
    assert [line for line, _ in private_uses(planted)] == [1, 2, 3]
    upward = {"vllm_compat.probes.planted": (ast.parse("from ..registry import apply\n"), False),
              "vllm_compat.adapters.planted": (ast.parse("from ..audit import audit\n"), False),
              "vllm_compat.probes.typed": (ast.parse("from typing import TYPE_CHECKING\n"
                                                     "if TYPE_CHECKING:\n    from ..adapter import Adapter\n"), False)}
    assert len(layer_violations(upward)) == 2
    circle = {"vllm_compat.probes.a": (ast.parse("from .b import x\n"), False),
              "vllm_compat.probes.b": (ast.parse("if TYPE_CHECKING:\n    from .a import y\n"), False)}
    assert cycles(circle) == [["vllm_compat.probes.a", "vllm_compat.probes.b", "vllm_compat.probes.a"]]
