"""What vLLM's definitions accept, read with ``ast``: names, members, parameters, types of results.

Built on :class:`~vllm_compat.probes.static.StaticSource` (same module loading, re-exports and star
imports). Everything here answers "unknown" (None) rather than guess: a base class outside vLLM,
a ``__getattr__``, a decorator that builds the signature elsewhere. The call-site checks skip what
is unknown, so an unknown never becomes a false alarm.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass, field

from ..probes.shapes import REQUIRED
from ..probes.static import Found, StaticSource, default_repr, defining_nodes

FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)
# bases that add no constructor parameters and no members the checks could miss
INERT_BASES = {"object", "ABC", "Generic", "Protocol", "NamedTuple", "TypedDict"}
# bases that make every annotated class attribute a constructor field, like @dataclass
STRUCT_BASES = {"Struct"}  # msgspec.Struct
DATACLASS_DECORATORS = {"dataclass", "config"}  # dataclasses / pydantic dataclass / vLLM's @config


@dataclass(frozen=True)
class Signature:
    """A callable's parameters as a caller sees them (``self``/``cls`` already bound)."""

    positional: tuple[tuple[str, bool], ...]  # (name, required), positional-or-keyword and positional-only
    keyword_only: tuple[tuple[str, bool], ...]
    var_positional: bool
    var_keyword: bool
    where: str
    positional_only: frozenset[str] = field(default=frozenset())

    def problems(self, n_args: int, keywords: list[str], star_args: bool, star_kwargs: bool) -> list[tuple[str, str]]:
        """(parameter, what is wrong) for one call; conservative where the call spreads ``*``/``**``."""
        found: list[tuple[str, str]] = []
        names = {name for name, _ in self.positional if name not in self.positional_only}
        names |= {name for name, _ in self.keyword_only}
        for keyword in keywords:
            if keyword not in names and not self.var_keyword:
                found.append((keyword, f"no parameter {keyword!r}"))
        if not star_args and n_args > len(self.positional) and not self.var_positional:
            found.append(("", f"{n_args} positional arguments, at most {len(self.positional)} accepted"))
        if not star_args and not star_kwargs:
            given = {name for name, _ in self.positional[:n_args]} | set(keywords)
            for name, required in self.positional + self.keyword_only:
                if required and name not in given:
                    found.append((name, f"required parameter {name!r} not passed"))
        return found


def function_signature(node: ast.FunctionDef | ast.AsyncFunctionDef, where: str, bound: bool) -> Signature:
    args = node.args
    positional = args.posonlyargs + args.args
    first_default = len(positional) - len(args.defaults)
    params = [(arg.arg, i < first_default) for i, arg in enumerate(positional)]
    posonly = {arg.arg for arg in args.posonlyargs}
    if bound and params:
        posonly.discard(params[0][0])
        params = params[1:]
    kwonly = [(arg.arg, default is None) for arg, default in zip(args.kwonlyargs, args.kw_defaults)]
    return Signature(tuple(params), tuple(kwonly), args.vararg is not None, args.kwarg is not None, where,
                     frozenset(posonly))


def _decorator_names(node) -> set[str]:
    names = set()
    for deco in getattr(node, "decorator_list", []):
        expr = deco.func if isinstance(deco, ast.Call) else deco
        names.add(expr.attr if isinstance(expr, ast.Attribute) else getattr(expr, "id", ""))
    return names


def _base_name(expr: ast.expr) -> str:
    if isinstance(expr, ast.Subscript):
        expr = expr.value
    return expr.attr if isinstance(expr, ast.Attribute) else getattr(expr, "id", "")


def absolute_module(package: str, node: ast.ImportFrom) -> str:
    """The module a ``from ... import`` names, a relative one resolved from ``package``."""
    if not node.level:
        return node.module or ""
    parts = package.split(".")
    prefix = ".".join(parts[: len(parts) - node.level + 1])
    return f"{prefix}.{node.module}" if node.module else prefix


def single_class_expression(annotation: ast.expr | None) -> ast.expr | None:
    """What an annotation names one class by: a string annotation parsed, ``X | None`` and
    ``Optional[X]`` reduced to ``X``; None where it names no single class."""
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        try:
            annotation = ast.parse(annotation.value, mode="eval").body
        except SyntaxError:
            return None
    if isinstance(annotation, ast.BinOp) and isinstance(annotation.op, ast.BitOr):
        sides = [s for s in (annotation.left, annotation.right) if not (isinstance(s, ast.Constant) and s.value is None)]
        return single_class_expression(sides[0]) if len(sides) == 1 else None
    if isinstance(annotation, ast.Subscript) and _base_name(annotation.value) == "Optional":
        return single_class_expression(annotation.slice)
    return annotation


def _annotation_text(node: ast.AnnAssign) -> str:
    return ast.unparse(node.annotation)


