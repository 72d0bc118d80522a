"""The branch a function takes for a string, read from its ``ast``: both readers use it, the static
one on the file, the live one on ``inspect.getsource`` of the imported function."""
from __future__ import annotations

import ast
from typing import NamedTuple


class Taken(NamedTuple):
    """What the branch builds: the plain name called first in it, the module a ``from x import name``
    inside the branch brought it from ('' when the name is the function's module's), and the line of
    the branch's test (in the parsed text)."""

    name: str
    module: str
    line: int


def tests_for(test: ast.expr, value: str) -> bool:
    """Whether ``test`` compares something with the string ``value``: ``x == value``, ``value == x``,
    ``x in ("a", value)``."""
    if not isinstance(test, ast.Compare) or len(test.ops) != 1:
        return False
    left, op, right = test.left, test.ops[0], test.comparators[0]
    if isinstance(op, ast.Eq):
        return any(isinstance(side, ast.Constant) and side.value == value for side in (left, right))
    if isinstance(op, ast.In) and isinstance(right, (ast.Tuple, ast.List, ast.Set)):
        return any(isinstance(elt, ast.Constant) and elt.value == value for elt in right.elts)
    return False


def taken(function: ast.AST, value: str) -> Taken | None:
    """The first branch (in source order) of ``function`` whose test compares with ``value``, and
    what it builds; None when there is no such branch or it calls no plain name."""
    branches = sorted((node for node in ast.walk(function) if isinstance(node, ast.If) and tests_for(node.test, value)),
                      key=lambda node: node.lineno)
    for branch in branches[:1]:
        imported = {alias.asname or alias.name: (node.module or "", alias.name)
                    for stmt in branch.body for node in ast.walk(stmt)
                    if isinstance(node, ast.ImportFrom) and not node.level for alias in node.names}
        for stmt in branch.body:
            for node in ast.walk(stmt):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                    module, name = imported.get(node.func.id, ("", node.func.id))
                    return Taken(name, module, branch.lineno)
        return Taken("", "", branch.lineno)
    return None


def returns_at_once(function: ast.AST, name: str) -> int | None:
    """The line of the first ``if`` among ``function``'s own statements whose test names ``name``
    (``x.mode == CompilationMode.NONE`` names ``NONE``, ``CompilationMode`` and ``mode``) and whose
    whole body is a bare ``return`` (or ``return None``); None when there is no such early return."""
    for stmt in getattr(function, "body", ()):
        if not isinstance(stmt, ast.If) or len(stmt.body) != 1 or not isinstance(stmt.body[0], ast.Return):
            continue
        value = stmt.body[0].value
        if value is not None and not (isinstance(value, ast.Constant) and value.value is None):
            continue
        named = {node.attr for node in ast.walk(stmt.test) if isinstance(node, ast.Attribute)}
        named |= {node.id for node in ast.walk(stmt.test) if isinstance(node, ast.Name)}
        if name in named:
            return stmt.lineno
    return None
