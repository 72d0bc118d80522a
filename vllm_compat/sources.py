"""Where shape checks look: the live, imported vLLM, or vLLM's files read with ``ast``.

The static reader resolves ``"pkg.module:Class.attr"`` the way Python would, as far as source
alone allows: names re-exported through ``from x import y`` / ``from x import *`` are followed,
and class attributes are searched through the bases (depth first, left to right), so
``MultiprocExecutor.initialize_from_config`` is found on ``Executor`` in ``abstract.py``.
"""
from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import zipfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol

from .shapes import ABSENT, MISSING, OPTIONAL, PRESENT, REQUIRED, Observation


class Source(Protocol):
    mode: str

    def exists(self, target: str) -> Observation: ...
    def param(self, target: str, name: str) -> Observation: ...
    def attr(self, target: str, name: str) -> Observation: ...
    def field_default(self, target: str, name: str) -> Observation: ...


def split_target(target: str) -> tuple[str, list[str]]:
    module, _, qualname = target.partition(":")
    return module, [part for part in qualname.split(".") if part]


class AliasedSource:
    """Another source, seen as it is once a bridging adapter has put moved names back.

    ``aliases`` maps an old address to where the name lives now (``Patch.alias_of``). A check on a
    name that is missing at its old address, or on a member of it, reads the new address instead;
    names still present where they were are read there.
    """

    def __init__(self, inner: Source, aliases: dict[str, str]):
        self.inner, self.aliases, self.mode = inner, aliases, inner.mode

    def redirect(self, target: str) -> str:
        """``target``, or where it lives now when it is read through a moved name."""
        module, parts = split_target(target)
        head = f"{module}:{parts[0]}" if parts else target
        if head not in self.aliases or self.inner.exists(head).value != MISSING:
            return target
        return self.aliases[head] + "".join(f".{part}" for part in parts[1:])

    def exists(self, target: str) -> Observation:
        return self.inner.exists(self.redirect(target))

    def param(self, target: str, name: str) -> Observation:
        return self.inner.param(self.redirect(target), name)

    def attr(self, target: str, name: str) -> Observation:
        return self.inner.attr(self.redirect(target), name)

    def field_default(self, target: str, name: str) -> Observation:
        return self.inner.field_default(self.redirect(target), name)


# --------------------------------------------------------------------------------------------
# live


def _proxy_types() -> tuple[type, ...]:
    import wrapt

    names = ("ObjectProxy", "BaseObjectProxy")  # wrapt 1.x / 2.x
    return tuple(getattr(wrapt, n) for n in names if hasattr(wrapt, n))


def _unwrap(obj: Any) -> Any:
    """Look through wrapt proxies (ours or anyone's) to the object they wrap."""
    proxies = _proxy_types()
    while issubclass(type(obj), proxies):
        obj = obj.__wrapped__
    return obj


def _where(obj: Any) -> str:
    try:
        path = inspect.getsourcefile(obj) or ""
        line = inspect.getsourcelines(obj)[1]
    except (OSError, TypeError):
        return ""
    parts = Path(path).parts
    for top in ("vllm", "speculators"):
        if top in parts:
            path = "/".join(parts[len(parts) - 1 - parts[::-1].index(top):])
            break
    return f"{path}:{line}"


