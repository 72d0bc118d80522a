"""The adapter registry: discover, decide, apply, report, revert.

Decision for one adapter, in order:

1. named in ``VLLM_COMPAT_DISABLE`` (or ``apply(disable=...)``), or one of the adapters it
   ``requires`` is disabled or failed -> ``disabled``;
2. vLLM not installed, or the consumer (speculators) version outside the adapter's range ->
   ``not_needed``;
3. host probe (e.g. "no CUDA device") says no -> ``not_needed``;
4. the live probe: old shape -> ``not_needed``; new shape -> patch; neither -> ``unknown_drift``.
   The version range (docs/drift-atlas.md) is a cross-check: a release inside the range whose
   probe still finds the old shape is ``unknown_drift`` too (nightlies, which sit between releases,
   are not).

Every adapter that gets as far as the probe is also checked against its ``verified_through``: on a
newer vLLM its result says "not verified on X" (a warning), and strict mode refuses.

Patches whose module is not imported yet (speculators' modules, model files) are installed by a
post-import hook (status ``armed`` until then). :func:`revert` undoes everything in reverse order.
"""
from __future__ import annotations

import importlib
import logging
import os
import pkgutil
import sys
import threading
from dataclasses import replace
from functools import lru_cache

from packaging.version import Version

from . import wrapping
from .adapter import Adapter, Patch, Scope
from .errors import AdapterNotApplicable, NotVerifiedError, UnknownDriftError
from .report import APPLIED, ARMED, DISABLED, FAILED, NOT_NEEDED, UNKNOWN_DRIFT, AdapterResult, Report
from .versions import has_module, in_range, speculators_version, vllm_version

logger = logging.getLogger("vllm_compat")

ENV_APPLY = "VLLM_COMPAT_APPLY"  # set by apply(): tells the vLLM plugin in spawned processes to act
ENV_DISABLE = "VLLM_COMPAT_DISABLE"  # comma-separated adapter ids
ENV_STRICT = "VLLM_COMPAT_STRICT"  # "1": unknown drift, or a vLLM newer than verified, raises

_lock = threading.RLock()
_installed: dict[str, list[wrapping.Installed]] = {}
_results: dict[str, AdapterResult] = {}
_pending: dict[str, set[str]] = {}  # adapter id -> targets still waiting for their module
_generation = 0  # bumped by revert(); post-import hooks of an older generation do nothing
_active = False
_role = "parent"
_saved_env: dict[str, tuple[str | None, str | None]] = {}  # variable -> (before apply(), as apply() left it)
_applied_with: dict[str, object] = {}  # the first apply()'s arguments, as it took them in effect


@lru_cache(maxsize=None)
def adapters() -> tuple[Adapter, ...]:
    """Every adapter shipped in :mod:`vllm_compat.adapters`, in application order."""
    package = importlib.import_module(f"{__package__}.adapters")
    found = []
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        adapter = getattr(module, "ADAPTER", None)
        if adapter is None:
            continue
        if adapter.id != info.name:
            raise RuntimeError(f"adapter module {info.name} declares id {adapter.id!r}")
        found.append(adapter)
    return _in_application_order(found)


def _in_application_order(found: list[Adapter]) -> tuple[Adapter, ...]:
    """Phase by phase; inside a phase after the adapters it requires, else by id. A requirement
    that is unknown, or in a later phase, is a declaration error."""
    by_id = {a.id: a for a in found}
    for adapter in found:
        for needed in adapter.requires:
            if needed not in by_id:
                raise RuntimeError(f"adapter {adapter.id} requires unknown adapter {needed!r}")
            if by_id[needed].phase > adapter.phase:
                raise RuntimeError(f"adapter {adapter.id} requires {needed}, which is applied in a later phase")
    ordered: list[Adapter] = []
    placed: set[str] = set()
    pending = sorted(found, key=lambda a: (a.phase, a.id))
    while pending:
        ready = next((a for a in pending if placed.issuperset(a.requires)), None)
        if ready is None:
            raise RuntimeError(f"adapters require each other in a cycle: {', '.join(a.id for a in pending)}")
        ordered.append(ready)
        placed.add(ready.id)
        pending.remove(ready)
    return tuple(ordered)


