"""Install and remove replacements, remembering exactly what was there.

For every patch we record ``(parent, attribute, original, was_own_attribute)``. Revert puts the
original object back (``is``-identical), or deletes the attribute when it was inherited or absent,
and only when the current value is still our replacement: if someone patched over us, we leave
their object alone and say so. Nothing is ever stored on vLLM's or speculators' modules.
"""
from __future__ import annotations

import importlib
import logging
import sys
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

ABSENT = object()  # resolve()'s value, and a record's original, for an attribute that did not exist


@dataclass
class Installed:
    parent: Any
    attribute: str
    original: Any  # ABSENT when the attribute did not exist at all
    own: bool
    replacement: Any
    target: str


class _Modules:
    """``sys.modules`` seen as an object with attributes, so that a module transformers removed can
    be given back to importers (target ``"sys.modules:some.module"``) and taken away on revert."""

    def __getattr__(self, name):
        try:
            return sys.modules[name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name, value):
        sys.modules[name] = value

    def __delattr__(self, name):
        del sys.modules[name]


def _vars(obj: Any) -> dict:
    return sys.modules if isinstance(obj, _Modules) else vars(obj)


def resolve(target: str) -> tuple[Any, str, Any, bool]:
    """(parent, attribute, current value or ABSENT, whether the parent owns it) for a target.

    Class attributes are read from ``vars()`` along the MRO, never through ``getattr``, so that
    functions stay unbound and descriptors (staticmethod, classmethod) are kept as they are.
    """
    module_name, _, qualname = target.partition(":")
    if module_name == "sys.modules":
        modules = _Modules()
        return modules, qualname, sys.modules.get(qualname, ABSENT), qualname in sys.modules
    parent: Any = importlib.import_module(module_name)
    parts = qualname.split(".")
    for part in parts[:-1]:
        parent = getattr(parent, part)
    name = parts[-1]
    if isinstance(parent, type):
        if name in vars(parent):
            return parent, name, vars(parent)[name], True
        for klass in parent.__mro__[1:]:
            if name in vars(klass):
                return parent, name, vars(klass)[name], False
        return parent, name, ABSENT, False
    if name in vars(parent):
        return parent, name, vars(parent)[name], True
    return parent, name, ABSENT, False


# Replacements currently installed, by id, with how many places hold them. A consumer that imports
# a patched function by value after we patched it holds our replacement: patching that name again
# must not wrap twice, and revert must give it the original back.
_ours: dict[int, list[Any]] = {}  # id -> [replacement, places holding it, owner]


def owner_of(obj: Any) -> str | None:
    """The adapter id that installed ``obj``, if it is one of our replacements."""
    entry = _ours.get(id(obj))
    return entry[2] if entry is not None and entry[0] is obj else None


def install(target: str, factory, *, owner: str, optional: bool = False, create: bool = False) -> Installed | None:
    """Replace ``target`` with ``factory(original)``; None when optional and absent.

    Args:
        target: ``"module:Qual.name"``.
        factory: original -> replacement.
        owner: the adapter id; a value this same adapter installed elsewhere is reused, not rewrapped.
        optional: tolerate a missing attribute.
        create: add the attribute (``factory(None)``) where it is missing.
    """
    parent, name, current, own = resolve(target)
    if current is ABSENT and create:
        replacement = factory(None)
        setattr(parent, name, replacement)
        _ours.setdefault(id(replacement), [replacement, 0, owner])[1] += 1
        return Installed(parent, name, ABSENT, False, replacement, target)
    if current is ABSENT and optional:
        return None
    if current is ABSENT:
        raise AttributeError(f"{target}: nothing to patch there")
    if owner_of(current) == owner:
        original, replacement = current.__wrapped__, current
        if not own:
            setattr(parent, name, replacement)
    else:
        original, replacement = current, factory(current)
        setattr(parent, name, replacement)
    _ours.setdefault(id(replacement), [replacement, 0, owner])[1] += 1
    return Installed(parent, name, original, own, replacement, target)


def uninstall(record: Installed) -> bool:
    """Put the original back. Returns False (and logs) if our replacement was replaced since."""
    entry = _ours.get(id(record.replacement))
    if entry is not None:
        entry[1] -= 1
        if entry[1] <= 0:
            del _ours[id(record.replacement)]
    current = _vars(record.parent).get(record.attribute, ABSENT)
    if current is not record.replacement:
        logger.warning("vllm-compat: %s was patched again by someone else; leaving it as it is", record.target)
        return False
    if record.own:
        setattr(record.parent, record.attribute, record.original)
    else:
        delattr(record.parent, record.attribute)
    return True


def stack(target: str) -> tuple[str, ...]:
    """The adapters whose replacements sit at ``target`` now, outermost first: the live chain,
    followed through ``__wrapped__`` for as long as its objects are ours (``registry.wrapper_stacks``
    declares the order they must come in)."""
    current = resolve(target)[2]
    owners: list[str] = []
    while current is not ABSENT and (owner := owner_of(current)) is not None:
        owners.append(owner)
        current = getattr(current, "__wrapped__", ABSENT)
    return tuple(owners)


def function_wrapper(wrapper):
    """A patch factory wrapping the original with ``wrapper(wrapped, instance, args, kwargs)``."""
    import wrapt

    def factory(original):
        return wrapt.FunctionWrapper(original, wrapper)

    return factory


def wrap_constructed(method: str, wrapper):
    """A patch factory for a class (or factory function) name: every object it constructs gets its
    ``method`` wrapped with ``wrapper(wrapped, instance, args, kwargs)``. Consumer-scoped patches
    use it so that only the objects the consumer builds change, never vLLM's own."""

    def construct(wrapped, instance, args, kwargs):
        built = wrapped(*args, **kwargs)
        wrap_instance_method(built, method, wrapper)
        return built

    return function_wrapper(construct)


_pass_through: set = set()  # code objects of wrappers that call on behalf of their caller


def pass_through(function) -> None:
    """Declare that ``function`` only wraps calls (a wrapper of its own on an executor the consumer
    built): :func:`caller_module` looks past its frames, as past vllm_compat's and wrapt's, so
    consumer-scoped adapters still see the consumer as the caller. Declared when the wrapper is
    installed, never at import."""
    _pass_through.add(getattr(function, "__func__", function).__code__)


def caller_module(skip: int = 1) -> str:
    """``__name__`` of the module whose code called the current wrapper (wrapt's own frames,
    vllm_compat's and those of :func:`pass_through` functions are skipped). Lets a
    consumer-scoped wrapper tell the consumer's calls from the calls vLLM's own methods make through
    the same object."""
    frame = sys._getframe(skip + 1)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if not (name.startswith("wrapt") or name.startswith("vllm_compat") or frame.f_code in _pass_through):
            return name
        frame = frame.f_back
    return ""


def wrap_instance_method(instance: Any, name: str, wrapper) -> None:
    """Wrap one bound method on one object (consumer-scoped patches of objects the consumer made)."""
    import wrapt

    wrapt.wrap_function_wrapper(instance, name, wrapper)