class LiveSource:
    """Checks against the imported objects. Importing vLLM modules is slow (tens of seconds)."""

    mode = "live"

    def _resolve(self, target: str) -> tuple[Any, Any] | None:
        """(parent, object) for a target, or None if the module or an attribute is missing."""
        module_name, parts = split_target(target)
        try:
            obj: Any = importlib.import_module(module_name)
        except ImportError:
            return None
        parent = None
        for part in parts:
            parent = obj
            if isinstance(obj, type):
                for klass in obj.__mro__:
                    if part in vars(klass):
                        obj = vars(klass)[part]
                        break
                else:
                    return None
            elif hasattr(obj, part):
                obj = getattr(obj, part)
            else:
                return None
        return parent, _unwrap(obj)

    def exists(self, target: str) -> Observation:
        found = self._resolve(target)
        return Observation(PRESENT, _where(found[1])) if found else Observation(MISSING)

    def param(self, target: str, name: str) -> Observation:
        found = self._resolve(target)
        if found is None:
            return Observation(MISSING)
        func = found[1]
        if isinstance(func, (staticmethod, classmethod)):
            func = func.__func__
        try:
            params = inspect.signature(func).parameters
        except (TypeError, ValueError):
            return Observation(MISSING, _where(func))
        if name not in params:
            return Observation(ABSENT, _where(func))
        required = params[name].default is inspect.Parameter.empty and params[name].kind not in (
            inspect.Parameter.VAR_POSITIONAL,
            inspect.Parameter.VAR_KEYWORD,
        )
        return Observation(REQUIRED if required else OPTIONAL, _where(func))

    def attr(self, target: str, name: str) -> Observation:
        found = self._resolve(target)
        if found is None:
            return Observation(MISSING)
        obj = found[1]
        if isinstance(obj, type):
            for klass in obj.__mro__:
                if name in vars(klass):
                    return Observation(PRESENT, _where(_unwrap(vars(klass)[name])) or _where(klass))
            return Observation(ABSENT, _where(obj))
        return Observation(PRESENT if hasattr(obj, name) else ABSENT, _where(obj))

    def field_default(self, target: str, name: str) -> Observation:
        found = self._resolve(target)
        if found is None:
            return Observation(MISSING)
        cls = found[1]
        fields = getattr(cls, "__dataclass_fields__", {})
        if name not in fields:
            return Observation(ABSENT, _where(cls))
        f = fields[name]
        default = f.default
        if default is dataclasses.MISSING and f.default_factory is not dataclasses.MISSING:
            return Observation("<factory>", _where(cls))
        # pydantic's Field(default=...) may sit in the dataclass default slot
        if type(default).__name__ == "FieldInfo":
            inner = getattr(default, "default", dataclasses.MISSING)
            default = dataclasses.MISSING if type(inner).__name__ == "PydanticUndefinedType" else inner
        if default is dataclasses.MISSING:
            return Observation(REQUIRED, _where(cls))
        return Observation(repr(default), _where(cls))


# --------------------------------------------------------------------------------------------
# static


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
class _Found:
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

    def _top_level(self, module: str, name: str, depth: int = 0) -> _Found | None:
        loaded = self._module(module)
        if loaded is None or depth > 12:
            return None
        tree, rel = loaded
        is_package = rel.endswith("__init__.py")
        found: _Found | None = None
        star_sources: list[str] = []
        for stmt in tree.body:
            for node in _defining_nodes(stmt):
                if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                    found = _Found(node, module, rel)
                elif isinstance(node, (ast.Assign, ast.AnnAssign)) and name in _assigned_names(node):
                    found = _Found(node, module, rel)
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

    def _module_node(self, module: str) -> _Found | None:
        loaded = self._module(module)
        return _Found(loaded[0], module, loaded[1]) if loaded else None

    def _resolve(self, target: str) -> _Found | None:
        module, parts = split_target(target)
        if not parts:
            return self._module_node(module)
        found = self._top_level(module, parts[0])
        for part in parts[1:]:
            if found is None or not isinstance(found.node, ast.ClassDef):
                return None
            found = self._class_member(found, part)
        return found

    def _bases(self, klass: _Found) -> list[_Found]:
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

    def _class_member(self, klass: _Found, name: str, depth: int = 0) -> _Found | None:
        for stmt in klass.node.body:  # type: ignore[attr-defined]
            for node in _defining_nodes(stmt):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
                    return _Found(node, klass.module, klass.file)
                if isinstance(node, (ast.Assign, ast.AnnAssign)) and name in _assigned_names(node):
                    return _Found(node, klass.module, klass.file)
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
        return Observation(_default_repr(member.node.value), found.where)


def _defining_nodes(stmt: ast.stmt):
    """The statement, or for ``if``/``try`` blocks at module or class level, the statements inside."""
    if isinstance(stmt, ast.If):
        for inner in stmt.body + stmt.orelse:
            yield from _defining_nodes(inner)
    elif isinstance(stmt, ast.Try):
        for inner in stmt.body + stmt.orelse + stmt.finalbody:
            yield from _defining_nodes(inner)
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


def _default_repr(value: ast.expr | None) -> str:
    """repr() of a dataclass field's default as the live object would show it."""
    if value is None:
        return REQUIRED
    if isinstance(value, ast.Call) and _call_name(value) in {"field", "Field"}:
        for kw in value.keywords:
            if kw.arg == "default":
                return _default_repr(kw.value)
            if kw.arg == "default_factory":
                return "<factory>"
        if value.args and _call_name(value) == "Field":  # pydantic: Field(default, ...)
            return _default_repr(value.args[0])
        return REQUIRED
    try:
        return repr(ast.literal_eval(value))
    except ValueError:
        return ast.unparse(value)


def _call_name(call: ast.Call) -> str:
    func = call.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""


@lru_cache(maxsize=None)
def live() -> LiveSource:
    return LiveSource()
