"""The call-site audit: every reference the consumer's code and our adapters make into vLLM.

Read with ``ast`` from source (never imported): each consumer's modules that its scan reads and that
mention vLLM (speculators: its ``data_generation`` modules; any other: every module of its packages),
and the modules of every adapter the audit found ``adapted`` (plus the helper modules they import).
Each import, call, method call and attribute read whose target is known is checked against vLLM's
definition (:mod:`.signatures`). A break is then

* **bridged** when an ``adapted`` adapter is about exactly that target: for a parameter, its
  ``expect`` check is a ``Param`` or ``FieldDefault`` on the same callable (or class) and the same
  parameter name; for a missing name, its ``expect`` check names it (``Exists``/``Attr``/``WhichAttr``)
  or one of its patches creates it (``create=True``) at that target or at the consumer's own name
  for it. A patch alone does not say which parameter it fixes, so it never bridges a parameter.
* a **PROBLEM** otherwise. An adapter's own call into vLLM that no longer fits is always a problem.
"""
from __future__ import annotations

import ast
import importlib.util
import zipfile
from dataclasses import dataclass, replace
from pathlib import Path

from ..adapter import Adapter
from ..consumer import GENERATOR, SPECULATORS_AUDIT
from ..consumer_tree import Consumer, builtin, module_of
from ..probes.shapes import Attr, Exists, FieldDefault, Param, WhichAttr
from ..probes.static import Found, StaticSource
from .analyzer import CLASS, INSTANCE, METHOD, ModuleAnalysis, Reference, Value, _join
from .signatures import FUNCTIONS, VllmIndex

from .status import BRIDGED, OK, PROBLEM, WARNING  # noqa: F401  (the audit reads them here)
CONSUMER_PACKAGE = "speculators.data_generation"
HERE = Path(__file__).resolve().parent.parent  # vllm_compat/


@dataclass(frozen=True)
class CallSite:
    """One checked reference. ``status``: ok / bridged / PROBLEM; ``by``: the bridging adapter."""

    site: str
    kind: str
    target: str
    where: str
    status: str
    problem: str = ""
    by: str = ""
    consumer: str = ""  # whose code: "speculators==X", "PKG==X"; '' for vllm-compat's own adapters


def consumer_root(package: str = SPECULATORS_AUDIT.package) -> Path | None:
    """The directory holding the installed ``package`` (located, not imported)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))).parent


def _parse(path: Path, text: str | None = None) -> ast.Module | None:
    try:
        return ast.parse(path.read_text(encoding="utf-8") if text is None else text, filename=str(path))
    except (OSError, SyntaxError):
        return None


def consumer_files(root: Path) -> dict[str, str]:
    """``{file name: text}`` of the consumer's ``data_generation`` modules, from a directory holding
    ``speculators/`` or from a speculators wheel (read inside the zip)."""
    folder = "/".join(CONSUMER_PACKAGE.split("."))
    if root.is_file():
        with zipfile.ZipFile(root) as wheel:
            return {name.rsplit("/", 1)[1]: wheel.read(name).decode("utf-8", errors="replace")
                    for name in wheel.namelist() if name.startswith(f"{folder}/") and name.count("/") == 2
                    and name.endswith(".py")}
    return {path.name: path.read_text(encoding="utf-8", errors="replace")
            for path in sorted((root / folder).glob("*.py"))}


def package_analyses(index: VllmIndex, consumer: Consumer) -> list[tuple[ModuleAnalysis, ast.Module]]:
    """Every module of a consumer that its scan reads and that mentions vLLM, each with its own
    package for relative imports."""
    found = []
    for rel, text in consumer.files().items():
        tree = _parse(Path(rel), text)
        if tree is not None:
            module, package = module_of(rel)
            found.append((ModuleAnalysis(index, tree, rel, package, name=module), tree))
    return found


def _contracts(index: VllmIndex, analysis: ModuleAnalysis, tree: ast.Module) -> list[CallSite]:
    """Subclass contracts of one consumer module (:mod:`.contracts`)."""
    from .contracts import subclass_contracts

    return list(subclass_contracts(index, tree, analysis.label, analysis.package))


def check_consumer(source: StaticSource, adapted: list[Adapter], consumer: Consumer) -> list[CallSite]:
    """Every call site of one consumer, checked against ``source``. Only a consumer that runs
    ``vllm_compat.apply()`` is bridged by the ``adapted`` adapters; any other's breaks are problems."""
    bridges = _bridges(consumer, adapted)
    return _consumer_sites(adapted_index(source, bridges), bridges, consumer)[0]


def _bridges(consumer: Consumer, adapted: list[Adapter]) -> list[Adapter]:
    """The adapters that bridge ``consumer``'s breaks: the adapted ones where it runs ``apply()``."""
    return adapted if consumer.applies_shim else []


