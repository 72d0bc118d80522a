"""What the bundled extractor (``hidden_states/``) may use of the shim: its one door.

The extractor imports ``vllm_compat`` through this module alone (``tests/unit/test_extractor_door.py``
fails on any other import). Each name here is one of the shim's own, re-exported unchanged, except
:func:`wrap_method`, which is how the extractor wraps a method of an object it made:

* starting vLLM: :func:`apply` (the adapters, before speculators or vLLM is loaded) and the
  :class:`~vllm_compat.report.Report` it returns;
* checking vLLM: :func:`audit`, :func:`audit_backend`, :class:`AuditError`, ``BAD`` (the verdicts
  that are problems), and what a backend declares for the audit (entry points of the group
  ``vllm_compat.touchpoints``, pyproject.toml): ``BackendTouchpoints`` (the shim's ``Touchpoints``) with the
  checks of ``probes.shapes`` it is written in (``Attr``, ``Param``, ``Exists``, ``FieldDefault``, ``LiteralMember``,
  ``Dispatched``, ``Registered``, ``Branch``; ``PRESENT``, ``REQUIRED``, ``OPTIONAL``);
* the installed packages: :func:`environment_conflicts` (a transformers or torch the installed vLLM
  cannot run with, each with its ``line()``) and :func:`install_command` (a ``pip install`` that keeps
  them where they are);
* host facts, asked without touching CUDA: :func:`vllm_device_type`, :func:`device_total_memory`,
  :func:`device_name`, :func:`host_memory`; installed releases, found without importing them: :func:`vllm_version`,
  :func:`base`, :func:`package_dir`, :func:`speculators_version`, and the speculators releases with an
  in-process generator (``IN_PROCESS_SPECULATORS``: ``vllm-engine`` runs their capture where one is
  installed); what each trainer line reads (``TRAINER_LAYOUTS``);
* inside vLLM's workers: :func:`pin_host_memory` (page-lock a shared segment, as the shim's
  transport does) and :func:`scheduled_in_row_order` (a forward's requests in row order, under
  Model Runner V1 or V2; needs the ``v2_batch_order`` adapter, which a backend using it lists in
  its ``requires``).

The package's version, which ``hidden-states --version`` prints: ``__version__`` (vllm_compat's own).

Importing this module imports neither vLLM nor torch; :func:`apply` and the audit load lazily.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import __version__, wrapping
from .batch_order import scheduled_in_row_order
from .consumer import IN_PROCESS_SPECULATORS, TRAINER_LAYOUTS, BackendTouchpoints
from .environment import install_command
from .environment import installed_conflicts as environment_conflicts
from .host import device_name, device_total_memory, host_memory, vllm_device_type
from .probes.shapes import (OPTIONAL, PRESENT, REQUIRED, Attr, Branch, Dispatched, Exists, FieldDefault, LiteralMember,
                            Param, Registered)
from .transport import pin_host_memory
from .versions import base, package_dir, speculators_version, vllm_version

if TYPE_CHECKING:
    from .report import Report

__all__ = [
    "apply", "audit", "audit_backend", "AuditError", "BAD", "BackendTouchpoints",
    "Attr", "Param", "Exists", "FieldDefault", "LiteralMember", "Dispatched", "Registered", "Branch", "PRESENT", "REQUIRED", "OPTIONAL",
    "vllm_device_type", "device_total_memory", "device_name", "host_memory", "vllm_version", "base", "package_dir",
    "speculators_version", "IN_PROCESS_SPECULATORS", "TRAINER_LAYOUTS", "pin_host_memory", "scheduled_in_row_order", "wrap_method",
    "environment_conflicts", "install_command", "__version__",
]


def apply() -> Report:
    """``vllm_compat.apply()`` with the environment's settings (``VLLM_COMPAT_DISABLE``, ...)."""
    from .registry import apply as apply_adapters

    return apply_adapters()


def wrap_method(instance: Any, name: str, wrapper, *, transparent: bool = False) -> None:
    """Wrap ``instance.name`` (one object the extractor made or was handed in a worker) with
    ``wrapper(wrapped, instance, args, kwargs)``. ``transparent``: the wrapper only passes calls on,
    so the shim's consumer-scoped adapters look past it to the code that called (a wrapper on the
    generator's executor must not hide the generator from ``rpc_single_reply``)."""
    if transparent:
        wrapping.pass_through(wrapper)
    wrapping.wrap_instance_method(instance, name, wrapper)


def __getattr__(name: str) -> Any:
    # Lazy: the audit reads vLLM's files with ast and loads the adapters.
    if name in ("audit", "audit_backend", "AuditError", "BAD"):
        from .audit import BAD, AuditError, audit, audit_backend

        return {"audit": audit, "audit_backend": audit_backend, "AuditError": AuditError, "BAD": BAD}[name]
    raise AttributeError(f"module 'vllm_compat.extractor_api' has no attribute {name!r}")
