"""Every reference one Python module makes into vLLM, and whether vLLM's definition still fits it.

A module is read with ``ast``, never imported. Values are tracked where the code makes them
plain: a name imported from vLLM, ``x = VllmClass(...)``, ``self.x = ...`` in the same class, a
local annotated with a vLLM class, the annotated result of a vLLM function or method, a wrapper's
``wrapped``/``instance`` seeded from the patch that installs it. A name bound more than one way
(two different values, a loop variable, a parameter) is unknown and nothing is checked through it.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import NamedTuple

from ..probes.static import Found, _call_name
from .signatures import FUNCTIONS, VllmIndex, absolute_module

MODULE, CLASS, FUNCTION, METHOD, INSTANCE = "module", "class", "function", "method", "instance"


class Value(NamedTuple):
    """What an expression is: a vLLM module, class, function, bound method or instance."""

    kind: str
    target: str  # "vllm.pkg.mod:Qual.name"
    found: Found | None
    via: str = ""  # the module-level name it was reached through in the analysed module


@dataclass(frozen=True)
class Reference:
    """One place the analysed code relies on vLLM, with what is wrong there ('' when it fits)."""

    site: str  # "speculators/data_generation/x.py:LINE"
    kind: str  # import / call / attribute / patch
    target: str
    where: str = ""  # the definition in vLLM, file:line
    problem: str = ""
    param: str = ""  # the parameter a call's problem is about ('' for a missing name)
    via: str = ""
    missing: bool = False  # the name itself is gone (as opposed to a call that no longer fits)
    typing_only: bool = False  # an import under `if TYPE_CHECKING:`: never runs, a break is a warning


def _join(target: str, name: str) -> str:
    return f"{target}.{name}" if ":" in target else f"{target}:{name}"


class ModuleAnalysis:
    """Reads one module; :attr:`references` lists what it found. ``package`` resolves relative
    imports; ``seeds`` type a module-level function's parameters: ``{function: {parameter: Value}}``."""

    def __init__(self, index: VllmIndex, tree: ast.Module, label: str, package: str = "",
                 seeds: dict[str, dict[str, Value]] | None = None, name: str = ""):
        self.index, self.label, self.package, self.name = index, label, package, name
        self.tree = tree
        self.seeds = seeds or {}
        self.references: list[Reference] = []
        self._seen: set[tuple[int, int, str]] = set()
        self._scopes: dict[int, _Scope] = {}
        self.module_scope = _Scope(self, None, tree.body, {})
        self._typing: set[int] = set()
        self._call_funcs = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
        self._typing_only = {id(inner) for n in ast.walk(tree) if isinstance(n, ast.If) and _is_type_checking(n.test)
                             for stmt in n.body for inner in ast.walk(stmt)}
        # each module-level class's bases, as values (None: not a vLLM class); see callsites.contracts
        self.class_bases: dict[str, tuple[Value | None, ...]] = {}
        for node in tree.body:
            self._visit_top(node)

    # -- walking --------------------------------------------------------------------------------
    def _visit_top(self, node: ast.stmt) -> None:
        if isinstance(node, FUNCTIONS):
            self._visit_function(node, None)
        elif isinstance(node, ast.ClassDef):
            self.class_bases[node.name] = tuple(
                self.module_scope.value(b.value if isinstance(b, ast.Subscript) else b) for b in node.bases)
            for item in node.body:
                if isinstance(item, FUNCTIONS):
                    self._visit_function(item, node)
        else:
            self._check_nodes(node, self.module_scope)

    def _visit_function(self, node, klass: ast.ClassDef | None) -> None:
        self._check_nodes(node, self.method_scope(node, klass))

    def method_scope(self, node, klass: ast.ClassDef | None) -> _Scope:
        if id(node) not in self._scopes:
            seeds = self.seeds.get(node.name, {}) if klass is None else {}
            self._scopes[id(node)] = _Scope(self, self.module_scope, node.body, seeds, node, klass)
        return self._scopes[id(node)]

    def _check_nodes(self, root: ast.AST, scope: _Scope) -> None:
        reachable = list(self._reachable(root, scope))
        for node in reachable:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                self._check_import(node)
            elif isinstance(node, ast.Call):
                self._check_call(node, scope)
        for node in reachable:
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and id(node) not in self._call_funcs:
                holder = scope.value(node.value)
                if holder is not None and holder.kind != METHOD:
                    self._member(holder, node.attr, node, "attribute")

    def _reachable(self, root: ast.AST, scope: _Scope):
        """``ast.walk`` of ``root``, except that an ``if`` testing a feature of vLLM (see
        :meth:`_feature_test`) contributes only the branch the audited release takes: code that
        asks vLLM's signature before calling it is checked on the call it will make."""
        todo = [root]
        while todo:
            node = todo.pop()
            yield node
            taken = self._feature_test(node.test, scope) if isinstance(node, ast.If) else None
            if taken is None:
                todo.extend(ast.iter_child_nodes(node))
            else:
                todo.append(node.test)
                todo.extend(node.body if taken else node.orelse)

    def _feature_test(self, test: ast.expr, scope: _Scope) -> bool | None:
        """The value on the audited release of ``"p" in inspect.signature(f).parameters`` or
        ``hasattr(obj, "name")`` (possibly negated) when ``f`` / ``obj`` is a known vLLM object;
        None for any other test."""
        if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            inner = self._feature_test(test.operand, scope)
            return None if inner is None else not inner
        if (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], (ast.In, ast.NotIn))
                and isinstance(test.left, ast.Constant) and isinstance(test.left.value, str)):
            params = test.comparators[0]
            if not (isinstance(params, ast.Attribute) and params.attr == "parameters"
                    and isinstance(params.value, ast.Call) and _call_name(params.value) == "signature"
                    and len(params.value.args) == 1):
                return None
            func = scope.value(params.value.args[0])
            if func is None or func.found is None or func.kind not in (CLASS, FUNCTION, METHOD):
                return None
            signature = self.index.callable_signature(func.found, bound=func.kind == METHOD)
            if signature is None:
                return None
            present = test.left.value in {name for name, _ in signature.positional + signature.keyword_only}
            return present if isinstance(test.ops[0], ast.In) else not present
        if (isinstance(test, ast.Call) and _call_name(test) == "hasattr" and len(test.args) == 2
                and isinstance(test.args[1], ast.Constant) and isinstance(test.args[1].value, str)):
            holder = scope.value(test.args[0])
            if holder is None or holder.found is None or holder.kind not in (MODULE, CLASS, INSTANCE):
                return None
            found = self._lookup(holder, test.args[1].value)
            return None if found is True else found is not None
        return None

    # -- checks ---------------------------------------------------------------------------------
    def _site(self, node: ast.AST) -> str:
        return f"{self.label}:{node.lineno}"

    def _add(self, node: ast.AST, ref: Reference) -> None:
        key = (node.lineno, node.col_offset, ref.target)
        if key not in self._seen:
            self._seen.add(key)
            self.references.append(ref)

    def _check_import(self, node: ast.Import | ast.ImportFrom) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "vllm":
                    found = self.index.module(alias.name)
                    self._add(node, Reference(self._site(node), "import", alias.name, found.where if found else "",
                                              "" if found else "module not found", missing=found is None,
                                              typing_only=id(node) in self._typing_only))
            return
        module = self.absolute(node)
        if module.split(".")[0] != "vllm":
            return
        for alias in node.names:
            if alias.name == "*":
                continue
            target = f"{module}:{alias.name}"
            found = self.index.top_level(module, alias.name)
            where = found.where if isinstance(found, Found) else ""
            problem = "" if found else ("module not found" if self.index.module(module) is None else "name not found")
            self._add(node, Reference(self._site(node), "import", target, where, problem, via=alias.asname or alias.name,
                                      missing=not found, typing_only=id(node) in self._typing_only))

    def absolute(self, node: ast.ImportFrom) -> str:
        return absolute_module(self.package, node)

    def _lookup(self, holder: Value, name: str) -> Found | None | bool:
        """``holder.name`` in vLLM for a module, class or instance (see ``VllmIndex.member``)."""
        if holder.kind == MODULE:
            return self.index.top_level(holder.found.module, name)
        return self.index.member(holder.found, name)

    def _member(self, holder: Value, name: str, node: ast.AST, kind: str) -> Value | None:
        """Look ``holder.name`` up in vLLM, record the reference, and return what it is."""
        if holder.found is None or (name.startswith("__") and name.endswith("__")):
            return None  # object's own attributes (__dict__, __class__): always there
        target = _join(holder.target, name)
        if holder.kind not in (MODULE, CLASS, INSTANCE):
            return None
        found = self._lookup(holder, name)
        if id(node) in self._call_funcs:
            kind = "call"
        if found is None:
            self._add(node, Reference(self._site(node), kind, target, holder.found.where,
                                      f"no attribute {name!r} on {holder.target}", via=holder.via, missing=True))
            return None
        if found is True:
            return None
        value = self._value_of(found, target, holder)
        if kind == "attribute":
            self._add(node, Reference(self._site(node), kind, target, found.where, via=holder.via))
        return value

    def _value_of(self, found: Found, target: str, holder: Value | None = None, via: str = "") -> Value | None:
        via = via or (holder.via if holder else "")
        node = found.node
        if isinstance(node, ast.Module):
            return Value(MODULE, found.module, found, via)
        if isinstance(node, ast.ClassDef):
            return Value(CLASS, target, found, via)
        if isinstance(node, FUNCTIONS):
            decorators = {getattr(d, "id", getattr(d, "attr", "")) for d in node.decorator_list}
            if decorators & {"property", "cached_property"}:
                klass = self.index.result_class(found)
                return Value(INSTANCE, self.class_target(klass), klass, via) if klass else None
            bound = holder is not None and (holder.kind == INSTANCE or "classmethod" in decorators)
            return Value(METHOD if bound else FUNCTION, target, found, via)
        if isinstance(node, ast.AnnAssign) and holder is not None and holder.kind == INSTANCE:
            klass = self.index.result_class(found)
            return Value(INSTANCE, self.class_target(klass), klass, via) if klass else None
        return None  # a constant or enum member: present, nothing more to follow

    @staticmethod
    def class_target(found: Found) -> str:
        return f"{found.module}:{found.node.name}"  # type: ignore[attr-defined]

    def _check_call(self, call: ast.Call, scope: _Scope) -> None:
        func = scope.value(call.func)
        if func is None or func.found is None or func.kind not in (CLASS, FUNCTION, METHOD):
            return
        target = f"{func.target}.__init__" if func.kind == CLASS else func.target
        signature = self.index.callable_signature(func.found, bound=func.kind == METHOD)
        if signature is None:
            self._add(call, Reference(self._site(call), "call", target, func.found.where, via=func.via))
            return
        star_args = any(isinstance(a, ast.Starred) for a in call.args)
        star_kwargs = any(k.arg is None for k in call.keywords)
        n_args = sum(1 for a in call.args if not isinstance(a, ast.Starred))
        keywords = [k.arg for k in call.keywords if k.arg is not None]
        problems = signature.problems(n_args, keywords, star_args, star_kwargs)
        if not problems:
            self._add(call, Reference(self._site(call), "call", target, signature.where, via=func.via))
        for param, problem in problems:
            self.references.append(Reference(self._site(call), "call", target, signature.where, problem, param,
                                             func.via))

    # -- typing ---------------------------------------------------------------------------------
    def call_result(self, func: Value) -> Value | None:
        """What calling ``func`` gives: an instance of the class, or of the annotated return type."""
        if func.kind == CLASS:
            return Value(INSTANCE, func.target, func.found, func.via)
        if func.kind in (FUNCTION, METHOD) and func.found is not None:
            klass = self.index.result_class(func.found)
            return Value(INSTANCE, self.class_target(klass), klass, func.via) if klass else None
        return None


