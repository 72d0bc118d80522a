"""Declarative shape checks: what an adapter expects to find in vLLM, evaluated two ways.

A check names a target (``"vllm.v1.request:Request.__init__"``) and one fact about it (a
parameter, an attribute, a field default). It is evaluated against a *source*:

* :class:`~vllm_compat.probes.live.LiveSource` imports the module and inspects the live object;
* :class:`~vllm_compat.probes.static.StaticSource` parses the files of an installed package, a wheel or
  a source tree with :mod:`ast`, without importing anything.

Both return the same :class:`Observation` strings for the same release, so the probe an adapter
runs before patching and the audit a user runs before upgrading give the same verdict.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

# Observation values shared by every check.
MISSING = "<missing>"  # the target itself could not be found
REQUIRED = "required"
OPTIONAL = "optional"
ABSENT = "absent"
PRESENT = "present"


class Observation(NamedTuple):
    """What a check found: a short value and where (``vllm/v1/request.py:60``, or '')."""

    value: str
    where: str = ""


class Source(Protocol):
    """Where a check looks: :class:`~vllm_compat.probes.live.LiveSource` or
    :class:`~vllm_compat.probes.static.StaticSource` (or either seen through
    :class:`~vllm_compat.probes.aliased.AliasedSource`)."""

    mode: str

    def exists(self, target: str) -> Observation: ...
    def param(self, target: str, name: str) -> Observation: ...
    def attr(self, target: str, name: str) -> Observation: ...
    def field_default(self, target: str, name: str) -> Observation: ...


def split_target(target: str) -> tuple[str, list[str]]:
    """``"pkg.module:Class.attr"`` as ``("pkg.module", ["Class", "attr"])``."""
    module, _, qualname = target.partition(":")
    return module, [part for part in qualname.split(".") if part]


@dataclass(frozen=True)
class Check:
    """Base of the shape checks. ``target`` is ``"module.path:Qual.name"``."""

    target: str

    @property
    def module(self) -> str:
        return self.target.split(":", 1)[0]

    @property
    def qualname(self) -> str:
        return self.target.split(":", 1)[1]

    def describe(self) -> str:  # pragma: no cover - every subclass overrides
        raise NotImplementedError

    def observe(self, source: Source) -> Observation:  # pragma: no cover
        raise NotImplementedError


@dataclass(frozen=True)
class Param(Check):
    """Is ``name`` a parameter of the callable ``target``: required, optional or absent?"""

    name: str = ""

    def describe(self) -> str:
        return f"parameter {self.name!r} of {self.target}"

    def observe(self, source: Source) -> Observation:
        return source.param(self.target, self.name)


@dataclass(frozen=True)
class Attr(Check):
    """Does the class or module ``target`` have attribute ``name`` (own or inherited)?"""

    name: str = ""

    def describe(self) -> str:
        return f"attribute {self.name!r} of {self.target}"

    def observe(self, source: Source) -> Observation:
        return source.attr(self.target, self.name)


@dataclass(frozen=True)
class WhichAttr(Check):
    """Which of two attribute names the class ``target`` has: one of them, ``both`` or ``neither``."""

    old_name: str = ""
    new_name: str = ""

    def describe(self) -> str:
        return f"{self.old_name!r} / {self.new_name!r} on {self.target}"

    def observe(self, source: Source) -> Observation:
        old = source.attr(self.target, self.old_name)
        new = source.attr(self.target, self.new_name)
        if old.value == MISSING:
            return old
        has_old, has_new = old.value == PRESENT, new.value == PRESENT
        value = "both" if has_old and has_new else self.old_name if has_old else self.new_name if has_new else "neither"
        return Observation(value, (new if has_new else old).where)


@dataclass(frozen=True)
class FieldDefault(Check):
    """The default of dataclass field ``name`` on ``target``: a literal's repr, ``required`` or ``absent``."""

    name: str = ""

    def describe(self) -> str:
        return f"default of {self.target}.{self.name}"

    def observe(self, source: Source) -> Observation:
        return source.field_default(self.target, self.name)


@dataclass(frozen=True)
class Exists(Check):
    """Is the symbol ``target`` there at all? (``present`` or ``<missing>``)."""

    def describe(self) -> str:
        return f"{self.target}"

    def observe(self, source: Source) -> Observation:
        return source.exists(self.target)


@dataclass(frozen=True)
class Moved(Check):
    """Has the symbol ``target`` moved to module ``to``? ``not moved`` (still defined or re-exported
    where ``target`` says), ``moved`` (only in ``to``) or ``<missing>`` (in neither)."""

    NOT_MOVED = "not moved"
    MOVED = "moved"

    to: str = ""

    def describe(self) -> str:
        return f"{self.target} (or moved to {self.to})"

    def observe(self, source: Source) -> Observation:
        here = source.exists(self.target)
        if here.value != MISSING:
            return Observation(self.NOT_MOVED, here.where)
        there = source.exists(f"{self.to}:{self.qualname}")
        return Observation(self.MOVED, there.where) if there.value != MISSING else here
