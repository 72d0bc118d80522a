"""The declaration every adapter module exports as ``ADAPTER``: data, no import-time side effects."""
from __future__ import annotations

import enum
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from .probes.shapes import Check

# an engine step as the audit names it: role (executor, scheduler, rpc, kv_cache) and method or function
STEP_ID = re.compile(r"[a-z_]+\.[A-Za-z_][A-Za-z0-9_]*")


class Scope(str, enum.Enum):
    """Where an adapter's patches must live, and who sees them.

    * ``global``: safe for every caller of vLLM (accepts and drops a keyword vLLM no longer takes);
      patched where the object is defined, and on names consumers imported by value.
    * ``consumer``: only for a consumer expecting old behaviour; patched on the name where that
      consumer looks it up (the speculators generator module), so vLLM's own engine is untouched.
    * ``worker``: must run inside vLLM's worker processes; applied by the ``vllm.general_plugins``
      entry point in every process vLLM starts once the parent called :func:`vllm_compat.apply`.
    """

    GLOBAL = "global"
    CONSUMER = "consumer"
    WORKER = "worker"


class Phase(enum.IntEnum):
    """When an adapter is applied relative to the others (a named nesting order).

    Adapters are applied phase by phase; inside a phase, an adapter comes after those it
    ``requires``, then by id. Two adapters patching the same name nest in that order: the one
    applied later wraps the earlier one (it is outermost) and is reverted first.

    * ``IMPORT_FIX``: puts back a name or module something imports (a moved function, a removed
      transformers module). First, so that every later patch, and the consumer's own imports, find it.
    * ``ADAPT``: the default: call fixes (a keyword dropped or defaulted), behaviour fixes and the
      worker-side capture fixes. Wrappers in this phase each touch their own argument or aspect of
      the result; where several wrap one name they nest by id, and that order is declared, not
      assumed harmless: docs/adapters.md ("Shared patch targets") shows each such stack, a unit test
      pins it and a contract test checks the live chain after ``apply()`` against it.
    * ``TRANSPORT``: changes how a finished result travels (``capture_transport`` moves captured
      states through shared memory): outermost, after every fix has shaped the result.
    """

    IMPORT_FIX = 10
    ADAPT = 100
    TRANSPORT = 200


@dataclass(frozen=True)
class Expect:
    """How to read an adapter's probe: which observed values mean the old API, which the new.

    Attributes:
        check: the shape check to run (live for probes, live or static for the audit).
        old: observations meaning "old API present: nothing to do" (verdict ``native``).
        new: observations meaning "new API present: the adapter applies" (verdict ``adapted``).
    """

    check: Check
    old: frozenset[str]
    new: frozenset[str]

    def __post_init__(self):
        # adapters declare the observations as set literals: frozen, as the rest of the declaration is
        object.__setattr__(self, "old", frozenset(self.old))
        object.__setattr__(self, "new", frozenset(self.new))


@dataclass(frozen=True)
class Patch:
    """One replacement: ``factory(original)`` is installed at ``target`` (``"module:Qual.name"``).

    Attributes:
        target: where the replacement goes.
        factory: builds the replacement from the original object (usually a wrapt wrapper).
        optional: skip silently when the target attribute does not exist (e.g. a name only one
            consumer version imports).
        create: the attribute does not exist yet and ``factory(None)`` makes it (revert deletes it).
        alias_of: for a name that moved (``create=True``): where it lives now (``"module:name"``).
            The audit reads checks aimed at ``target`` there once the adapter is adapted.
    """

    target: str
    factory: Callable[[Any], Any]
    optional: bool = False
    create: bool = False
    alias_of: str = ""

    @property
    def module(self) -> str:
        return self.target.split(":", 1)[0]


@dataclass(frozen=True)
class Adapter:
    """One bridged drift (or one consumer defect), declared as data.

    Attributes:
        id: stable snake_case name: module name, report key and ``VLLM_COMPAT_DISABLE`` entry.
        summary: one line a user reads in reports.
        drift: old shape -> new shape, with the first changed release (docs/drift-atlas.md).
        scope: see :class:`Scope`.
        vllm: vLLM releases where the new shape is expected (two-sided where the drift atlas says so).
        patches: what gets replaced.
        verified_through: the newest vLLM release this adapter was verified on (the other side of
            ``vllm``, as instrumentation libraries declare the library versions they were tested
            with). On a newer vLLM, ``apply()`` and the audit say "not verified on X" for it, and
            strict mode refuses. docs/compatibility.md says what each release's verification ran.
        expect: the live probe and how to read it; None when the need is not a vLLM shape
            (a consumer's own defect, or a property of the host).
        speculators: consumer releases whose code needs this; None means any caller.
        host_probe: for host-dependent needs (no CUDA device): returns (needed, detail).
        host_note: for the audit, which cannot run the host probe: when the adapter acts.
        host_probe_static: the host probe only reads installed files (no import, no device): the
            audit of the installed vLLM runs it too, so both state the same need.
        deferred: patch when the first target's module is imported, instead of importing it now.
        phase: application order, see :class:`Phase`.
        requires: ids of adapters whose patches this one relies on. When one of them is disabled
            (or failed), this one is reported ``disabled`` too instead of breaking a worker later;
            it is applied after them.
        bridges_steps: the engine steps of vLLM's own engine core that the generator lacks and this
            adapter performs for it or makes unnecessary, each ``role.name`` as the audit names them
            (``executor.compile_or_warm_up_model``; docs/audit.md, "Behaviour drift: engine steps and
            config fields"). The audit shows such a step as bridged by this adapter where its
            verdict is ``adapted``.
    """

    id: str
    summary: str
    drift: str
    scope: Scope
    vllm: SpecifierSet
    patches: tuple[Patch, ...]
    verified_through: Version
    expect: Expect | None = None
    speculators: SpecifierSet | None = None
    host_probe: Callable[[], tuple[bool, str]] | None = None
    host_note: str = ""
    host_probe_static: bool = False
    deferred: bool = False
    phase: Phase = Phase.ADAPT
    requires: tuple[str, ...] = ()
    evidence: str = ""
    bridges_steps: tuple[str, ...] = ()

    def __post_init__(self):
        if isinstance(self.verified_through, str):  # declared as text, kept as a Version
            object.__setattr__(self, "verified_through", Version(self.verified_through))
        for step in self.bridges_steps:
            if not STEP_ID.fullmatch(step):
                raise ValueError(f"adapter {self.id}: bridges_steps entry {step!r} is not 'role.name'")

    def verified_on(self, vllm: Version) -> bool:
        """Whether ``vllm`` (a release, a nightly, a local build) is no newer than the newest
        verified release: a nightly of the verified release's successor is not verified. Past the
        end of a bounded ``vllm`` range the adapter has nothing to do, so nothing to verify."""
        base = Version(vllm.base_version)
        if base > self.verified_through and not self.vllm.contains(base, prereleases=True):
            return True
        return base <= self.verified_through and not (base == self.verified_through and vllm.is_devrelease)

    @property
    def open_ended(self) -> bool:
        """Whether the drift it bridges lasts into releases not yet made (no upper bound)."""
        return self.vllm.contains(Version("9999"), prereleases=True)

    @property
    def target(self) -> str:
        return self.patches[0].target