def wrapper_stacks() -> dict[str, tuple[str, ...]]:
    """Every patch target that more than one adapter replaces, with those adapters' ids outermost
    first. They nest in application order (:func:`adapters`): the one applied later wraps the ones
    before it, so a call passes through them in this order and :func:`revert` takes them off in it.
    docs/adapters.md shows these stacks; a unit test pins them, a contract test checks the live chain
    after :func:`apply` (:func:`vllm_compat.wrapping.stack`) against them."""
    by_target: dict[str, list[str]] = {}
    for adapter in adapters():
        for patch in adapter.patches:
            ids = by_target.setdefault(patch.target, [])
            if adapter.id not in ids:
                ids.append(adapter.id)
    return {target: tuple(reversed(ids)) for target, ids in by_target.items() if len(ids) > 1}


def newest_verified() -> Version:
    """The newest vLLM release every adapter still bridging drift there was verified on (an adapter
    whose range ended before it does nothing there)."""
    return min(a.verified_through for a in adapters() if a.open_ended)


def get(adapter_id: str) -> Adapter:
    for adapter in adapters():
        if adapter.id == adapter_id:
            return adapter
    raise AdapterNotApplicable(f"no adapter named {adapter_id!r}; known: {', '.join(a.id for a in adapters())}")


def _env_list(name: str) -> set[str]:
    return {item.strip() for item in os.environ.get(name, "").split(",") if item.strip()}


def _known_ids(disabled: set[str], origin: str) -> set[str]:
    unknown = sorted(disabled - {a.id for a in adapters()})
    if unknown:
        raise AdapterNotApplicable(f"{origin} names no adapter {', '.join(map(repr, unknown))}; "
                                   f"known: {', '.join(a.id for a in adapters())}")
    return disabled


def _result(adapter: Adapter, status: str, reason: str, where: str = "") -> AdapterResult:
    return AdapterResult(adapter.id, status, reason, adapter.scope.value, where)


def _gate(adapter: Adapter, vllm, spec_version, disabled: set[str]) -> AdapterResult | None:
    """The cheap checks (no vLLM import): a final result, or None to go on to the probe."""
    if adapter.id in disabled:
        return _result(adapter, DISABLED, f"disabled by {ENV_DISABLE}")
    for needed in adapter.requires:
        if needed in disabled or _results.get(needed) is not None and _results[needed].status in (DISABLED, FAILED):
            why = _results[needed].status if needed in _results else DISABLED
            return _result(adapter, DISABLED, f"disabled by dependency: requires {needed}, which is {why}")
    if vllm is None:
        return _result(adapter, NOT_NEEDED, "vLLM is not installed")
    if adapter.speculators is not None:
        if spec_version is None:
            return _result(adapter, NOT_NEEDED, "speculators is not installed")
        if not in_range(adapter.speculators, spec_version):
            return _result(adapter, NOT_NEEDED,
                           f"speculators {spec_version} does not need it (only {adapter.speculators})")
    return None


def _probe_and_activate(adapter: Adapter, vllm) -> AdapterResult:
    """Host probe, then the live shape probe; patch when it says the new shape is there."""
    from .probes.live import live
    from .probes.verdicts import ADAPTED, NATIVE, judge

    try:
        if adapter.host_probe is not None:
            needed, detail = adapter.host_probe()
            if not needed:
                return _result(adapter, NOT_NEEDED, detail)
        verdict = judge(adapter, live(), vllm)
    except Exception as exc:
        logger.exception("vllm-compat: probe of %s failed", adapter.id)
        return _result(adapter, FAILED, f"probe raised {type(exc).__name__}: {exc}")
    if verdict.verdict == ADAPTED:
        return _activate(adapter, verdict.reason, verdict.where)
    status = NOT_NEEDED if verdict.verdict == NATIVE else UNKNOWN_DRIFT
    return _result(adapter, status, verdict.reason, verdict.where)


def _with_verification(adapter: Adapter, result: AdapterResult, vllm) -> AdapterResult:
    """The result, marked when ``vllm`` is newer than the newest release the adapter was verified on."""
    if adapter.verified_on(vllm):
        return result
    return replace(result, unverified=f"not verified on vllm {vllm} (verified through {adapter.verified_through})")


def _on_import_decide(adapter: Adapter, vllm, generation: int):
    def hook(_module) -> None:
        with _lock:
            if generation == _generation and _active:
                _results[adapter.id] = result = _with_verification(adapter, _probe_and_activate(adapter, vllm), vllm)
                logger.log(_level(result), "vllm-compat (%s, pid %d): %s", _role, os.getpid(), result)

    return hook


