"""The live reader: checks against the imported objects, as ``apply()``'s probes see them.

Attributes are looked up through the class's MRO with ``vars()`` (no binding), and wrapt proxies
(ours or anyone's) are looked through, so a patched target reads as the object it wraps.
"""
from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import textwrap
import typing
from functools import lru_cache
from pathlib import Path
from typing import Any

from .branches import returns_at_once, taken
from .shapes import (ABSENT, MISSING, OPTIONAL, PRESENT, REQUIRED, UNRESOLVED, Observation, address_of,
                     split_target)


def _proxy_types() -> tuple[type, ...]:
    import wrapt

    names = ("ObjectProxy", "BaseObjectProxy")  # wrapt 1.x / 2.x
    return tuple(getattr(wrapt, n) for n in names if hasattr(wrapt, n))


def _unwrap(obj: Any) -> Any:
    """Look through wrapt proxies (ours or anyone's) to the object they wrap."""
    proxies = _proxy_types()
    while issubclass(type(obj), proxies):
        obj = obj.__wrapped__
    return obj


def _where(obj: Any) -> str:
    try:
        path = inspect.getsourcefile(obj) or ""
        line = inspect.getsourcelines(obj)[1]
    except (OSError, TypeError):
        return ""
    parts = Path(path).parts
    for top in ("vllm", "speculators"):
        if top in parts:
            path = "/".join(parts[len(parts) - 1 - parts[::-1].index(top):])
            break
    return f"{path}:{line}"


def _definer(cls: type, name: str, annotated: bool = False) -> type | None:
    """The first class of ``cls``'s MRO whose own namespace defines ``name`` (read with ``vars()``,
    nothing bound), or, with ``annotated``, that only annotates it (a field without a default)."""
    for klass in cls.__mro__:
        if name in vars(klass) or (annotated and name in vars(klass).get("__annotations__", {})):
            return klass
    return None