class VllmIndex:
    """Lookups into one vLLM tree, cached per audit."""

    def __init__(self, source: StaticSource, moved: dict[str, str] | None = None):
        self.source = source
        self.moved = moved or {}  # "old.module:name" -> "new.module:name", put back by an adapter
        self._names: dict[tuple[str, str], Found | None | bool] = {}

    # -- names ----------------------------------------------------------------------------------
    def module(self, name: str) -> Found | None:
        return self.source._module_node(name)

    def top_level(self, module: str, name: str) -> Found | None | bool:
        """The definition of ``module.name``; True when it exists but lies outside vLLM's files
        (re-exported from another package, or served by a module ``__getattr__``); None if missing."""
        key = (module, name)
        if key not in self._names:
            self._names[key] = self._top_level(module, name)
        return self._names[key]

    def moved_to(self, module: str, name: str) -> Found | None | bool:
        """Where a name that an adapter puts back at ``module.name`` lives on this release (its
        calls are checked there), or None if no adapter moves it."""
        new = self.moved.get(f"{module}:{name}")
        if new is None:
            return None
        new_module, _, new_name = new.partition(":")
        return self.top_level(new_module, new_name)

    def _top_level(self, module: str, name: str) -> Found | None | bool:
        found = self.source._top_level(module, name) or self.source._module_node(f"{module}.{name}")
        if found is not None:
            return found
        loaded = self.source._module(module)
        if loaded is None:
            return None
        lazy = self._lazy_attr(module, loaded[0], name)
        if lazy is not None:
            return lazy
        for stmt in (node for top in loaded[0].body for node in defining_nodes(top)):
            if (isinstance(stmt, ast.ImportFrom) and not stmt.level and not (stmt.module or "").startswith("vllm")
                    and any((a.asname or a.name) == name or a.name == "*" for a in stmt.names)):
                return True
            if isinstance(stmt, ast.Import) and any((a.asname or a.name).split(".")[0] == name for a in stmt.names):
                return True
        return None

    def _lazy_attr(self, module: str, tree: ast.Module, name: str) -> Found | None | bool:
        """A name served by a module ``__getattr__`` from a ``{"name": "pkg.mod:attr"}`` table."""
        if not any(isinstance(s, FUNCTIONS) and s.name == "__getattr__" for s in tree.body):
            return None
        for node in ast.walk(tree):
            if isinstance(node, ast.Dict):
                for key, value in zip(node.keys, node.values):
                    if (isinstance(key, ast.Constant) and key.value == name and isinstance(value, ast.Constant)
                            and isinstance(value.value, str) and ":" in value.value):
                        where, _, attr = value.value.partition(":")
                        if where.startswith("."):
                            where = module + where
                        return self.top_level(where, attr)
        return True  # a __getattr__ we cannot read: assume it serves the name

    def resolve(self, target: str) -> Found | None | bool:
        module, _, qual = target.partition(":")
        parts = [p for p in qual.split(".") if p]
        if not parts:
            return self.module(module)
        found = self.top_level(module, parts[0])
        for part in parts[1:]:
            if found is None or found is True:
                return found
            if isinstance(found.node, ast.Module):
                found = self.top_level(found.module, part)
            elif isinstance(found.node, ast.ClassDef):
                found = self.member(found, part)
            else:
                return True
        return found

    # -- classes ------------------------------------------------------------------------------
    def bases(self, klass: Found) -> tuple[list[Found], bool]:
        """(vLLM bases, whether every base is known: in vLLM or inert)."""
        found, complete = [], True
        for expr in klass.node.bases:  # type: ignore[attr-defined]
            name = _base_name(expr)
            if name in INERT_BASES:
                continue
            base = None
            if isinstance(expr, ast.Name):
                base = self.top_level(klass.module, expr.id)
            elif isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name):
                holder = self.top_level(klass.module, expr.value.id)
                if isinstance(holder, Found) and isinstance(holder.node, ast.Module):
                    base = self.top_level(holder.module, expr.attr)
            if isinstance(base, Found) and isinstance(base.node, ast.ClassDef):
                found.append(base)
            else:
                complete = False
        return found, complete

    def mro(self, klass: Found) -> tuple[list[Found], bool]:
        """Depth-first, left-to-right class order (enough for single inheritance chains), and
        whether every class on it is known."""
        order, complete, stack = [], True, [klass]
        while stack and len(order) < 40:
            current = stack.pop(0)
            if any(c.node is current.node for c in order):
                continue
            order.append(current)
            bases, known = self.bases(current)
            complete = complete and known
            stack = bases + stack
        return order, complete

    def member(self, klass: Found, name: str) -> Found | None | bool:
        """The last definition of ``name`` in the class or its bases; True if it may come from
        somewhere unreadable (a base outside vLLM, ``__getattr__``, an attribute set on ``self``)."""
        order, complete = self.mro(klass)
        for current in order:
            last = None
            for stmt in current.node.body:  # type: ignore[attr-defined]
                for node in defining_nodes(stmt):
                    if isinstance(node, (*FUNCTIONS, ast.ClassDef)) and node.name == name:
                        last = node if "overload" not in _decorator_names(node) or last is None else last
                    elif isinstance(node, (ast.Assign, ast.AnnAssign)) and name in _targets(node):
                        last = node
            if last is not None:
                return Found(last, current.module, current.file)
        if not complete or any(self._sets_on_self(c, name) or self._dynamic(c) for c in order):
            return True
        return None

    def _sets_on_self(self, klass: Found, name: str) -> bool:
        for node in ast.walk(klass.node):
            if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and node.attr == name
                    and isinstance(node.value, ast.Name) and node.value.id == "self"):
                return True
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "setattr":
                return True
        return False

    @staticmethod
    def _dynamic(klass: Found) -> bool:
        return any(isinstance(s, FUNCTIONS) and s.name in ("__getattr__", "__getattribute__")
                   for s in klass.node.body)  # type: ignore[attr-defined]

    def constructor(self, klass: Found) -> Signature | None:
        """What ``Class(...)`` accepts: an explicit ``__init__`` or the fields of a dataclass-like
        class, following the bases; None where that is not readable."""
        order, complete = self.mro(klass)
        fields: list[tuple[str, bool]] = []
        kw_only_fields: list[tuple[str, bool]] = []
        field_based = False
        for current in order:
            node = current.node
            if any(isinstance(s, FUNCTIONS) and s.name in ("__new__", "__call__") for s in node.body):
                return None
            init = next((s for s in reversed(node.body) if isinstance(s, FUNCTIONS) and s.name == "__init__"), None)
            if init is not None and not field_based:
                return function_signature(init, Found(init, current.module, current.file).where, bound=True)
            is_struct = any(_base_name(b) in STRUCT_BASES for b in node.bases)
            if DATACLASS_DECORATORS & _decorator_names(node) or is_struct:
                if not field_based:
                    klass = current
                field_based = True
                own, own_kw = _fields(node, is_struct)
                fields[:0], kw_only_fields[:0] = own, own_kw
            elif field_based:
                continue
        if not field_based:
            if not complete:
                return None
            return Signature((), (), False, False, klass.where)  # object.__init__
        return Signature(tuple(fields), tuple(kw_only_fields), False, False, klass.where)

    def callable_signature(self, found: Found, bound: bool) -> Signature | None:
        node = found.node
        if isinstance(node, ast.ClassDef):
            return self.constructor(found)
        if not isinstance(node, FUNCTIONS):
            return None
        decorators = _decorator_names(node)
        if decorators - {"staticmethod", "classmethod", "abstractmethod", "override", "property", "cached_property",
                         "inference_mode", "no_grad", "cache", "lru_cache", "deprecated", "wraps"}:
            return None  # a decorator that may change what the caller sees
        if "property" in decorators or "cached_property" in decorators:
            return None
        return function_signature(node, found.where, bound=bound and "staticmethod" not in decorators)

    # -- types --------------------------------------------------------------------------------
    def annotation_class(self, module: str, annotation: ast.expr | None) -> Found | None:
        """The vLLM class an annotation names (``X``, ``mod.X``, ``"X"``, ``X | None``)."""
        annotation = single_class_expression(annotation)
        found = None
        if isinstance(annotation, ast.Name):
            found = self.top_level(module, annotation.id)
        elif isinstance(annotation, ast.Attribute) and isinstance(annotation.value, ast.Name):
            holder = self.top_level(module, annotation.value.id)
            if isinstance(holder, Found) and isinstance(holder.node, ast.Module):
                found = self.top_level(holder.module, annotation.attr)
        return found if isinstance(found, Found) and isinstance(found.node, ast.ClassDef) else None

    def result_class(self, found: Found) -> Found | None:
        """The class a function returns (its annotation), or a class attribute's annotated type."""
        node = found.node
        if isinstance(node, FUNCTIONS):
            return self.annotation_class(found.module, node.returns)
        if isinstance(node, ast.AnnAssign):
            return self.annotation_class(found.module, node.annotation)
        return None


