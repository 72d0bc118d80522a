"""vLLM ``vllm.general_plugins`` entry point: applies the worker adapters in every vLLM process.

vLLM loads this group in every process it starts (the parent, engine cores, spawned workers),
possibly many times, and swallows load errors. So :func:`register` is cheap, idempotent, acts only
when the parent asked for it (:func:`vllm_compat.apply` sets ``VLLM_COMPAT_APPLY=1``, which spawned
processes inherit), and reports what it did itself. Installing vllm-compat changes nothing alone.
In the processes vLLM spawned it also ends them as forked ones end, without the interpreter's
teardown (:mod:`vllm_compat.process_exit`).
"""
from __future__ import annotations

import logging
import os

logger = logging.getLogger("vllm_compat")
ENV_LOG_LEVEL = "VLLM_COMPAT_LOG_LEVEL"  # the level of the report this logs in vLLM's processes (default INFO)


def register() -> None:
    from .registry import ENV_APPLY, is_active

    if os.environ.get(ENV_APPLY) != "1" or is_active():
        return
    if not logger.handlers and not logging.getLogger().handlers:
        # vLLM configures only its own "vllm" logger: without a handler our report would vanish.
        # Ours alone prints it: a root handler added later (xgrammar's import adds one) would print
        # every line a second time.
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s [vllm-compat] %(message)s"))
        logger.addHandler(handler)
        level = os.environ.get(ENV_LOG_LEVEL, "INFO").upper()
        logger.setLevel(level if level in ("DEBUG", "INFO", "WARNING", "ERROR") else "INFO")
        logger.propagate = False
    try:
        from .adapter import Scope
        from .registry import apply

        apply(scopes=(Scope.WORKER,), role="vllm process")
    except Exception:
        logger.exception("vllm-compat: applying worker adapters in pid %d failed", os.getpid())
        raise
    from .process_exit import end_without_teardown, started_by_vllm

    if started_by_vllm():
        end_without_teardown()
