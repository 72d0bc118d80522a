"""No file under tests/ imports a test module: what several tests share lives in support modules
(``tests/unit/fakes.py``, ``tests/e2e/harness.py``, a folder's ``conftest.py``, ...), so each test
module can be read, run, moved or deleted on its own.

Read with ``ast``, so imports inside functions count, and so does ``importlib.import_module`` (or
``__import__``) of a literal or an f-string that names a ``test_`` module."""
from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def names_a_test_module(dotted: str) -> bool:
    """Whether a dotted module name (an f-string's fields read as ``{}``) has a ``test_`` part."""
    return any(part.startswith("test_") for part in dotted.split("."))


def literal_text(node: ast.expr) -> str | None:
    """The text of a string literal or an f-string (its fields as ``{}``); None for anything else."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(part.value if isinstance(part, ast.Constant) else "{}" for part in node.values)
    return None


def is_dynamic_import(call: ast.Call) -> bool:
    function = call.func
    name = function.attr if isinstance(function, ast.Attribute) else getattr(function, "id", "")
    return name in ("import_module", "__import__")


def imports_of_test_modules(path: Path) -> list[tuple[int, str]]:
    """Each (line, imported name) in ``path`` that names a test module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names if names_a_test_module(alias.name)]
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            if node.module and names_a_test_module(node.module):
                found.append((node.lineno, base))
            else:  # ``from tests.e2e import test_generate``: the imported name is the module
                found += [(node.lineno, f"{base}.{alias.name}".replace("..", "."))
                          for alias in node.names if alias.name.startswith("test_")]
        elif isinstance(node, ast.Call) and is_dynamic_import(node) and node.args:
            text = literal_text(node.args[0])
            if text is not None and names_a_test_module(text):
                found.append((node.lineno, text))
    return found


def violations(root: Path) -> list[str]:
    """``file:line imports name`` for every import of a test module by any Python file under ``root``."""
    return [f"{path.relative_to(root.parent)}:{line} imports {name}"
            for path in sorted(root.rglob("*.py")) if "__pycache__" not in path.parts
            for line, name in imports_of_test_modules(path)]


def test_no_file_under_tests_imports_a_test_module():
    found = violations(TESTS)
    assert not found, ("a test module is imported; move what is shared into a support module "
                       "(tests/unit/fakes.py, tests/e2e/harness.py, a conftest.py, ...):\n" + "\n".join(found))


def test_every_way_of_importing_a_test_module_is_found(tmp_path):
    """Planted violations, one per form, each named by file and line; support-module imports pass."""
    root = tmp_path / "tests"
    (root / "unit").mkdir(parents=True)
    (root / "unit" / "fakes.py").write_text("from tests.unit import helpers\n")
    (root / "unit" / "test_clean.py").write_text(
        "import importlib\n"
        "from tests.unit.fakes import FakeBackend\n"
        "from tests.e2e import harness\n"
        "importlib.import_module('hidden_states.backends.worker.engine_capture')\n")
    (root / "unit" / "test_planted.py").write_text(
        "import importlib\n"
        "from tests.unit.test_other import FakeBackend\n"          # 2: from a test module
        "from tests.e2e import test_generate as single\n"         # 3: a test module by name
        "import tests.contract.test_audit\n"                      # 4: import of one
        "from .test_sibling import job\n"                         # 5: relative
        "\n"
        "def helper(adapter_id):\n"
        "    from tests.unit.test_replicas import FakeRay\n"      # 8: inside a function
        "    importlib.import_module(f'tests.contract.test_{adapter_id}')\n"  # 9: an f-string
        "    return __import__('test_layers')\n")                 # 10: __import__ of a literal
    (root / "unit" / "conftest.py").write_text("from tests.unit.test_other import job\n")

    assert violations(root) == [
        "tests/unit/conftest.py:1 imports tests.unit.test_other",
        "tests/unit/test_planted.py:2 imports tests.unit.test_other",
        "tests/unit/test_planted.py:3 imports tests.e2e.test_generate",
        "tests/unit/test_planted.py:4 imports tests.contract.test_audit",
        "tests/unit/test_planted.py:5 imports .test_sibling",
        "tests/unit/test_planted.py:8 imports tests.unit.test_replicas",
        "tests/unit/test_planted.py:9 imports tests.contract.test_{}",
        "tests/unit/test_planted.py:10 imports test_layers",
    ]
