"""Subclass contracts: what a consumer class owes the vLLM classes it derives from, read with ``ast``.

For each class of a consumer module whose bases resolve to vLLM classes (an imported name, a module
alias such as ``mod.Base``, or the module's own classes deriving from them), against vLLM's class
order read from source (:meth:`VllmIndex.mro`):

* **abstract methods** (``@abstractmethod`` on an ``ABC``) left unimplemented by the consumer class
  and its bases: a PROBLEM at the ``class`` line (instantiating it raises ``TypeError``);
* **override signatures**: a consumer method overriding a vLLM method must still accept what vLLM
  passes to it: the base's required parameters (a required one the override has neither room for
  by position nor a name for, nor ``*args``/``**kwargs``; a required keyword-only one it has no name
  for), and no parameter required by the override that the base does not have: a PROBLEM at the
  ``def`` line, naming the base's file:line;
* **overrides of nothing**: a method vLLM's classes do not define that the consumer's module never
  calls itself (so it was written for the base to call): a warning, since it may equally be a helper
  for other code. Where any base is unreadable (outside vLLM) nothing is said about it.

Only what is certain is a PROBLEM: a parameter renamed in the base is not reported (whether vLLM
passes it by keyword is not read), nor a base's optional parameter the override requires.
"""
from __future__ import annotations

import ast
import sys

from ..probes.static import Found, defining_nodes
from .analyzer import CLASS, ModuleAnalysis
from .signatures import FUNCTIONS, Signature, VllmIndex, _decorator_names, function_signature
from .status import OK, PROBLEM, WARNING

KIND = "contract"


def _consumer_chain(node: ast.ClassDef, classes: dict[str, ast.ClassDef], analysis: ModuleAnalysis,
                    seen: set[int] | None = None) -> tuple[list[ast.ClassDef], list[Found], bool]:
    """(the consumer's classes in order, own class first; the vLLM bases they name; whether every
    base is known: a vLLM class, one of the module's own classes, or an inert one like ``object``)."""
    seen = seen if seen is not None else set()
    seen.add(id(node))
    chain, vllm, complete = [node], [], True
    for expr in node.bases:
        target = expr.value if isinstance(expr, ast.Subscript) else expr
        if isinstance(target, ast.Name) and target.id in classes:
            own = classes[target.id]
            if id(own) in seen:
                continue
            sub_chain, sub_vllm, sub_complete = _consumer_chain(own, classes, analysis, seen)
            chain += sub_chain
            vllm += sub_vllm
            complete = complete and sub_complete
            continue
        value = analysis.module_scope.value(target)
        if value is not None and value.kind == CLASS and value.found is not None:
            vllm.append(value.found)
        elif getattr(target, "id", getattr(target, "attr", "")) not in ("object", "ABC", "Generic", "Protocol"):
            complete = False
    return chain, vllm, complete


def _vllm_order(index: VllmIndex, bases: list[Found]) -> tuple[list[Found], bool]:
    order: list[Found] = []
    complete = True
    for base in bases:
        mro, known = index.mro(base)
        complete = complete and known
        order += [c for c in mro if not any(c.node is o.node for o in order)]
    return order, complete


def _definitions(klass: ast.ClassDef) -> dict[str, ast.AST]:
    """The last definition of each name in a class body (methods, assignments)."""
    found: dict[str, ast.AST] = {}
    for stmt in klass.body:
        for node in defining_nodes(stmt):
            if isinstance(node, (*FUNCTIONS, ast.ClassDef)):
                if "overload" not in _decorator_names(node):
                    found[node.name] = node
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        found[target.id] = node
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
                found[node.target.id] = node
    return found


def _is_abstract(node: ast.AST) -> bool:
    return isinstance(node, FUNCTIONS) and "abstractmethod" in _decorator_names(node)


def _uses_abc(klass: ast.ClassDef) -> bool:
    names = {getattr(b, "id", getattr(b, "attr", "")) for b in klass.bases}
    meta = {getattr(k.value, "id", getattr(k.value, "attr", "")) for k in klass.keywords if k.arg == "metaclass"}
    return "ABC" in names or "ABCMeta" in meta


def _kind(node: ast.AST) -> str:
    decorators = _decorator_names(node)
    for kind in ("staticmethod", "classmethod", "property", "cached_property"):
        if kind in decorators:
            return "property" if kind == "cached_property" else kind
    return "method"


def _called_names(tree: ast.Module) -> set[str]:
    """Every ``x.name`` the module reads: a method it calls on itself is a helper, not an override."""
    return {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}


