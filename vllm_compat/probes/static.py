"""The static reader: checks against vLLM's files read with ``ast``, never importing them.

It resolves ``"pkg.module:Class.attr"`` the way Python would, as far as source alone allows: names
re-exported through ``from x import y`` / ``from x import *`` are followed, and class attributes
are searched through the bases (depth first, left to right), so
``MultiprocExecutor.initialize_from_config`` is found on ``Executor`` in ``abstract.py``. The files
come from a :class:`Tree`: an installed package or source tree (:class:`DirTree`) or a wheel
(:class:`WheelTree`). The call-site audit (:mod:`vllm_compat.callsites`) builds on the same reader.
"""
from __future__ import annotations

import ast
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from .branches import returns_at_once, taken
from .shapes import (ABSENT, MISSING, OPTIONAL, PRESENT, REQUIRED, UNRESOLVED, Observation, address_of,
                     split_target)


class Tree(Protocol):
    label: str

    def read(self, relpath: str) -> str | None: ...


@dataclass
class DirTree:
    """Files under a directory that holds the top-level package (``root/vllm/...``)."""

    root: Path
    label: str = ""

    def read(self, relpath: str) -> str | None:
        path = self.root / relpath
        return path.read_text(encoding="utf-8", errors="replace") if path.is_file() else None


class WheelTree:
    """Files inside a wheel (a zip), read in place."""

    def __init__(self, path: Path):
        self.label = str(path)
        self._zip = zipfile.ZipFile(path)
        self._names = set(self._zip.namelist())

    def read(self, relpath: str) -> str | None:
        if relpath not in self._names:
            return None
        return self._zip.read(relpath).decode("utf-8", errors="replace")

    def names(self) -> set[str]:
        return self._names


@dataclass(frozen=True)
class Found:
    """A definition found in the files: its node, the module defining it and its file (the
    call-site audit, :mod:`vllm_compat.callsites`, walks the same nodes)."""

    node: ast.AST
    module: str
    file: str

    @property
    def where(self) -> str:
        # inspect.getsourcelines() starts at the first decorator: report the same line
        decorators = getattr(self.node, "decorator_list", None)
        line = decorators[0].lineno if decorators else getattr(self.node, "lineno", 0)
        return f"{self.file}:{line}"