def _consumer_sites(index: VllmIndex, bridges: list[Adapter], consumer: Consumer
                    ) -> tuple[list[CallSite], list[ModuleAnalysis]]:
    """The consumer's call sites read against ``index`` (bridged by ``bridges``), and its modules."""
    results, analyses = [], []
    for analysis, tree in package_analyses(index, consumer):
        analyses.append(analysis)
        for ref in analysis.references:
            by = bridging(ref, bridges, index, analysis.name) if ref.problem else ""
            typing_only = ref.typing_only and consumer.scan.typing_warnings
            status = OK if not ref.problem else BRIDGED if by else WARNING if typing_only else PROBLEM
            results.append(CallSite(ref.site, ref.kind, ref.target, ref.where, status, ref.problem, by,
                                    consumer.tag))
        if consumer.scan.contracts:
            results += [replace(c, consumer=consumer.tag) for c in _contracts(index, analysis, tree)]
    return results, analyses


def _patch_calls(tree: ast.Module) -> list[ast.Call]:
    """The ``Patch(...)`` calls of the module's ``ADAPTER = Adapter(...)``, in declaration order."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "ADAPTER" for t in node.targets):
            return [c for c in ast.walk(node.value) if isinstance(c, ast.Call) and getattr(c.func, "id", "") == "Patch"]
    return []


class _Targets:
    """Patch targets as values: vLLM-side ones resolved in vLLM, consumer-side ones through the
    consumer module's own bindings."""

    def __init__(self, index: VllmIndex, generator: ModuleAnalysis | None):
        self.index, self.generator = index, generator

    def value(self, target: str) -> Value | None:
        module, _, qual = target.partition(":")
        if self.generator is not None and module == self.generator.name:
            head, *rest = qual.split(".")
            value = self.generator.module_scope.name(head)
            for part in rest:
                if value is None or value.found is None or value.kind not in (CLASS, INSTANCE):
                    return None
                found = self.index.member(value.found, part)
                if not isinstance(found, Found):
                    return None
                value = self.generator._value_of(found, _join(value.target, part), value)
            return value
        if module.split(".")[0] != "vllm":
            return None
        found = self.index.resolve(target)
        if not isinstance(found, Found):
            return None
        kind = {ast.ClassDef: CLASS}.get(type(found.node), "function")
        return Value(kind, target, found)


def _seeds(tree: ast.Module, adapter: Adapter, targets: _Targets) -> dict[str, dict[str, Value]]:
    """Types of the wrapper functions' parameters: ``function_wrapper(f)`` on target T gives
    ``f(wrapped=T, instance=<T's class instance>, ...)``; ``wrap_constructed(name, f)`` on class C gives
    ``f(run=C.name bound, instance=<C instance>, ...)``."""
    functions = {n.name: n for n in tree.body if isinstance(n, FUNCTIONS)}
    seeds: dict[str, dict[str, Value]] = {}
    for call, patch in zip(_patch_calls(tree), adapter.patches):
        factory = call.args[1] if len(call.args) > 1 else next((k.value for k in call.keywords if k.arg == "factory"), None)
        if not isinstance(factory, ast.Call) or not factory.args:
            continue
        maker, fn = getattr(factory.func, "id", ""), factory.args[-1]
        if not isinstance(fn, ast.Name) or fn.id not in functions:
            continue
        params = [a.arg for a in functions[fn.id].args.args]
        target = targets.value(patch.target)
        if target is None or len(params) < 2:
            continue
        if maker == "function_wrapper":
            owner = None
            if target.kind in ("function", METHOD) and "." in target.target.partition(":")[2]:
                klass = targets.value(target.target.rsplit(".", 1)[0])
                owner = Value(INSTANCE, klass.target, klass.found, klass.via) if klass and klass.kind == CLASS else None
            seeds[fn.id] = {params[0]: target._replace(kind=METHOD) if owner else target}
            if owner:
                seeds[fn.id][params[1]] = owner
        elif maker == "wrap_constructed" and target.kind == CLASS and isinstance(factory.args[0], ast.Constant):
            method = targets.index.member(target.found, factory.args[0].value)
            instance = Value(INSTANCE, target.target, target.found, target.via)
            seeds[fn.id] = {params[1]: instance}
            if isinstance(method, Found):
                seeds[fn.id][params[0]] = Value(METHOD, _join(target.target, factory.args[0].value), method, target.via)
    return seeds


