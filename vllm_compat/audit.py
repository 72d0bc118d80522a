"""``vllm-compat audit``: will this vLLM work with this consumer? Answered in seconds.

Static mode (the default) reads vLLM's source with :mod:`ast` from wherever it is: the installed
package (located with ``importlib.util.find_spec``, never imported), a ``.whl`` file (read inside
the zip) or an unpacked source tree. It needs neither torch nor vLLM importable. Live mode
(``live=True``) imports the installed vLLM and inspects the objects, as ``apply()`` does; both give
the same verdicts for the same release.
"""
from __future__ import annotations

import json
import re
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from . import versions
from ._targets import IN_PROCESS_SPECULATORS
from .errors import VllmCompatError
from .registry import adapters
from .sources import DirTree, LiveSource, StaticSource, Tree, WheelTree
from .touchpoints import TOUCHPOINTS
from .verdicts import ADAPTED, MISSING_SYMBOL, NATIVE, UNKNOWN_DRIFT, judge

OK = "ok"
NOT_APPLICABLE = "n/a"
BAD = (UNKNOWN_DRIFT, MISSING_SYMBOL)
JSON_SCHEMA_VERSION = 1


class AuditError(VllmCompatError):
    """Bad input to the audit (a path that is not a vLLM wheel or tree, an unparsable version)."""