class _Scope:
    """The bindings of one function (nested functions included) or of the module."""

    def __init__(self, analysis: ModuleAnalysis, parent: _Scope | None, body: list[ast.stmt],
                 seeds: dict[str, Value], function=None, klass: ast.ClassDef | None = None):
        self.analysis, self.parent, self.klass, self.body = analysis, parent, klass, body
        self.seeds = seeds
        self.bindings: dict[str, list[ast.AST | None]] = {}
        self._cache: dict[str, Value | None] = {}
        self._busy: set[str] = set()
        if function is not None:
            args = function.args
            for arg in args.posonlyargs + args.args + args.kwonlyargs + [args.vararg, args.kwarg]:
                if arg is not None and arg.arg not in seeds:
                    self.bindings.setdefault(arg.arg, []).append(None)
        for node in ast.walk(function) if function is not None else _module_level(body):
            self._bind(node, function)

    def narrowed(self) -> set[str]:
        """Names this scope tests with ``isinstance(name, C)`` where ``C`` is not a vLLM class."""
        if not hasattr(self, "_narrowed"):
            self._narrowed: set[str] = set()
            for node in (n for stmt in self.body for n in ast.walk(stmt)):
                if (isinstance(node, ast.Call) and _call_name(node) == "isinstance" and len(node.args) == 2
                        and isinstance(node.args[0], ast.Name)):
                    classes = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
                    values = [self.value(c) for c in classes]
                    if any(v is None or v.kind != CLASS for v in values):
                        self._narrowed.add(node.args[0].id)
        return self._narrowed

    def _bind(self, node: ast.AST, function) -> None:
        if isinstance(node, ast.Assign):
            for target in node.targets:
                self._bind_target(target, node.value)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            self.bindings.setdefault(node.target.id, []).append(node)
        elif isinstance(node, ast.NamedExpr):
            self.bindings.setdefault(node.target.id, []).append(node.value)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if alias.name != "*":
                    self.bindings.setdefault((alias.asname or alias.name).split(".")[0], []).append(node)
        elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
            self._bind_target(node.target, None)
        elif isinstance(node, (ast.With, ast.AsyncWith)):
            for item in node.items:
                if item.optional_vars is not None:
                    self._bind_target(item.optional_vars, None)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            self.bindings.setdefault(node.name, []).append(None)
        elif isinstance(node, (*FUNCTIONS, ast.ClassDef)) and node is not function:
            self.bindings.setdefault(node.name, []).append(None)
            if isinstance(node, FUNCTIONS):
                for arg in node.args.posonlyargs + node.args.args + node.args.kwonlyargs:
                    self.bindings.setdefault(arg.arg, []).append(None)

    def _bind_target(self, target: ast.expr, value: ast.expr | None) -> None:
        if isinstance(target, ast.Name):
            self.bindings.setdefault(target.id, []).append(value)
        elif isinstance(target, (ast.Tuple, ast.List)):
            for element in target.elts:
                self._bind_target(element, None)
        elif isinstance(target, ast.Starred):
            self._bind_target(target.value, None)

    # -- values ---------------------------------------------------------------------------------
    def name(self, name: str) -> Value | None:
        if name in self.seeds:
            return self.seeds[name]
        if name not in self.bindings:
            return self.parent.name(name) if self.parent else None
        if name in self._busy:
            return None
        if name not in self._cache and name in self.narrowed():
            self._cache[name] = None  # `isinstance(x, OwnClass)`: x may be the consumer's subclass
        if name not in self._cache:
            self._busy.add(name)
            try:
                values = [self._bound_value(name, b) for b in self.bindings[name] if not _is_none(b)]
                first = values[0] if values else None
                agree = first is not None and all(v is not None and v[:3] == first[:3] for v in values)
                self._cache[name] = first if agree else None
            finally:
                self._busy.discard(name)
        return self._cache[name]

    def _bound_value(self, name: str, binding: ast.AST | None) -> Value | None:
        analysis = self.analysis
        if binding is None:
            return None
        if isinstance(binding, ast.ImportFrom):
            module = analysis.absolute(binding)
            if module.split(".")[0] != "vllm":
                return None
            alias = next(a for a in binding.names if (a.asname or a.name) == name)
            found = analysis.index.top_level(module, alias.name) or analysis.index.moved_to(module, alias.name)
            return analysis._value_of(found, f"{module}:{alias.name}", via=name) if isinstance(found, Found) else None
        if isinstance(binding, ast.Import):
            alias = next(a for a in binding.names if (a.asname or a.name).split(".")[0] == name)
            module = alias.name if alias.asname else alias.name.split(".")[0]
            if module.split(".")[0] != "vllm":
                return None
            found = analysis.index.module(module)
            return Value(MODULE, module, found, name) if found else None
        if isinstance(binding, ast.AnnAssign):
            klass = self.annotated_class(binding.annotation)
            if klass is not None:
                return Value(INSTANCE, analysis.class_target(klass), klass)
            return self.value(binding.value) if binding.value is not None else None
        return self.value(binding)

    def annotated_class(self, annotation: ast.expr) -> Found | None:
        """The vLLM class an annotation in the analysed code names (``Scheduler``, ``mod.Scheduler``)."""
        holder = self.value(annotation) if isinstance(annotation, (ast.Name, ast.Attribute)) else None
        return holder.found if holder is not None and holder.kind == CLASS else None

    def value(self, expr: ast.expr | None) -> Value | None:
        analysis = self.analysis
        if expr is None or id(expr) in analysis._typing:
            return None
        analysis._typing.add(id(expr))
        try:
            if isinstance(expr, ast.Name):
                return self.name(expr.id)
            if isinstance(expr, ast.Attribute):
                if isinstance(expr.value, ast.Name) and expr.value.id == "self" and self.klass is not None:
                    own = self.self_attribute(expr.attr)
                    return own if own is not None else self.inherited_attribute(expr.attr, expr)
                if (isinstance(expr.value, ast.Call) and _call_name(expr.value) == "super" and not expr.value.args
                        and self.klass is not None):
                    return self.inherited_attribute(expr.attr, expr, own=False)
                holder = self.value(expr.value)
                if holder is None or holder.kind == METHOD:
                    return None
                if holder.kind == MODULE:
                    sub = analysis.index.module(f"{holder.target}.{expr.attr}")
                    if sub is not None and analysis.index.source._top_level(holder.target, expr.attr) is None:
                        return Value(MODULE, f"{holder.target}.{expr.attr}", sub, holder.via)
                return analysis._member(holder, expr.attr, expr, "attribute") if holder.found else None
            if isinstance(expr, ast.Call):
                if (isinstance(expr.func, ast.Attribute) and isinstance(expr.func.value, ast.Name)
                        and expr.func.value.id == "self" and self.klass is not None):
                    own = self.own_method_result(expr.func.attr)
                    if own is not None:
                        return own
                func = self.value(expr.func)
                return analysis.call_result(func) if func is not None else None
            if isinstance(expr, ast.NamedExpr):
                return self.value(expr.value)
            return None
        finally:
            analysis._typing.discard(id(expr))

    def self_attribute(self, name: str) -> Value | None:
        """``self.name`` in a method of an analysed class: what every ``self.name = ...`` agrees on."""
        values = []
        for method in self.klass.body:
            if not isinstance(method, FUNCTIONS):
                continue
            for node in ast.walk(method):
                if isinstance(node, ast.Assign):
                    for target in node.targets:
                        if (isinstance(target, ast.Attribute) and target.attr == name
                                and isinstance(target.value, ast.Name) and target.value.id == "self"):
                            if _is_none(node.value):
                                continue
                            values.append(self.analysis.method_scope(method, self.klass).value(node.value))
        first = values[0] if values else None
        return first if first is not None and all(v is not None and v[:3] == first[:3] for v in values) else None

    def inherited_attribute(self, name: str, expr: ast.Attribute, own: bool = True) -> Value | None:
        """``self.name`` that the analysed class leaves to its vLLM bases (``super().name`` with
        ``own=False``): when every base is a vLLM class and the class neither defines nor sets
        ``name`` itself, vLLM's member (a missing one is recorded as such); ``super().__init__`` is
        the first base's constructor; None otherwise."""
        bases = self.analysis.class_bases.get(self.klass.name, ())
        if not bases or any(b is None or b.kind != CLASS or b.found is None for b in bases):
            return None
        if not own and name == "__init__":
            return bases[0] if id(expr) in self.analysis._call_funcs else None
        if own and _defines(self.klass, name):
            return None
        holder = None
        for base in bases:
            found = self.analysis.index.member(base.found, name)
            if found is True:
                return None
            if holder is None and isinstance(found, Found):
                holder = base
        holder = holder or bases[0]
        return self.analysis._member(Value(INSTANCE, holder.target, holder.found, holder.via), name, expr, "attribute")

    def own_method_result(self, name: str) -> Value | None:
        method = next((m for m in self.klass.body if isinstance(m, FUNCTIONS) and m.name == name), None)
        if method is None or method.returns is None:
            return None
        klass = self.analysis.module_scope.annotated_class(method.returns)
        return Value(INSTANCE, self.analysis.class_target(klass), klass) if klass else None


def _is_type_checking(test: ast.expr) -> bool:
    """``TYPE_CHECKING`` or ``typing.TYPE_CHECKING``."""
    return getattr(test, "id", getattr(test, "attr", "")) == "TYPE_CHECKING"


def _defines(klass: ast.ClassDef, name: str) -> bool:
    """Whether a class body defines ``name``, sets ``self.name``, or may set any attribute."""
    for node in ast.walk(klass):
        if isinstance(node, (*FUNCTIONS, ast.ClassDef)) and node.name in (name, "__getattr__", "__getattribute__"):
            return True
        if isinstance(node, ast.Name) and node.id == name and isinstance(node.ctx, ast.Store):
            return True
        if (isinstance(node, ast.Attribute) and node.attr == name and isinstance(node.ctx, (ast.Store, ast.Del))):
            return True
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "setattr":
            return True
    return False


def _is_none(binding) -> bool:
    return isinstance(binding, ast.Constant) and binding.value is None


def _module_level(body: list[ast.stmt]):
    """Statements bound at module level (not inside functions or classes)."""
    stack = list(body)
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, (*FUNCTIONS, ast.ClassDef, ast.Lambda)):
            stack.extend(ast.iter_child_nodes(node))


