"""Adapters for the drifts that recur, built from data: a keyword vLLM dropped, a keyword that
became required, a name that moved to another module.

An adapter module of one of these kinds declares only what differs (where, which keyword, which
value, which releases) and calls the factory; the wrapper code and the probe live here, once::

    ADAPTER = drop_keyword(
        id="request_eos_token_id", target="vllm.v1.request:Request.__init__", keyword="eos_token_id",
        summary=..., drift=..., scope=Scope.GLOBAL, vllm=SpecifierSet(">=0.17.0"),
        verified_through="0.32.0", evidence=...)

Adapters whose logic is their own (deriving a value from the config, regrouping captured rows)
stay hand-written modules.
"""
from __future__ import annotations

import importlib
from typing import Any

from .adapter import Adapter, Expect, Patch, Phase
from .probes.shapes import ABSENT, OPTIONAL, REQUIRED, Moved, Param
from .wrapping import function_wrapper


def _dropping(keyword: str):
    def drop(wrapped, instance, args, kwargs):
        kwargs.pop(keyword, None)
        return wrapped(*args, **kwargs)

    drop.__name__ = f"drop_{keyword}"
    return drop


def _defaulting(keyword: str, value: Any):
    def default(wrapped, instance, args, kwargs):
        kwargs.setdefault(keyword, value)
        return wrapped(*args, **kwargs)

    default.__name__ = f"default_{keyword}"
    return default


def drop_keyword(*, id: str, target: str, keyword: str, also_at: tuple[str, ...] = (), **declaration) -> Adapter:
    """vLLM removed parameter ``keyword`` of the callable ``target``: accept it and drop it.

    Probe: the parameter is required or optional (old: native) or absent (new: adapted).

    Args:
        target: the callable, ``"module:Qual.name"``, patched where it is defined.
        also_at: more names holding the same callable by value (a consumer's ``from x import f``).
        declaration: the remaining :class:`Adapter` fields (summary, drift, scope, vllm, ...).
    """
    wrapper = function_wrapper(_dropping(keyword))
    return Adapter(
        id=id,
        expect=Expect(Param(target, keyword), old={REQUIRED, OPTIONAL}, new={ABSENT}),
        patches=tuple(Patch(where, wrapper) for where in (target, *also_at)),
        **declaration,
    )


def default_keyword(*, id: str, at: str, keyword: str, value: Any, expect: Expect, **declaration) -> Adapter:
    """Pass ``keyword=value`` to the callable at ``at`` when the caller omits it (an explicit value
    is kept). ``expect`` says how to tell the releases apart: the need is usually a changed default
    of a config field rather than a parameter, so the probe is the adapter's own."""
    return Adapter(id=id, expect=expect, patches=(Patch(at, function_wrapper(_defaulting(keyword, value))),),
                   **declaration)


def _moved(new_module: str, name: str):
    def alias(_absent):
        return getattr(importlib.import_module(new_module), name)

    return alias


def alias_moved_names(*, id: str, old_module: str, new_module: str, names: tuple[str, ...],
                      **declaration) -> Adapter:
    """``names`` moved from ``old_module`` to ``new_module`` unchanged, with no re-export: put each
    back into ``old_module`` as the very same object (``old.name is new.name``), so that code
    importing them from the old place works. Applied in :attr:`Phase.IMPORT_FIX`, before anything
    that imports or patches them; revert deletes the names again.

    Probe: the first name is defined in ``old_module`` (native) or only in ``new_module`` (adapted).
    """
    return Adapter(
        id=id,
        expect=Expect(Moved(f"{old_module}:{names[0]}", to=new_module), old={Moved.NOT_MOVED}, new={Moved.MOVED}),
        patches=tuple(Patch(f"{old_module}:{name}", _moved(new_module, name), create=True,
                            alias_of=f"{new_module}:{name}") for name in names),
        phase=Phase.IMPORT_FIX,
        **declaration,
    )
