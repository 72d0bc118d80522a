"""``initialize_from_config`` no longer warms the model up (vLLM 0.27.0): do it for the generator.

Drift: up to 0.26 ``Executor.initialize_from_config`` ran ``compile_or_warm_up_model`` on every
worker (``vllm/v1/executor/abstract.py:112-118`` in 0.16.0); from 0.27.0 it does not, and vLLM's
engine core calls the new ``Executor.compile_or_warm_up_model()`` itself right after
(``vllm/v1/engine/core.py:330-332`` in 0.27.0). The speculators generator calls only
``initialize_from_config``, so its workers skip warm-up: no sampler buffers pre-allocated, no
compilation, no seed reset. Not fatal in eager mode, but not the engine vLLM tested either.

What it does: on the executor the generator builds, ``compile_or_warm_up_model()`` follows
``initialize_from_config`` as in vLLM's own engine.

Scope: consumer. Disable: ``VLLM_COMPAT_DISABLE=warm_up_after_init``.
"""
from packaging.specifiers import SpecifierSet

from ..adapter import Adapter, Expect, Patch, Scope
from ..consumer import IN_PROCESS_SPECULATORS, generator_name
from ..probes.shapes import ABSENT, PRESENT, Attr
from ..wrapping import wrap_constructed


def _then_warm_up(run, executor, args, kwargs):
    result = run(*args, **kwargs)
    executor.compile_or_warm_up_model()
    return result


ADAPTER = Adapter(
    id="warm_up_after_init",
    summary="warm the generator's workers up after initialize_from_config, as vLLM's engine does",
    drift="initialize_from_config stopped calling compile_or_warm_up_model in 0.27.0",
    scope=Scope.CONSUMER,
    vllm=SpecifierSet(">=0.27.0"),
    expect=Expect(Attr("vllm.v1.executor.multiproc_executor:MultiprocExecutor", "compile_or_warm_up_model"),
                  old={ABSENT}, new={PRESENT}),
    speculators=SpecifierSet(IN_PROCESS_SPECULATORS),
    patches=(Patch(generator_name("MultiprocExecutor"), wrap_constructed("initialize_from_config", _then_warm_up)),),
    verified_through="0.34.0",  # ran on the H200 under 0.34.0, generator states = HF (docs/compatibility.md)
    bridges_steps=("executor.compile_or_warm_up_model",),
    evidence="docs/drift-atlas.md, \"Warm-up leaves `initialize_from_config` (0.27.0)\": "
             "vllm/v1/executor/abstract.py:112-118 (0.16.0) vs :118-137, engine/core.py:330-332 (0.27.0)",
)
