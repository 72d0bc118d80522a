"""A source seen as it is once bridging adapters have put moved names back (``Patch.alias_of``)."""
from __future__ import annotations

from .shapes import MISSING, Observation, Source, split_target


class AliasedSource:
    """Another source, seen as it is once a bridging adapter has put moved names back.

    ``aliases`` maps an old address to where the name lives now (``Patch.alias_of``). A check on a
    name that is missing at its old address, or on a member of it, reads the new address instead;
    names still present where they were are read there.
    """

    def __init__(self, inner: Source, aliases: dict[str, str]):
        self.inner, self.aliases, self.mode = inner, aliases, inner.mode

    def redirect(self, target: str) -> str:
        """``target``, or where it lives now when it is read through a moved name."""
        module, parts = split_target(target)
        head = f"{module}:{parts[0]}" if parts else target
        if head not in self.aliases or self.inner.exists(head).value != MISSING:
            return target
        return self.aliases[head] + "".join(f".{part}" for part in parts[1:])

    def exists(self, target: str) -> Observation:
        return self.inner.exists(self.redirect(target))

    def param(self, target: str, name: str) -> Observation:
        return self.inner.param(self.redirect(target), name)

    def attr(self, target: str, name: str) -> Observation:
        return self.inner.attr(self.redirect(target), name)

    def field_default(self, target: str, name: str) -> Observation:
        return self.inner.field_default(self.redirect(target), name)

    def literal_member(self, target: str, value: str) -> Observation:
        return self.inner.literal_member(self.redirect(target), value)

    def registered(self, target: str, key: str, via: str) -> Observation:
        return self.inner.registered(self.redirect(target), key, via)

    def named(self, target: str) -> Observation:
        return self.inner.named(self.redirect(target))

    def early_return(self, target: str, name: str) -> Observation:
        return self.inner.early_return(self.redirect(target), name)

    def branch(self, target: str, value: str) -> Observation:
        return self.inner.branch(self.redirect(target), value)