def _targets(node: ast.Assign | ast.AnnAssign) -> set[str]:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    return {t.id for t in targets if isinstance(t, ast.Name)}


def _fields(node: ast.ClassDef, is_struct: bool) -> tuple[list[tuple[str, bool]], list[tuple[str, bool]]]:
    """(positional fields, keyword-only fields) of one dataclass-like class body, in order."""
    positional, keyword_only, kw_only = [], [], is_struct and any(
        k.arg == "kw_only" and getattr(k.value, "value", False) for k in node.keywords)
    for deco in node.decorator_list:
        if isinstance(deco, ast.Call) and any(k.arg == "kw_only" and getattr(k.value, "value", False)
                                              for k in deco.keywords):
            kw_only = True
    for stmt in node.body:
        if not isinstance(stmt, ast.AnnAssign) or not isinstance(stmt.target, ast.Name):
            continue
        text = _annotation_text(stmt)
        if text.startswith(("ClassVar", "typing.ClassVar", "Final")):
            continue
        if text in ("KW_ONLY", "dataclasses.KW_ONLY"):
            kw_only = True
            continue
        if isinstance(stmt.value, ast.Call) and any(k.arg == "init" and getattr(k.value, "value", True) is False
                                                    for k in stmt.value.keywords):
            continue
        if stmt.target.id.startswith("_") and is_struct:
            continue
        required = default_repr(stmt.value) == REQUIRED
        (keyword_only if kw_only else positional).append((stmt.target.id, required))
    return positional, keyword_only