def adapter_references(index: VllmIndex, adapted: list[Adapter], generator: ModuleAnalysis | None) -> list[Reference]:
    """What the ``adapted`` adapters (and the helper modules they import) reference in vLLM."""
    targets = _Targets(index, generator)
    references: list[Reference] = []
    helpers: set[str] = set()
    for adapter in adapted:
        path = HERE / "adapters" / f"{adapter.id}.py"
        tree = _parse(path)
        if tree is None:
            continue
        label = f"vllm_compat/adapters/{path.name}"
        analysis = ModuleAnalysis(index, tree, label, "vllm_compat.adapters", _seeds(tree, adapter, targets))
        references += analysis.references
        for call, patch in zip(_patch_calls(tree), adapter.patches):
            if patch.create or patch.target.split(".")[0] != "vllm":
                continue
            found = index.resolve(patch.target)
            where = found.where if isinstance(found, Found) else ""
            references.append(Reference(f"{label}:{call.lineno}", "patch", patch.target, where,
                                        "" if found else "patch target not found", missing=not found))
        for node in ast.walk(tree):  # `from ..host import ...`: the vllm_compat modules it runs
            if isinstance(node, ast.ImportFrom) and node.level == 2 and node.module:
                helpers.add(node.module)
    for helper in sorted(helpers):
        path = HERE.joinpath(*helper.split(".")).with_suffix(".py")
        tree = _parse(path)
        if tree is not None and "vllm" in ast.unparse(tree):
            label = f"vllm_compat/{path.relative_to(HERE).as_posix()}"
            package = ".".join(["vllm_compat", *helper.split(".")[:-1]])
            references += ModuleAnalysis(index, tree, label, package).references
    return references


def _names(check) -> set[str]:
    if isinstance(check, Exists):
        return {check.target}
    if isinstance(check, Attr):
        return {_join(check.target, check.name)}
    if isinstance(check, WhichAttr):
        return {_join(check.target, check.old_name), _join(check.target, check.new_name)}
    return set()


def bridging(ref: Reference, adapted: list[Adapter], index: VllmIndex, module: str = GENERATOR) -> str:
    """The id of the adapted adapter that bridges a consumer's break, or ''."""
    for adapter in adapted:
        check = adapter.expect.check if adapter.expect else None
        if ref.missing:
            if check is not None and ref.target in _names(check):
                return adapter.id
            consumer_name = f"{module}:{ref.via}" if ref.via else None
            if any(p.create and p.target in (ref.target, consumer_name) for p in adapter.patches):
                return adapter.id
        elif ref.param and isinstance(check, (Param, FieldDefault)) and check.name == ref.param:
            found = index.resolve(check.target)
            same = ref.target.removesuffix(".__init__") == check.target.removesuffix(".__init__")
            if same or (isinstance(found, Found) and found.where == ref.where):
                return adapter.id
    return ""


def adapted_index(source: StaticSource, adapted: list[Adapter]) -> VllmIndex:
    """``source`` as the adapted process sees it: names the ``adapted`` adapters put back where they
    used to be are read where they live now."""
    return VllmIndex(source, {p.target: p.alias_of for a in adapted for p in a.patches if p.alias_of})


def check_consumers(source: StaticSource, adapted: list[Adapter], consumers: list[Consumer]) -> list[CallSite]:
    """Every call site of the ``consumers`` and of the ``adapted`` adapters, checked against
    ``source``: those of a consumer with a generator first, then the adapters' own (a patch target
    inside that generator's module is read through the module's bindings), then the other consumers'
    in order. Consumers bridged by the same adapters share one index of ``source``."""
    indexes: dict[tuple[str, ...], VllmIndex] = {}

    def index_for(bridges: list[Adapter]) -> VllmIndex:
        key = tuple(a.id for a in bridges)
        if key not in indexes:
            indexes[key] = adapted_index(source, bridges)
        return indexes[key]

    results: list[CallSite] = []
    generator = None
    for consumer in [c for c in consumers if c.generator is not None]:
        bridges = _bridges(consumer, adapted)
        sites, analyses = _consumer_sites(index_for(bridges), bridges, consumer)
        results += sites
        generator = generator or next((a for a in analyses if a.name == consumer.generator.module), None)
    index = index_for(adapted)
    for ref in adapter_references(index, adapted, generator):
        results.append(CallSite(ref.site, ref.kind, ref.target, ref.where, PROBLEM if ref.problem else OK,
                                ref.problem))
    for consumer in [c for c in consumers if c.generator is None]:
        bridges = _bridges(consumer, adapted)
        results += _consumer_sites(index_for(bridges), bridges, consumer)[0]
    return results


def check(source: StaticSource, adapted: list[Adapter], consumer: Path | None, label: str = "") -> list[CallSite]:
    """Every call site of the speculators under ``consumer`` (a directory holding ``speculators/``,
    or its wheel; None: skip it) and of the ``adapted`` adapters, checked against ``source``;
    ``label`` (``speculators==X``) marks its sites."""
    version = label.partition("==")[2]
    return check_consumers(source, adapted, [builtin(SPECULATORS_AUDIT, version, consumer)])


__all__ = ["BRIDGED", "OK", "PROBLEM", "CallSite", "adapted_index", "check", "check_consumer", "check_consumers",
           "consumer_root"]
