"""The engine steps a class makes, read from its source with ``ast``: which calls on vLLM's executor,
scheduler, workers and KV-cache planning it makes, in order, and under which conditions.

One reader serves both sides of the comparison: vLLM's own engine core (``EngineCore``: how vLLM
starts its engine and steps it) and the speculators generator (``VllmHiddenStatesGenerator``, which
re-implements both by hand). From the entry methods of a phase it walks the statements in order,
inlining the class's own helper methods (``self._initialize_kv_caches()``), and records a step for

* a method called on an object whose class is (a subclass of) one of :data:`ROLES`: the executor
  (``executor.compile_or_warm_up_model``) or the scheduler (``scheduler.schedule``). An executor
  step also records the worker methods it runs, read from the executor's own method
  (``collective_rpc("compile_or_warm_up_model")``): the generator may call the worker method by
  name where vLLM calls the executor's method, and that is the same step;
* a worker method named by a string, ``collective_rpc("name")``: ``rpc.name``;
* a function of vLLM's KV-cache planning modules (:data:`KV_CACHE_MODULES`):
  ``kv_cache.get_kv_cache_configs``.

An object's class is known where the code makes it plain: ``self.x = SomeClass(...)``,
``self.x: SomeClass = ...``, ``self.x = cls_param(...)`` with ``cls_param: type[SomeClass]``, a
local assigned once from one of those. Anything else is not a step: an unknown never becomes one.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass, field

from ..callsites.signatures import FUNCTIONS, VllmIndex
from ..probes.static import Found
from .names import ModuleNames

# vLLM's objects whose calls are engine steps: role -> the class every such object is an instance of
ROLES = {
    "executor": "vllm.v1.executor.abstract:Executor",
    "scheduler": "vllm.v1.core.sched.interface:SchedulerInterface",
}
RPC = "rpc"  # a worker method named by a string in collective_rpc("name")
KV_CACHE = "kv_cache"  # a function of vLLM's KV-cache planning
KV_CACHE_MODULES = "vllm.v1.core.kv_cache_"  # kv_cache_utils, kv_cache_planning, kv_cache_config_builder, ...
MAX_DEPTH = 8  # how deep the class's own helper methods are followed


@dataclass(frozen=True)
class Step:
    """One call of an engine step, where it is made and when.

    Attributes:
        id: ``role.name``: ``executor.extend_kv_cache``, ``scheduler.schedule``,
            ``rpc.update_max_model_len``, ``kv_cache.get_kv_cache_configs``.
        phase: the phase whose entry methods reach it (``start``, ``step``).
        where: the call, ``file:line``.
        guard: the conditions it is made under, as written (``''``: always).
        rpcs: the worker methods it runs (an executor method's own ``collective_rpc`` names).
    """

    id: str
    phase: str
    where: str
    guard: str = ""
    rpcs: frozenset[str] = field(default=frozenset())


class ClassSteps:
    """Reads one class's steps. ``module`` is the class's module name, ``package`` the package its
    relative imports start from, ``label`` the file name reported in ``where``."""

    def __init__(self, index: VllmIndex, tree: ast.Module, klass: ast.ClassDef, module: str, label: str,
                 package: str = ""):
        self.index, self.tree, self.klass, self.module, self.label = index, tree, klass, module, label
        self.names = ModuleNames(index, tree, package or module.rpartition(".")[0])
        self._rpcs: dict[tuple[int, str], frozenset[str]] = {}
        self._labels: dict[int, str] = {}  # a method inherited from a base: the file it is in

    # -- the sequence ---------------------------------------------------------------------------
    def steps(self, phases: tuple[tuple[str, tuple[str, ...]], ...]) -> list[Step]:
        """Every step of each phase, in source order, the class's own helpers inlined."""
        found: list[Step] = []
        for phase, entries in phases:
            for entry in entries:
                method = self._own_method(entry)
                if method is not None:
                    found += self._walk(method.body, phase, (), (method.name,), method)
        return found

    def _walk(self, body: list[ast.stmt], phase: str, guard: tuple[str, ...], stack: tuple[str, ...],
              function) -> list[Step]:
        found: list[Step] = []
        for stmt in body:
            if isinstance(stmt, (*FUNCTIONS, ast.ClassDef)):
                continue
            if isinstance(stmt, ast.If):
                test = _condition(stmt.test, function)
                found += self._calls(stmt.test, phase, guard, stack, function)
                found += self._walk(stmt.body, phase, (*guard, test), stack, function)
                found += self._walk(stmt.orelse, phase, (*guard, f"not ({test})"), stack, function)
            elif isinstance(stmt, ast.While):
                found += self._calls(stmt.test, phase, guard, stack, function)
                found += self._walk(stmt.body + stmt.orelse, phase, guard, stack, function)
            elif isinstance(stmt, (ast.For, ast.AsyncFor)):
                found += self._calls(stmt.iter, phase, guard, stack, function)
                found += self._walk(stmt.body + stmt.orelse, phase, guard, stack, function)
            elif isinstance(stmt, (ast.With, ast.AsyncWith)):
                for item in stmt.items:
                    found += self._calls(item.context_expr, phase, guard, stack, function)
                found += self._walk(stmt.body, phase, guard, stack, function)
            elif isinstance(stmt, ast.Try):
                handlers = [s for h in stmt.handlers for s in h.body]
                found += self._walk(stmt.body + handlers + stmt.orelse + stmt.finalbody, phase, guard, stack,
                                    function)
            else:
                found += self._calls(stmt, phase, guard, stack, function)
        return found

    def _calls(self, node: ast.AST, phase: str, guard: tuple[str, ...], stack: tuple[str, ...],
               function) -> list[Step]:
        calls = sorted((n for n in ast.walk(node) if isinstance(n, ast.Call)), key=lambda n: (n.lineno, n.col_offset))
        found: list[Step] = []
        for call in calls:
            found += self._call(call, phase, guard, stack, function)
        return found

    def _call(self, call: ast.Call, phase: str, guard: tuple[str, ...], stack: tuple[str, ...],
              function) -> list[Step]:
        where, when = f"{self._labels.get(id(function), self.label)}:{call.lineno}", " and ".join(guard)
        func = call.func
        if isinstance(func, ast.Attribute) and func.attr == "collective_rpc":
            name = _constant_str(call.args[0]) if call.args else None
            if name is not None:
                return [Step(f"{RPC}.{name}", phase, where, when, frozenset({name}))]
        if isinstance(func, ast.Attribute) and _is_self(func.value):
            method = self._own_method(func.attr)
            if method is not None and func.attr not in stack and len(stack) < MAX_DEPTH:
                return self._walk(method.body, phase, guard, (*stack, func.attr), method)
            return []
        if isinstance(func, ast.Attribute):
            klass = self._instance_class(func.value, function)
            role = self._role(klass) if klass is not None else None
            if role is not None:
                rpcs = self._executor_rpcs(klass, func.attr) if role == "executor" else frozenset()
                return [Step(f"{role}.{func.attr}", phase, where, when, rpcs)]
        name = self._kv_cache_function(func)
        return [Step(f"{KV_CACHE}.{name}", phase, where, when)] if name else []

    # -- types --------------------------------------------------------------------------------
    def _class_object(self, expr: ast.expr | None, function) -> Found | None:
        """The vLLM class ``expr`` evaluates to: a class name, ``mod.Class``, or a parameter annotated
        ``type[Class]``."""
        if isinstance(expr, ast.Name):
            param = _parameter(function, expr.id)
            if param is not None:
                annotation = param.annotation
                if isinstance(annotation, ast.Subscript) and getattr(annotation.value, "id", "") == "type":
                    return self.names.class_named(annotation.slice)
                return None
        return self.names.class_named(expr)

    def _instance_class(self, expr: ast.expr, function, depth: int = 0) -> Found | None:
        """The vLLM class of the object ``expr`` evaluates to, where the code makes it plain."""
        if depth > 4:
            return None
        if isinstance(expr, ast.Attribute) and _is_self(expr.value):
            return self._self_attribute(expr.attr, depth)
        if isinstance(expr, ast.Name) and function is not None:
            param = _parameter(function, expr.id)
            if param is not None:
                return self.names.class_named(param.annotation)
            values = [node.value for node in ast.walk(function) if isinstance(node, ast.Assign)
                      and any(isinstance(t, ast.Name) and t.id == expr.id for t in node.targets)]
            return self._instance_class(values[0], function, depth + 1) if len(values) == 1 else None
        if isinstance(expr, ast.Call):
            return self._class_object(expr.func, function)
        return None

    def _self_attribute(self, name: str, depth: int) -> Found | None:
        """``self.name``: the class every assignment to it in the class agrees on."""
        classes = []
        for method in (m for m in self.klass.body if isinstance(m, FUNCTIONS)):
            for node in ast.walk(method):
                if isinstance(node, ast.AnnAssign) and _is_self_attr(node.target, name):
                    classes.append(self.names.class_named(node.annotation)
                                   or self._instance_class(node.value, method, depth + 1))
                elif isinstance(node, ast.Assign) and any(_is_self_attr(t, name) for t in node.targets):
                    if not _is_none(node.value):
                        classes.append(self._instance_class(node.value, method, depth + 1))
        first = classes[0] if classes else None
        return first if first is not None and all(c is not None and c.node is first.node for c in classes) else None

    def _role(self, klass: Found) -> str | None:
        order, _ = self.index.mro(klass)
        names = {f"{c.module}:{c.node.name}" for c in order}  # type: ignore[attr-defined]
        return next((role for role, target in ROLES.items() if target in names), None)

    def _executor_rpcs(self, klass: Found, method: str, depth: int = 0) -> frozenset[str]:
        """The worker methods an executor method names in ``collective_rpc("...")``, its own helper
        methods followed."""
        key = (id(klass.node), method)
        if key in self._rpcs:
            return self._rpcs[key]
        self._rpcs[key] = frozenset()
        found = self.index.member(klass, method)
        names: set[str] = set()
        if isinstance(found, Found) and isinstance(found.node, FUNCTIONS) and depth < MAX_DEPTH:
            for call in (n for n in ast.walk(found.node) if isinstance(n, ast.Call)):
                func = call.func
                if not (isinstance(func, ast.Attribute) and _is_self(func.value)):
                    continue
                if func.attr == "collective_rpc":
                    name = _constant_str(call.args[0]) if call.args else None
                    names |= {name} if name else set()
                else:
                    names |= self._executor_rpcs(klass, func.attr, depth + 1)
        self._rpcs[key] = frozenset(names)
        return self._rpcs[key]

    def _kv_cache_function(self, func: ast.expr) -> str:
        """The name of the KV-cache planning function called, or ''. A name imported from one of
        those modules counts even where this release moved it (an adapter may put it back)."""
        if isinstance(func, ast.Name) and func.id in self.names.imports:
            module, attr = self.names.imports[func.id]
            found = self.names.found(func.id)
            defined = found.module if found is not None else module
            if attr and (defined.startswith(KV_CACHE_MODULES) or module.startswith(KV_CACHE_MODULES)) and (
                    found is None or isinstance(found.node, FUNCTIONS)):
                return attr
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            holder = self.names.found(func.value.id)
            if holder is not None and isinstance(holder.node, ast.Module) and holder.module.startswith(KV_CACHE_MODULES):
                member = self.index.top_level(holder.module, func.attr)
                if isinstance(member, Found) and isinstance(member.node, FUNCTIONS):
                    return func.attr
        return ""

    def _own_method(self, name: str):
        """The class's own method ``name`` (vLLM's classes: through their vLLM bases too)."""
        for node in self.klass.body:
            if isinstance(node, FUNCTIONS) and node.name == name:
                return node
        if self.module.split(".")[0] == "vllm":
            found = self.index.member(Found(self.klass, self.module, self.label), name)
            if isinstance(found, Found) and isinstance(found.node, FUNCTIONS):
                self._labels[id(found.node)] = found.file
                return found.node
        return None


def _condition(test: ast.expr, function) -> str:
    """An ``if`` test as written; a local flag is shown with what it was set to
    (``extensible (= vllm_config.cache_config.enable_extensible_kv_cache)``)."""
    name = test.operand if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not) else test
    text = ast.unparse(test)
    if isinstance(name, ast.Name) and function is not None:
        values = [node.value for node in ast.walk(function) if isinstance(node, ast.Assign)
                  and any(isinstance(t, ast.Name) and t.id == name.id for t in node.targets)]
        if len(values) == 1:
            text += f" (= {ast.unparse(values[0])})"
    return text


def _constant_str(node: ast.expr) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _is_self(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id == "self"


def _is_self_attr(node: ast.expr, name: str) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == name and _is_self(node.value)


def _is_none(node: ast.expr | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is None


def _parameter(function, name: str) -> ast.arg | None:
    if function is None:
        return None
    args = function.args
    return next((a for a in args.posonlyargs + args.args + args.kwonlyargs if a.arg == name), None)