def _install_now(adapter: Adapter, patch: Patch) -> None:
    record = wrapping.install(patch.target, patch.factory, owner=adapter.id, optional=patch.optional,
                               create=patch.create)
    if record is not None:
        _installed.setdefault(adapter.id, []).append(record)


def _on_import(adapter: Adapter, patch: Patch, generation: int):
    def hook(_module) -> None:
        with _lock:
            if generation != _generation or not _active:
                return
            try:
                _install_now(adapter, patch)
            except Exception as exc:  # a hook must never break the importing code
                logger.exception("vllm-compat: %s failed to patch %s", adapter.id, patch.target)
                _undo(adapter.id)
                _results[adapter.id] = AdapterResult(adapter.id, FAILED, f"{type(exc).__name__}: {exc}",
                                                     adapter.scope.value)
                return
            waiting = _pending.get(adapter.id, set())
            waiting.discard(patch.target)
            if not waiting and _results.get(adapter.id, None) and _results[adapter.id].status == ARMED:
                _results[adapter.id] = replace(_results[adapter.id], status=APPLIED)

    return hook


def _activate(adapter: Adapter, reason: str, where: str) -> AdapterResult:
    import wrapt

    waiting: set[str] = set()
    try:
        for patch in adapter.patches:
            # vLLM modules are imported to be patched now; so is sys.modules itself
            if patch.module in sys.modules or patch.module.split(".")[0] in ("vllm", "sys"):
                _install_now(adapter, patch)
            else:
                waiting.add(patch.target)
    except Exception as exc:
        logger.exception("vllm-compat: %s failed", adapter.id)
        _undo(adapter.id)
        return AdapterResult(adapter.id, FAILED, f"{type(exc).__name__}: {exc}", adapter.scope.value, where)
    if waiting:
        _pending[adapter.id] = waiting
        for patch in adapter.patches:
            if patch.target in waiting:
                wrapt.register_post_import_hook(_on_import(adapter, patch, _generation), patch.module)
        modules = sorted({t.split(":")[0] for t in waiting})
        return AdapterResult(adapter.id, ARMED, f"{reason}; patches when {', '.join(modules)} is imported",
                             adapter.scope.value, where)
    return AdapterResult(adapter.id, APPLIED, reason, adapter.scope.value, where)


def _undo(adapter_id: str) -> None:
    for record in reversed(_installed.pop(adapter_id, [])):
        wrapping.uninstall(record)
    _pending.pop(adapter_id, None)


def apply(
    *,
    disable: tuple[str, ...] | list[str] = (),
    strict: bool | None = None,
    scopes: tuple[Scope, ...] | None = None,
    role: str = "parent",
) -> Report:
    """Apply every adapter the installed vLLM and consumer need; idempotent.

    Args:
        disable: adapter ids to leave alone, added to ``VLLM_COMPAT_DISABLE``.
        strict: raise :class:`UnknownDriftError` on unknown drift, and :class:`NotVerifiedError`
            when an adapter this vLLM needs was not verified on it (default: ``VLLM_COMPAT_STRICT``).
        scopes: only adapters of these scopes (the vLLM plugin passes ``(Scope.WORKER,)``).
        role: how this process is named in logs and reports.

    Returns:
        The :class:`Report`. A second call returns the report of the first; when its arguments
        (in effect: ``disable`` together with ``VLLM_COMPAT_DISABLE``, ``strict`` or
        ``VLLM_COMPAT_STRICT``, ``scopes``, ``role``) differ from the first call's, it logs one
        warning naming each difference and changes nothing (:func:`revert` first to apply otherwise).

    Raises:
        AdapterNotApplicable: ``disable`` or ``VLLM_COMPAT_DISABLE`` names an unknown adapter.
    """
    import wrapt

    global _active, _role
    with _lock:
        arguments = _arguments(disable, strict, scopes, role)
        if _active:
            _warn_if_other(arguments)
            return status()
        _applied_with.clear()
        _applied_with.update(arguments)
        disabled = _known_ids(_env_list(ENV_DISABLE), ENV_DISABLE) | _known_ids(set(disable), "apply(disable=...)")
        before = {name: os.environ.get(name) for name in (ENV_APPLY, ENV_DISABLE, ENV_STRICT)}
        if disabled:
            os.environ[ENV_DISABLE] = ",".join(sorted(disabled))
        strict = arguments["strict"]  # the explicit value, else VLLM_COMPAT_STRICT's
        if strict:
            os.environ[ENV_STRICT] = "1"
        # Spawned vLLM processes inherit this and their plugin applies the worker adapters.
        os.environ[ENV_APPLY] = "1"
        _saved_env.clear()
        _saved_env.update({name: (value, os.environ.get(name)) for name, value in before.items()})
        _active, _role = True, role
        vllm, spec_version = vllm_version(), speculators_version()
        for adapter in adapters():
            if scopes is not None and adapter.scope not in scopes:
                continue
            gated = _gate(adapter, vllm, spec_version, disabled)
            if gated is not None:
                _results[adapter.id] = gated
            elif adapter.deferred and adapter.patches[0].module not in sys.modules:
                module = adapter.patches[0].module
                if not has_module(module):  # it would wait forever
                    _results[adapter.id] = _result(adapter, NOT_NEEDED, f"this vLLM has no {module}")
                    continue
                wrapt.register_post_import_hook(_on_import_decide(adapter, vllm, _generation), module)
                _results[adapter.id] = _with_verification(
                    adapter, _result(adapter, ARMED, f"probed and patched when {module} is imported"), vllm)
            else:
                _results[adapter.id] = _with_verification(adapter, _probe_and_activate(adapter, vllm), vllm)
        report = status()
        _log(report)
        if strict and report.unknown_drift:
            raise UnknownDriftError(report.unknown_drift)
        if strict and report.unverified:
            raise NotVerifiedError(report.unverified)
        return report


