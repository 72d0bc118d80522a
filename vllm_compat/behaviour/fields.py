"""Fields with a default that vLLM added, since a baseline release, to the configs the generator builds.

The generator builds its ``VllmConfig`` and the configs inside it by hand (``CacheConfig(...)``,
``SchedulerConfig(...)``, ...), so a field vLLM adds with a default takes that default there without
anyone choosing it: a new behaviour switched on by default reaches the generator silently. Which
configs: every class of vLLM's ``vllm.config`` package that the generator's module calls, read from
its source. Their fields are those of the dataclass-like class body and its vLLM bases (``x: T =
default``; ``ClassVar`` annotations and ``_private`` state are not fields). The baseline is a generated table
(:mod:`.config_baseline`) of the same fields on the newest verified release.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass

from ..callsites.signatures import VllmIndex
from ..probes.shapes import REQUIRED
from ..probes.static import Found, default_repr
from .names import ModuleNames

CONFIG_PACKAGE = "vllm.config"


@dataclass(frozen=True)
class FieldFinding:
    """A field to review: ``config`` as the generator imports it (``vllm.config:CacheConfig``), the
    field, its default as written, and where it is declared (``file:line``)."""

    config: str
    field: str
    default: str
    where: str


def constructed_configs(names: ModuleNames, tree: ast.Module) -> dict[str, Found]:
    """``{"vllm.config:CacheConfig": class}`` for every config class the module calls."""
    configs: dict[str, Found] = {}
    for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)):
        module, attr = names.imports.get(call.func.id, ("", ""))
        if attr and (module == CONFIG_PACKAGE or module.startswith(f"{CONFIG_PACKAGE}.")):
            klass = names.class_named(call.func)
            if klass is not None:
                configs[f"{module}:{attr}"] = klass
    return configs


def config_fields(index: VllmIndex, klass: Found) -> dict[str, tuple[str, str]]:
    """``{field: (default as written, file:line)}`` of a dataclass-like class and its vLLM bases."""
    fields: dict[str, tuple[str, str]] = {}
    order, _ = index.mro(klass)
    for current in order:
        for stmt in current.node.body:  # type: ignore[attr-defined]
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            if stmt.target.id.startswith("_"):
                continue  # vLLM's own state, never a constructor argument
            if ast.unparse(stmt.annotation).startswith(("ClassVar", "typing.ClassVar", "Final")):
                continue
            fields.setdefault(stmt.target.id, (default_repr(stmt.value), f"{current.file}:{stmt.lineno}"))
    return fields


def added_fields(index: VllmIndex, configs: dict[str, Found],
                 baseline: dict[str, tuple[str, ...]]) -> tuple[list[FieldFinding], list[str]]:
    """(fields with a default that ``baseline`` lacks, configs the baseline does not cover)."""
    findings, uncovered = [], []
    for name, klass in sorted(configs.items()):
        if name not in baseline:
            uncovered.append(name)
            continue
        known = set(baseline[name])
        for field, (default, where) in config_fields(index, klass).items():
            if field not in known and default != REQUIRED:
                findings.append(FieldFinding(name, field, default, where))
    return findings, uncovered


def baseline_table(index: VllmIndex, generators: list[tuple[ast.Module, str]]) -> dict[str, tuple[str, ...]]:
    """The fields of every config class the generator modules ``(tree, package)`` build, on the release
    ``index`` reads: the table :mod:`.config_baseline` holds."""
    table: dict[str, tuple[str, ...]] = {}
    for tree, package in generators:
        for name, klass in constructed_configs(ModuleNames(index, tree, package), tree).items():
            table[name] = tuple(sorted(config_fields(index, klass)))
    return dict(sorted(table.items()))
