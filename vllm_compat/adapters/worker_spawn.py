"""Spawn (never fork) the workers of the generator's executor.

Not a signature drift but a platform trap: vLLM's own engine switches its workers to ``spawn``
once CUDA is initialised in the parent; the speculators generator builds ``MultiprocExecutor``
directly, which forks by default, and its workers die with "Cannot re-initialize CUDA in forked
subprocess" (seen with vLLM 0.20.0 on an H200; the CPU platform always spawns, so CPU runs cannot
show it). Spawned workers also run vLLM's plugin entry point, which is how the worker adapters
reach them.

What it does: while the generator constructs its executor, ``VLLM_WORKER_MULTIPROC_METHOD`` is
``spawn`` unless the user set it. Scripts that build the generator need the usual
``if __name__ == "__main__":`` guard, as with vLLM's own engine.

Scope: consumer. Disable: ``VLLM_COMPAT_DISABLE=worker_spawn``.
"""
import os

from packaging.specifiers import SpecifierSet

from ..adapter import Adapter, Patch, Scope
from ..consumer import IN_PROCESS_SPECULATORS, generator_name
from ..wrapping import function_wrapper

METHOD = "VLLM_WORKER_MULTIPROC_METHOD"


def spawn_workers(wrapped, instance, args, kwargs):
    if METHOD in os.environ:
        return wrapped(*args, **kwargs)
    os.environ[METHOD] = "spawn"
    try:
        return wrapped(*args, **kwargs)
    finally:
        os.environ.pop(METHOD, None)


ADAPTER = Adapter(
    id="worker_spawn",
    summary="start the generator's executor workers with spawn, not fork",
    drift="the generator's MultiprocExecutor forks; CUDA in the parent kills forked workers",
    scope=Scope.CONSUMER,
    vllm=SpecifierSet(">=0.10.0"),
    speculators=SpecifierSet(IN_PROCESS_SPECULATORS),
    patches=(Patch(generator_name("MultiprocExecutor"), function_wrapper(spawn_workers)),),
    verified_through="0.34.0",  # ran on the H200 under 0.34.0, generator states = HF (docs/compatibility.md)
    evidence="docs/reports/2026-11-30-first-gpu-runs.md, \"The unmodified generator's first run on the GPU (2026-11-30)\": "
             "'Cannot re-initialize CUDA in forked subprocess' (vLLM 0.20.0, H200)",
)