def _arguments(disable, strict, scopes, role) -> dict[str, object]:
    """apply()'s arguments as they take effect (the environment variables included), comparable."""
    return {
        "disable": tuple(sorted(_env_list(ENV_DISABLE) | set(disable))),
        "strict": strict if strict is not None else os.environ.get(ENV_STRICT) == "1",
        "scopes": None if scopes is None else tuple(sorted(Scope(s).value for s in scopes)),
        "role": role,
    }


def _warn_if_other(arguments: dict[str, object]) -> None:
    """One warning for a repeated apply() whose arguments differ from the first call's, naming what
    differed (as OpenTelemetry's instrumentors warn on a second instrument()); silent otherwise."""
    differences = [f"{name} {_applied_with.get(name)!r} -> {value!r}" for name, value in arguments.items()
                   if _applied_with.get(name) != value]
    if differences:
        logger.warning("vllm-compat: apply() called again with other arguments (%s); ignored, the first "
                       "call's adapters stay as they are (revert() first to apply with these)",
                       "; ".join(differences))


def _level(result: AdapterResult) -> int:
    """A result's log level: the one INFO line per process is the summary (docs/usage.md)."""
    if result.status == FAILED:
        return logging.ERROR
    if result.status == UNKNOWN_DRIFT or result.unverified:
        return logging.WARNING
    return logging.DEBUG


def _log(report: Report) -> None:
    for result in report.results:
        logger.log(_level(result), "vllm-compat: %s", result)
    # each name under its own status: "1 applied, 17 armed; applied: (18 names)" contradicted itself
    named = "".join(f"; {status}: {', '.join(r.id for r in report.by_status(status))}"
                    for status in (APPLIED, ARMED) if report.by_status(status))
    logger.info("%s%s", report.summary(), named)


def revert() -> None:
    """Undo every patch (reverse order), stop arming spawned processes, and give the environment
    variables apply() set (``VLLM_COMPAT_APPLY``, ``_DISABLE``, ``_STRICT``) their earlier values
    (a variable changed since apply() is left as it is). Safe to call twice."""
    global _generation, _active
    with _lock:
        for adapter in reversed(adapters()):
            _undo(adapter.id)
        _results.clear()
        _generation += 1
        _active = False
        for name, (value, ours) in _saved_env.items():
            if os.environ.get(name) != ours:  # changed since apply(): someone else's value now
                continue
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        _saved_env.clear()
        _applied_with.clear()


def status() -> Report:
    """The current state: what is applied, armed, skipped, and why."""
    with _lock:
        vllm, spec_version = vllm_version(), speculators_version()
        ordered = tuple(_results[a.id] for a in adapters() if a.id in _results)
        return Report(
            vllm_version=str(vllm) if vllm else None,
            newest_verified=str(newest_verified()),
            speculators_version=str(spec_version) if spec_version else None,
            results=ordered,
            pid=os.getpid(),
            role=_role,
        )


def is_active() -> bool:
    return _active