def signature_problems(base: Signature, override: Signature) -> list[str]:
    """Why ``override`` no longer accepts every call vLLM makes to ``base`` (certain cases only)."""
    problems = []
    override_names = {name for name, _ in override.positional if name not in override.positional_only}
    override_names |= {name for name, _ in override.keyword_only}
    required_positional = [name for name, required in base.positional if required]
    too_many = len(required_positional) > len(override.positional) and not override.var_positional
    for position, (name, required) in enumerate(base.positional):
        # passed positionally the override has no room for it, by keyword no parameter of that name:
        # certain either way (a name alone missing may be a rename vLLM never passes by keyword)
        if required and too_many and name not in override_names and not override.var_keyword:
            problems.append(f"base requires {name!r} (argument {position + 1}), the override does not accept it")
    for name, required in base.keyword_only:
        if required and name not in override_names and not override.var_keyword:
            problems.append(f"base requires keyword {name!r}, the override does not accept it")
    base_names = {name for name, _ in base.positional + base.keyword_only}
    for position, (name, required) in enumerate(override.positional):
        if (required and position >= len(base.positional) and not base.var_positional and name not in base_names
                and not base.var_keyword):
            problems.append(f"the override requires {name!r}, which the base (so vLLM's calls) does not pass")
    for name, required in override.keyword_only:
        if required and name not in base_names and not base.var_keyword:
            problems.append(f"the override requires keyword {name!r}, which the base (so vLLM's calls) does not pass")
    return problems


def subclass_contracts(index: VllmIndex, tree: ast.Module, label: str, package: str = "",
                       analysis: ModuleAnalysis | None = None, finding: type | None = None) -> list:
    """The contract findings (the call-site audit's ``CallSite``, kind ``contract``; ``finding``: another
    type with its fields) of one consumer module: ``label`` names it in file:line, ``package`` resolves
    its relative imports; ``analysis`` (the module's :class:`ModuleAnalysis`, if already made) is
    reused to resolve base expressions."""
    # the package's own finding type, read from the loaded package: importing it would make an
    # import circle (the package imports this module); a submodule is only loaded after its package
    finding = finding or sys.modules[__package__].CallSite

    analysis = analysis or ModuleAnalysis(index, tree, label, package)
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    called = _called_names(tree)
    findings = []
    for klass in classes.values():
        chain, bases, consumer_known = _consumer_chain(klass, classes, analysis)
        if not bases:
            continue
        order, vllm_known = _vllm_order(index, bases)
        base_names = ", ".join(f"{b.module}:{b.node.name}" for b in bases)  # type: ignore[attr-defined]
        site = f"{label}:{klass.lineno}"

        def add(line_node, target, where, status, problem=""):
            findings.append(finding(f"{label}:{line_node.lineno}", KIND, target, where, status, problem))

        # (a) abstract methods nobody implements
        own = [_definitions(c) for c in chain]
        vllm_defs = [(c, _definitions(c.node)) for c in order]  # type: ignore[arg-type]
        marks_abstract = any(_is_abstract(n) for d in own for n in d.values()) or _uses_abc(klass)
        enforced = any(_uses_abc(c.node) for c in order)  # type: ignore[arg-type]
        if consumer_known and enforced and not marks_abstract:
            names = {name for _, defs in vllm_defs for name, node in defs.items() if _is_abstract(node)}
            for name in sorted(names):
                if any(name in d for d in own):
                    continue
                nearest = next((c, defs[name]) for c, defs in vllm_defs if name in defs)
                if _is_abstract(nearest[1]):
                    holder = nearest[0]
                    where = Found(nearest[1], holder.module, holder.file).where
                    target = f"{holder.module}:{holder.node.name}.{name}"  # type: ignore[attr-defined]
                    findings.append(finding(site, KIND, target, where, PROBLEM,
                                             f"abstract method {holder.node.name}.{name} not implemented by "  # type: ignore[attr-defined]
                                             f"{klass.name}"))

        # (b) overrides that no longer accept vLLM's calls, (c) overrides of nothing
        for name, node in _definitions(klass).items():
            if not isinstance(node, FUNCTIONS) or (name.startswith("__") and name.endswith("__")):
                continue
            nearest = next(((c, defs[name]) for c, defs in vllm_defs if name in defs), None)
            if nearest is None:
                if consumer_known and vllm_known and name not in called and not any(name in d for d in own[1:]):
                    if not any(index.member(b, name) is True for b in bases):
                        add(node, f"{base_names}.{name}", "", WARNING,
                            f"{klass.name}.{name} overrides nothing in this vLLM's {base_names}")
                continue
            holder, base_node = nearest
            where = Found(base_node, holder.module, holder.file).where
            target = f"{holder.module}:{holder.node.name}.{name}"  # type: ignore[attr-defined]
            if not isinstance(base_node, FUNCTIONS):
                continue
            base_kind, own_kind = _kind(base_node), _kind(node)
            if (base_kind == "property") != (own_kind == "property"):
                add(node, target, where, PROBLEM, f"base is a {base_kind}, the override a {own_kind}")
                continue
            if base_kind == "property" or _decorator_names(base_node) - {
                    "staticmethod", "classmethod", "abstractmethod", "override"}:
                add(node, target, where, OK)
                continue  # a decorator that may change the signature: not judged
            base_sig = function_signature(base_node, where, bound=base_kind != "staticmethod")
            own_sig = function_signature(node, f"{label}:{node.lineno}", bound=own_kind != "staticmethod")
            problems = signature_problems(base_sig, own_sig)
            for problem in problems:
                add(node, target, where, PROBLEM, problem)
            if not problems:
                add(node, target, where, OK)
    return findings


__all__ = ["KIND", "OK", "PROBLEM", "WARNING", "signature_problems", "subclass_contracts"]