class StaticSource:
    """Checks against source files, never importing them."""

    mode = "static"

    def __init__(self, tree: Tree):
        self.tree = tree
        self._modules: dict[str, tuple[ast.Module, str] | None] = {}

    # -- module and name resolution ------------------------------------------------------------
    def _module(self, name: str) -> tuple[ast.Module, str] | None:
        if name not in self._modules:
            base = name.replace(".", "/")
            self._modules[name] = None
            for rel in (f"{base}.py", f"{base}/__init__.py"):
                text = self.tree.read(rel)
                if text is not None:
                    try:
                        self._modules[name] = (ast.parse(text, filename=rel), rel)
                    except SyntaxError:
                        self._modules[name] = None
                    break
        return self._modules[name]

    @staticmethod
    def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        parts = module.split(".")
        keep = len(parts) - node.level + (1 if is_package else 0)
        prefix = ".".join(parts[:keep])
        return f"{prefix}.{node.module}" if node.module else prefix

    def _top_level(self, module: str, name: str, depth: int = 0) -> Found | None:
        loaded = self._module(module)
        if loaded is None or depth > 12:
            return None
        tree, rel = loaded
        is_package = rel.endswith("__init__.py")
        found: Found | None = None
        star_sources: list[str] = []
        for stmt in tree.body:
            for node in defining_nodes(stmt):
                if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                    found = Found(node, module, rel)
                elif isinstance(node, (ast.Assign, ast.AnnAssign)) and name in _assigned_names(node):
                    found = Found(node, module, rel)
                elif isinstance(node, ast.ImportFrom):
                    source = self._absolute(module, is_package, node)
                    for alias in node.names:
                        if alias.name == "*":
                            star_sources.append(source)
                        elif (alias.asname or alias.name) == name:
                            found = self._top_level(source, alias.name, depth + 1) or (
                                self._module_node(f"{source}.{alias.name}")
                            )
        if found is None:
            for source in star_sources:
                found = self._top_level(source, name, depth + 1)
                if found:
                    break
        return found

    def _module_node(self, module: str) -> Found | None:
        loaded = self._module(module)
        return Found(loaded[0], module, loaded[1]) if loaded else None

    def _resolve(self, target: str) -> Found | None:
        module, parts = split_target(target)
        if not parts:
            return self._module_node(module)
        found = self._top_level(module, parts[0])
        for part in parts[1:]:
            if found is None or not isinstance(found.node, ast.ClassDef):
                return None
            found = self._class_member(found, part)
        return found

    def _bases(self, klass: Found) -> list[Found]:
        bases = []
        for expr in klass.node.bases:  # type: ignore[attr-defined]
            if isinstance(expr, ast.Name):
                base = self._top_level(klass.module, expr.id)
            elif isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name):
                mod = self._top_level(klass.module, expr.value.id)
                base = self._top_level(mod.module, expr.attr) if mod and isinstance(mod.node, ast.Module) else None
            else:
                base = None
            if base is not None and isinstance(base.node, ast.ClassDef):
                bases.append(base)
        return bases

    def _class_member(self, klass: Found, name: str, depth: int = 0) -> Found | None:
        for stmt in klass.node.body:  # type: ignore[attr-defined]
            for node in defining_nodes(stmt):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
                    return Found(node, klass.module, klass.file)
                if isinstance(node, (ast.Assign, ast.AnnAssign)) and name in _assigned_names(node):
                    return Found(node, klass.module, klass.file)
        if depth < 12:
            for base in self._bases(klass):
                found = self._class_member(base, name, depth + 1)
                if found:
                    return found
        return None

    # -- observations -------------------------------------------------------------------------
    def exists(self, target: str) -> Observation:
        found = self._resolve(target)
        return Observation(PRESENT, found.where) if found else Observation(MISSING)

    def param(self, target: str, name: str) -> Observation:
        found = self._resolve(target)
        if found is None or not isinstance(found.node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return Observation(MISSING, found.where if found else "")
        args = found.node.args
        positional = args.posonlyargs + args.args
        first_default = len(positional) - len(args.defaults)
        for i, arg in enumerate(positional):
            if arg.arg == name:
                return Observation(REQUIRED if i < first_default else OPTIONAL, found.where)
        for arg, default in zip(args.kwonlyargs, args.kw_defaults):
            if arg.arg == name:
                return Observation(REQUIRED if default is None else OPTIONAL, found.where)
        return Observation(ABSENT, found.where)

    def attr(self, target: str, name: str) -> Observation:
        found = self._resolve(target)
        if found is None:
            return Observation(MISSING)
        if isinstance(found.node, ast.ClassDef):
            member = self._class_member(found, name)
        else:
            member = self._top_level(found.module, name) if isinstance(found.node, ast.Module) else None
        return Observation(PRESENT, member.where) if member else Observation(ABSENT, found.where)

    def field_default(self, target: str, name: str) -> Observation:
        found = self._resolve(target)
        if found is None or not isinstance(found.node, ast.ClassDef):
            return Observation(MISSING)
        member = self._class_member(found, name)
        if member is None or not isinstance(member.node, ast.AnnAssign):
            return Observation(ABSENT, found.where)
        return Observation(default_repr(member.node.value), found.where)

    # -- strings vLLM resolves ------------------------------------------------------------------
    def literal_member(self, target: str, value: str) -> Observation:
        found = self._resolve(target)
        if found is None:
            return Observation(MISSING)
        values = self._literal_values(found, 0)
        return Observation(PRESENT if value in values else ABSENT, found.where)

    def _literal_values(self, found: Found, depth: int) -> set[str]:
        """The strings of the ``Literal[...]`` assigned at ``found``, nested Literals (by name or
        inline) followed."""
        node = found.node
        expr = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        return self._literal_expr(expr, found.module, depth) if expr is not None and depth < 12 else set()

    def _literal_expr(self, expr: ast.expr, module: str, depth: int) -> set[str]:
        if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
            return {expr.value}
        if isinstance(expr, ast.Name):
            inner = self._top_level(module, expr.id)
            return self._literal_values(inner, depth + 1) if inner else set()
        if isinstance(expr, ast.Subscript) and _call_name_of(expr.value) == "Literal":
            items = expr.slice.elts if isinstance(expr.slice, ast.Tuple) else [expr.slice]
            return set().union(*(self._literal_expr(item, module, depth) for item in items))
        return set()

    def registered(self, target: str, key: str, via: str) -> Observation:
        found = self._resolve(target)
        if found is None:
            return Observation(MISSING)
        node = found.node
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Dict):
            for k, v in zip(node.value.keys, node.value.values):
                if k is not None and self._string(k, found.module) == key:
                    qualname = self._string(v, found.module)
                    return Observation(address_of(qualname) if qualname else UNRESOLVED, f"{found.file}:{k.lineno}")
        if via:
            loaded = self._module(found.module)
            for stmt in loaded[0].body if loaded else []:
                for inner in defining_nodes(stmt):
                    call = inner.value if isinstance(inner, ast.Expr) else None
                    if not isinstance(call, ast.Call) or _call_name(call) != via or not call.args:
                        continue
                    if self._string(call.args[0], found.module) != key:
                        continue
                    rest = [*call.args[1:], *(keyword.value for keyword in call.keywords)]  # module, class
                    parts = [self._string(arg, found.module) for arg in rest]
                    where = f"{found.file}:{call.lineno}"
                    if None in parts or len(parts) not in (1, 2):
                        return Observation(UNRESOLVED, where)
                    return Observation(address_of(":".join(parts)), where)
        return Observation(ABSENT, found.where)

    def named(self, target: str) -> Observation:
        found = self._resolve(target)
        if found is None:
            return Observation(MISSING)
        node = found.node
        assigned = isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None
        qualname = self._string(node.value, found.module) if assigned else None
        return Observation(address_of(qualname), found.where) if qualname else Observation(ABSENT, found.where)

    def early_return(self, target: str, name: str) -> Observation:
        found = self._resolve(target)
        if found is None or not isinstance(found.node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return Observation(MISSING)
        line = returns_at_once(found.node, name)
        return Observation(PRESENT, f"{found.file}:{line}") if line else Observation(ABSENT, found.where)

    def branch(self, target: str, value: str) -> Observation:
        found = self._resolve(target)
        if found is None or not isinstance(found.node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return Observation(MISSING)
        hit = taken(found.node, value)
        if hit is None or not hit.name:
            return Observation(ABSENT, found.where if hit is None else f"{found.file}:{hit.line}")
        where = f"{found.file}:{hit.line}"
        if hit.module:
            return Observation(f"{hit.module}:{hit.name}", where)
        defined = self._top_level(found.module, hit.name)
        if defined is None or isinstance(defined.node, ast.Module):
            return Observation(UNRESOLVED, where)
        return Observation(f"{defined.module}:{getattr(defined.node, 'name', hit.name)}", where)

    def _string(self, expr: ast.expr, module: str, bound: dict[str, str] | None = None, depth: int = 0) -> str | None:
        """The string ``expr`` evaluates to, as far as source shows it: literals, f-strings, ``+``,
        module-level string constants and calls of module-level one-line helper functions
        (``def _builtin(module, name): return f"{_PKG}.{module}.{name}"``); None otherwise."""
        bound = bound or {}
        if depth > 12:
            return None
        if isinstance(expr, ast.Constant):
            return expr.value if isinstance(expr.value, str) else None
        if isinstance(expr, ast.Name):
            if expr.id in bound:
                return bound[expr.id]
            found = self._top_level(module, expr.id)
            if found is None or not isinstance(found.node, (ast.Assign, ast.AnnAssign)) or found.node.value is None:
                return None
            return self._string(found.node.value, found.module, None, depth + 1)
        if isinstance(expr, ast.JoinedStr):
            parts = [self._string(v.value if isinstance(v, ast.FormattedValue) else v, module, bound, depth + 1)
                     for v in expr.values]
            return None if None in parts else "".join(parts)
        if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.Add):
            left, right = (self._string(side, module, bound, depth + 1) for side in (expr.left, expr.right))
            return None if left is None or right is None else left + right
        if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and not expr.keywords:
            helper = self._top_level(module, expr.func.id)
            if helper is None or not isinstance(helper.node, ast.FunctionDef):
                return None
            body = [stmt for stmt in helper.node.body
                    if not (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant))]  # the docstring
            params = [arg.arg for arg in helper.node.args.args]
            one_return = len(body) == 1 and isinstance(body[0], ast.Return) and body[0].value is not None
            if not one_return or len(params) != len(expr.args):
                return None
            args = [self._string(arg, module, bound, depth + 1) for arg in expr.args]
            if None in args:
                return None
            return self._string(body[0].value, helper.module, dict(zip(params, args)), depth + 1)
        return None