class LiveSource:
    """Checks against the imported objects. Importing vLLM modules is slow (tens of seconds)."""

    mode = "live"

    def _resolve(self, target: str) -> tuple[Any, Any] | None:
        """(parent, object) for a target, or None if the module or an attribute is missing."""
        module_name, parts = split_target(target)
        try:
            obj: Any = importlib.import_module(module_name)
        except ImportError:
            return None
        parent = None
        for part in parts:
            parent = obj
            if isinstance(obj, type):
                klass = _definer(obj, part)
                if klass is None:
                    return None
                obj = vars(klass)[part]
            elif hasattr(obj, part):
                obj = getattr(obj, part)
            else:
                return None
        return parent, _unwrap(obj)

    def exists(self, target: str) -> Observation:
        found = self._resolve(target)
        return Observation(PRESENT, _where(found[1])) if found else Observation(MISSING)

    def param(self, target: str, name: str) -> Observation:
        found = self._resolve(target)
        if found is None:
            return Observation(MISSING)
        func = found[1]
        if isinstance(func, (staticmethod, classmethod)):
            func = func.__func__
        try:
            params = inspect.signature(func).parameters
        except (TypeError, ValueError):
            return Observation(MISSING, _where(func))
        if name not in params:
            return Observation(ABSENT, _where(func))
        required = params[name].default is inspect.Parameter.empty and params[name].kind not in (
            inspect.Parameter.VAR_POSITIONAL,
            inspect.Parameter.VAR_KEYWORD,
        )
        return Observation(REQUIRED if required else OPTIONAL, _where(func))

    def attr(self, target: str, name: str) -> Observation:
        found = self._resolve(target)
        if found is None:
            return Observation(MISSING)
        obj = found[1]
        if isinstance(obj, type):
            klass = _definer(obj, name, annotated=True)  # a field without a default, as read statically
            if klass is None:
                return Observation(ABSENT, _where(obj))
            if name in vars(klass):
                return Observation(PRESENT, _where(_unwrap(vars(klass)[name])) or _where(klass))
            return Observation(PRESENT, _where(klass))
        return Observation(PRESENT if hasattr(obj, name) else ABSENT, _where(obj))

    def field_default(self, target: str, name: str) -> Observation:
        found = self._resolve(target)
        if found is None:
            return Observation(MISSING)
        cls = found[1]
        fields = getattr(cls, "__dataclass_fields__", {})
        if name not in fields:
            return Observation(ABSENT, _where(cls))
        f = fields[name]
        default = f.default
        if default is dataclasses.MISSING and f.default_factory is not dataclasses.MISSING:
            return Observation("<factory>", _where(cls))
        # pydantic's Field(default=...) may sit in the dataclass default slot
        if type(default).__name__ == "FieldInfo":
            inner = getattr(default, "default", dataclasses.MISSING)
            default = dataclasses.MISSING if type(inner).__name__ == "PydanticUndefinedType" else inner
        if default is dataclasses.MISSING:
            return Observation(REQUIRED, _where(cls))
        return Observation(repr(default), _where(cls))

    # -- strings vLLM resolves ------------------------------------------------------------------
    def literal_member(self, target: str, value: str) -> Observation:
        found = self._resolve(target)
        if found is None:
            return Observation(MISSING)
        return Observation(PRESENT if value in _literal_values(found[1]) else ABSENT, _where(found[1]))

    def registered(self, target: str, key: str, via: str) -> Observation:
        """What the imported registry holds for ``key`` (the registering calls ran at import): a
        qualified name, or a loader vLLM calls to import the implementation, called here the same way."""
        found = self._resolve(target)
        if found is None:
            return Observation(MISSING)
        registry = found[1]
        if not isinstance(registry, dict) or key not in registry:
            return Observation(ABSENT, _where(found[0]))
        entry = registry[key]
        if isinstance(entry, str):
            return Observation(address_of(entry))
        try:
            loaded = entry()
        except (ImportError, AttributeError):
            return Observation(UNRESOLVED, _where(entry))
        return Observation(_address(loaded), _where(entry))

    def named(self, target: str) -> Observation:
        found = self._resolve(target)
        if found is None:
            return Observation(MISSING)
        value = found[1]
        return Observation(address_of(value)) if isinstance(value, str) and value else Observation(ABSENT)

    def _source(self, target: str) -> tuple[Any, ast.Module | None] | Observation:
        """``target``'s function (unwrapped) and its parsed source, or the observation that ends the
        probe: MISSING where it or its source cannot be found."""
        found = self._resolve(target)
        if found is None:
            return Observation(MISSING)
        func = inspect.unwrap(found[1])
        try:
            return func, ast.parse(textwrap.dedent(inspect.getsource(func)))
        except (OSError, TypeError):
            return Observation(MISSING, _where(func))

    def early_return(self, target: str, name: str) -> Observation:
        source = self._source(target)
        if isinstance(source, Observation):
            return source
        func, tree = source
        return Observation(PRESENT if returns_at_once(tree.body[0], name) else ABSENT, _where(func))

    def branch(self, target: str, value: str) -> Observation:
        source = self._source(target)
        if isinstance(source, Observation):
            return source
        func, tree = source
        hit = taken(tree, value)
        if hit is None or not hit.name:
            return Observation(ABSENT, _where(func))
        if hit.module:
            return Observation(f"{hit.module}:{hit.name}")
        built = getattr(func, "__globals__", {}).get(hit.name)
        if built is None or not hasattr(built, "__qualname__"):
            return Observation(UNRESOLVED, _where(func))
        return Observation(_address(_unwrap(built)))


def _literal_values(alias: Any) -> set[str]:
    """The strings of a ``Literal`` type, nested Literals flattened (as ``typing.get_args`` does)."""
    if typing.get_origin(alias) is not typing.Literal:
        return set()
    values: set[str] = set()
    for arg in typing.get_args(alias):
        if typing.get_origin(arg) is typing.Literal:
            values |= _literal_values(arg)
        elif isinstance(arg, str):
            values.add(arg)
    return values


def _address(obj: Any) -> str:
    return f"{obj.__module__}:{obj.__qualname__}"




@lru_cache(maxsize=None)
def live() -> LiveSource:
    return LiveSource()
