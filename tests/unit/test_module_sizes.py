"""The extractor stays readable in pieces: no file in ``hidden_states/`` over 400 lines, no class
over 250 (a file that grows past them is split by job, as ``run/``, ``extract/`` and ``generate/``
were). The check is shown to catch both on planted files."""
from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import ROOT

MAX_FILE_LINES = 400
MAX_CLASS_LINES = 250


def oversized(package: Path) -> list[str]:
    """Each file over MAX_FILE_LINES and each class over MAX_CLASS_LINES under ``package``."""
    found = []
    for path in sorted(package.rglob("*.py")):
        text = path.read_text()
        lines = len(text.splitlines())
        if lines > MAX_FILE_LINES:
            found.append(f"{path.relative_to(package.parent)}: {lines} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                found.append(f"{path.relative_to(package.parent)}: class {node.name}, "
                             f"{node.end_lineno - node.lineno + 1} lines")
    return found


def test_no_extractor_file_or_class_is_oversized():
    assert oversized(Path(ROOT) / "hidden_states") == []


def test_the_check_finds_a_long_file_and_a_long_class(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "short.py").write_text("x = 1\n")
    (package / "long.py").write_text("x = 1\n" * (MAX_FILE_LINES + 1))
    (package / "big_class.py").write_text("class Big:\n" + "    x = 1\n" * MAX_CLASS_LINES)
    assert oversized(package) == ["pkg/big_class.py: class Big, 251 lines", "pkg/long.py: 401 lines"]
