"""What a module's top-level names are in vLLM, read from its imports (the module is never imported).

Works for vLLM's own modules and for a consumer's: ``from vllm.x import Y as Z`` makes ``Z`` vLLM's
``vllm.x:Y`` (read where an adapter puts a moved name back, when one does), ``import vllm.x as m``
makes ``m`` the module.
"""
from __future__ import annotations

import ast

from ..callsites.signatures import VllmIndex, absolute_module, single_class_expression
from ..probes.static import Found, defining_nodes


class ModuleNames:
    """The vLLM names one module imports. ``package``: where its relative imports start."""

    def __init__(self, index: VllmIndex, tree: ast.Module, package: str):
        self.index, self.package = index, package
        self.imports: dict[str, tuple[str, str]] = {}  # local name -> (module, attribute or '' for a module)
        for stmt in (n for top in tree.body for n in defining_nodes(top)):
            if isinstance(stmt, ast.ImportFrom):
                module = absolute_module(self.package, stmt)
                for alias in stmt.names:
                    if alias.name != "*":
                        self.imports[alias.asname or alias.name] = (module, alias.name)
            elif isinstance(stmt, ast.Import):
                for alias in stmt.names:
                    if alias.asname:
                        self.imports[alias.asname] = (alias.name, "")

    def found(self, name: str) -> Found | None:
        """vLLM's definition of a top-level ``name`` (a class, function or module), or None."""
        if name not in self.imports:
            return None
        module, attr = self.imports[name]
        if module.split(".")[0] != "vllm":
            return None
        found = self.index.top_level(module, attr) if attr else self.index.module(module)
        if found is None and attr:
            found = self.index.moved_to(module, attr)
        return found if isinstance(found, Found) else None

    def class_named(self, expr: ast.expr | None) -> Found | None:
        """The vLLM class ``expr`` names: ``X``, ``mod.X``, ``"X"``, ``X | None``."""
        expr = single_class_expression(expr)
        found = None
        if isinstance(expr, ast.Name):
            found = self.found(expr.id)
        elif isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name):
            holder = self.found(expr.value.id)
            if holder is not None and isinstance(holder.node, ast.Module):
                member = self.index.top_level(holder.module, expr.attr)
                found = member if isinstance(member, Found) else None
        return found if found is not None and isinstance(found.node, ast.ClassDef) else None
