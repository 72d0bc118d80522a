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
UNRESOLVED = "unresolved"  # vLLM names an implementation by a string, and nothing is there by that name


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
    # the strings vLLM resolves: an address (``module:Qual.name``) found, or ABSENT / MISSING / UNRESOLVED
    def literal_member(self, target: str, value: str) -> Observation: ...
    def registered(self, target: str, key: str, via: str) -> Observation: ...
    def named(self, target: str) -> Observation: ...
    def branch(self, target: str, value: str) -> Observation: ...
    # does the function return at once in an ``if`` whose test names ``name``: PRESENT / ABSENT / MISSING
    def early_return(self, target: str, name: str) -> Observation: ...


def is_address(value: str) -> bool:
    """Whether an observation is an address (``module:Qual``) rather than one of the values above."""
    return ":" in value and not value.startswith("<")


def address_of(qualname: str) -> str:
    """A dotted ``pkg.module.Name`` as vLLM's ``resolve_obj_by_qualname`` splits it: ``pkg.module:Name``."""
    if ":" in qualname:
        return qualname
    module, _, name = qualname.rpartition(".")
    return f"{module}:{name}"


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
class ReturnsEarly(Check):
    """Does the function ``target`` return at once in an ``if`` among its own statements (not a
    nested one) whose test names ``name`` (``if self.mode == CompilationMode.NONE: return``)?
    ``present``, ``absent`` or ``<missing>``: a behaviour a function gained without changing its
    signature."""

    name: str = ""

    def describe(self) -> str:
        return f"an early return on {self.name!r} in {self.target}"

    def observe(self, source: Source) -> Observation:
        return source.early_return(self.target, self.name)


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


# -- strings vLLM resolves --------------------------------------------------------------------------
# A speculative method or a KV connector is named by a string in a configuration dict; vLLM turns it
# into an implementation in its own code (a Literal it validates against, a registry, an if-chain).
# These checks follow the string there, so a module that moved behind an unchanged name is no break
# and a name vLLM no longer resolves is one. Each observes ``present`` (the string resolves to an
# object that exists; where: its definition), ``absent`` (vLLM's site does not name the string),
# ``unresolved`` (it names an implementation that is not there; where: the naming line) or
# ``<missing>`` (the site itself is not in this vLLM).


@dataclass(frozen=True)
class ByString(Check):
    """Base of the checks on a string ``name`` that vLLM resolves at ``target``."""

    name: str = ""


def _resolved(source: Source, named: Observation) -> Observation:
    """``named`` (an address, or why there is none) as ``present`` where the address exists."""
    if not is_address(named.value):
        return named
    there = source.exists(named.value)
    return Observation(PRESENT, there.where) if there.value != MISSING else Observation(UNRESOLVED, named.where)


@dataclass(frozen=True)
class LiteralMember(ByString):
    """Is ``name`` one of the strings of the ``Literal`` type ``target`` (nested Literals included)?
    ``present``, ``absent`` or ``<missing>``: how vLLM validates a configuration string."""

    def describe(self) -> str:
        return f"{self.name!r} among the values of {self.target}"

    def observe(self, source: Source) -> Observation:
        return source.literal_member(self.target, self.name)


@dataclass(frozen=True)
class Registered(ByString):
    """Does the string-keyed registry ``target`` (a dict) map ``name`` to an object that exists?

    The dict's own entries are read, and the module-level calls of ``via`` (its registering
    function, e.g. ``register_connector("Name", "pkg.module", "Class")``) in the module defining
    it. ``then``: a class attribute of the registered object that names the implementation in turn
    (a string, e.g. a config class's ``speculator_class``), followed the same way."""

    via: str = ""
    then: str = ""

    def describe(self) -> str:
        hop = f", then its {self.then}" if self.then else ""
        return f"{self.name!r} registered in {self.target}{hop}"

    def observe(self, source: Source) -> Observation:
        named = source.registered(self.target, self.name, self.via)
        if not self.then or not is_address(named.value):
            return _resolved(source, named)
        if source.exists(named.value).value == MISSING:
            return Observation(UNRESOLVED, named.where)
        inner = source.named(f"{named.value}.{self.then}")
        return _resolved(source, inner if inner.value != MISSING else Observation(ABSENT, named.where))


@dataclass(frozen=True)
class Branch(ByString):
    """Does the function ``target`` branch on the string ``name`` (``x == name``, ``x in (...)``)
    and build there (the first call of a plain name in the branch) an object that exists?"""

    def describe(self) -> str:
        return f"the branch for {self.name!r} in {self.target}"

    def observe(self, source: Source) -> Observation:
        return _resolved(source, source.branch(self.target, self.name))


@dataclass(frozen=True)
class Dispatched(ByString):
    """The string ``name``, the value of ``target``, resolved wherever vLLM dispatches it: every one
    of ``sites`` (:class:`Registered`, :class:`Branch`) that this vLLM has must resolve it; a site it
    lacks (``<missing>``) is skipped, and one at least must be there. A release that moved the
    dispatch (from the V1 model runner's if-chain to a registry) is read at the site it has."""

    sites: tuple[Check, ...] = ()

    def describe(self) -> str:
        return f"{self.name!r} as {self.target}, dispatched by {' / '.join(s.target for s in self.sites)}"

    def observe(self, source: Source) -> Observation:
        there = [seen for seen in (site.observe(source) for site in self.sites) if seen.value != MISSING]
        if not there:
            return Observation(MISSING)
        return next((seen for seen in there if seen.value != PRESENT), there[0])