@dataclass(frozen=True)
class Finding:
    """One verdict. ``kind`` is ``adapter`` or ``touchpoint``.

    Attributes:
        id: adapter id, or the touched symbol for touch points.
        verdict: native / adapted / UNKNOWN DRIFT / missing / n/a (adapters); ok / missing / UNKNOWN DRIFT
            (touch points).
        checked: what was looked at.
        old, new: observations meaning the old / new shape (adapters); ``new`` is empty for touch points.
        found: what was observed.
        where: file:line inside the vLLM tree.
        summary: the adapter's one-line summary, or why it is n/a.
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


@dataclass(frozen=True)
class AuditResult:
    source: str
    mode: str
    vllm_version: str | None
    consumer: str | None
    findings: tuple[Finding, ...] = field(default=())

    @property
    def problems(self) -> list[Finding]:
        return [f for f in self.findings if f.verdict in BAD]

    @property
    def exit_code(self) -> int:
        return 1 if self.problems else 0

    def __getitem__(self, finding_id: str) -> Finding:
        for finding in self.findings:
            if finding.id == finding_id:
                return finding
        raise KeyError(finding_id)

    def to_dict(self) -> dict:
        return {"schema": JSON_SCHEMA_VERSION, **asdict(self), "ok": not self.problems}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def render(self) -> str:
        lines = [
            f"vLLM {self.vllm_version or '(version unknown)'} from {self.source} [{self.mode}], "
            f"consumer {self.consumer or 'any'}",
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
        touch = [f for f in self.findings if f.kind == "touchpoint"]
        bad_touch = [f for f in touch if f.verdict in BAD]
        lines += ["", f"other touch points: {len(touch) - len(bad_touch)} ok, {len(bad_touch)} broken"]
        for f in bad_touch:
            lines.append(f"  {f.verdict}: {f.checked}: expected {list(f.old)}, found {f.found} {f.where}".rstrip())
        verdict = "OK: every adapter native or adapted" if not self.problems else (
            f"PROBLEMS: {len(self.problems)} (the generator would break or be wrong)")
        lines += ["", verdict]
        return "\n".join(lines)


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


def _consumer_version(consumer: str | None) -> Version | None:
    if consumer is None:
        return versions.speculators_version()
    name, _, version = consumer.partition("==")
    if name.strip().lower() != "speculators" or not version:
        raise AuditError(f"--consumer {consumer!r}: expected speculators==VERSION")
    return _parse(version, f"--consumer {consumer}")


def _refuse_without_generator(spec_version: Version | None) -> None:
    """Only speculators releases with an in-process generator touch vLLM's internals; for any other,
    "OK, 0 touch points" would be a verdict about nothing."""
    if spec_version is None or versions.in_range(SpecifierSet(IN_PROCESS_SPECULATORS), spec_version):
        return
    if spec_version >= Version("0.5"):
        raise AuditError(f"speculators {spec_version} has no in-process generator for vllm-compat to check: it "
                         f"drives `vllm serve` with vLLM's own extract_hidden_states method (no shim needed; the "
                         f"extractor's --backend vllm-native is that path). The audit covers speculators "
                         f"{IN_PROCESS_SPECULATORS}")
    raise AuditError(f"speculators {spec_version} predates the hidden-states generator vllm-compat keeps working; "
                     f"the audit covers speculators {IN_PROCESS_SPECULATORS}")


def audit(vllm: str | Path | None = None, *, consumer: str | None = None, live: bool = False) -> AuditResult:
    """Check a vLLM against every adapter's expectation and every consumer touch point.

    Args:
        vllm: a ``.whl`` file or a directory holding ``vllm/`` (or the ``vllm/`` directory itself);
            None for the vLLM importable in this interpreter (read, not imported, unless ``live``).
        consumer: ``"speculators==X"``; default: the installed speculators, else any consumer.
        live: import the installed vLLM and inspect live objects (slow; ``vllm`` must be None).

    Returns:
        An :class:`AuditResult`; ``exit_code`` is 1 when anything is unknown drift or missing.

    Raises:
        AuditError: a path that is not a vLLM wheel or tree, or a version that cannot be parsed.
    """
    spec_version = _consumer_version(consumer)
    _refuse_without_generator(spec_version)
    if live:
        if vllm is not None:
            raise AuditError("live mode audits the installed vLLM; drop --vllm or --live")
        source, version, label = LiveSource(), versions.vllm_version(), "installed (imported)"
        if version is None:
            raise AuditError("vLLM is not installed in this interpreter")
    elif vllm is None:
        where = versions.package_dir("vllm")
        if where is None:
            raise AuditError("vLLM is not installed in this interpreter; pass --vllm PATH (a wheel or source tree)")
        source = StaticSource(DirTree(where.parent, str(where)))
        version, label = versions.vllm_version(), f"{where} (installed, not imported)"
    else:
        tree, version = _tree_for(Path(vllm))
        source, label = StaticSource(tree), str(vllm)

    findings = [_adapter_finding(a, source, version, spec_version, installed=vllm is None) for a in adapters()]
    for check, expected, consumers in TOUCHPOINTS:
        if spec_version is not None and not versions.in_range(SpecifierSet(consumers), spec_version):
            continue
        seen = check.observe(source)
        verdict = OK if seen.value in expected else MISSING_SYMBOL if seen.value == "<missing>" else UNKNOWN_DRIFT
        findings.append(Finding(check.target, "touchpoint", verdict, check.describe(), tuple(sorted(expected)),
                                (), seen.value, seen.where))
    return AuditResult(label, source.mode, str(version) if version else None,
                       f"speculators=={spec_version}" if spec_version else None, tuple(findings))


def _adapter_finding(adapter, source, version, spec_version, installed: bool = False) -> Finding:
    common = dict(id=adapter.id, kind="adapter", scope=adapter.scope.value)
    expect = adapter.expect
    checked = expect.check.describe() if expect else adapter.drift
    old, new = (tuple(sorted(expect.old)), tuple(sorted(expect.new))) if expect else ((), ())
    if spec_version is not None and adapter.speculators is not None and not versions.in_range(
            adapter.speculators, spec_version):
        return Finding(**common, verdict=NOT_APPLICABLE, checked=checked, old=old, new=new,
                       summary=f"not used by speculators {spec_version}")
    if installed and adapter.host_probe_static:
        # the installed vLLM comes with the host's packages: read the same fact apply() reads
        needed, detail = adapter.host_probe()
        if not needed:
            return Finding(**common, verdict=NATIVE, checked=checked, old=old, new=new, found=detail,
                           summary=adapter.summary)
    verdict = judge(adapter, source, version)
    note = f" ({adapter.host_note})" if adapter.host_note else ""
    return Finding(**common, verdict=verdict.verdict, checked=checked, old=old, new=new, found=verdict.found,
                   where=verdict.where, summary=adapter.summary + note)


__all__ = ["audit", "AuditResult", "Finding", "AuditError", "ADAPTED", "NATIVE"]