def _call_name_of(expr: ast.expr) -> str:
    return expr.id if isinstance(expr, ast.Name) else expr.attr if isinstance(expr, ast.Attribute) else ""


def defining_nodes(stmt: ast.stmt):
    """The statement, or for ``if``/``try`` blocks at module or class level, the statements inside."""
    if isinstance(stmt, ast.If):
        for inner in stmt.body + stmt.orelse:
            yield from defining_nodes(inner)
    elif isinstance(stmt, ast.Try):
        for inner in stmt.body + stmt.orelse + stmt.finalbody:
            yield from defining_nodes(inner)
    else:
        yield stmt


def _assigned_names(node: ast.Assign | ast.AnnAssign) -> set[str]:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    names = set()
    for target in targets:
        for sub in ast.walk(target):
            if isinstance(sub, ast.Name):
                names.add(sub.id)
    return names


def default_repr(value: ast.expr | None) -> str:
    """repr() of a dataclass field's default as the live object would show it."""
    if value is None:
        return REQUIRED
    if isinstance(value, ast.Call) and _call_name(value) in {"field", "Field"}:
        for kw in value.keywords:
            if kw.arg == "default":
                return default_repr(kw.value)
            if kw.arg == "default_factory":
                return "<factory>"
        if value.args and _call_name(value) == "Field":  # pydantic: Field(default, ...)
            return default_repr(value.args[0])
        return REQUIRED
    try:
        return repr(ast.literal_eval(value))
    except ValueError:
        return ast.unparse(value)


def _call_name(call: ast.Call) -> str:
    return _call_name_of(call.func)
