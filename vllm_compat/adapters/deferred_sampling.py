"""``execute_model`` defers sampling to ``sample_tokens`` (vLLM 0.11.1), for the generator's executor.

Drift: up to 0.11.0 ``execute_model`` sampled and returned the output. From 0.11.1 it returns
``None`` and keeps state, and ``sample_tokens(grammar_output)`` must be called before the next
``execute_model``, else the worker raises ``RuntimeError("State error: sample_tokens() must be
called after execute_model() returns None.")`` (``vllm/v1/worker/gpu_model_runner.py:2631``).
speculators 0.3.0 calls ``execute_model`` in a loop and never samples; 0.4.0 samples itself.

What it does: on the executor the generator builds (only that one), a pending sample is flushed
with ``sample_tokens(None)`` just before the next ``execute_model``. A consumer that samples by
itself leaves nothing pending, so nothing extra happens for it.

Scope: consumer (the ``MultiprocExecutor`` name inside the speculators generator module; vLLM's
engine keeps the new protocol). Disable: ``VLLM_COMPAT_DISABLE=deferred_sampling``.
"""
from packaging.specifiers import SpecifierSet

from ..adapter import Adapter, Expect, Patch, Scope
from ..consumer import SPECULATORS_03, generator_name
from ..probes.shapes import ABSENT, PRESENT, Attr
from ..wrapping import function_wrapper, wrap_instance_method


def flush_pending_samples(wrapped, instance, args, kwargs):
    executor = wrapped(*args, **kwargs)
    pending = [False]

    def execute_model(run, _executor, a, kw):
        if pending[0]:
            executor.sample_tokens(None)
        output = run(*a, **kw)
        pending[0] = output is None
        return output

    def sample_tokens(run, _executor, a, kw):
        pending[0] = False
        return run(*a, **kw)

    wrap_instance_method(executor, "execute_model", execute_model)
    wrap_instance_method(executor, "sample_tokens", sample_tokens)
    return executor


ADAPTER = Adapter(
    id="deferred_sampling",
    summary="call sample_tokens() between execute_model() calls the generator makes",
    drift="execute_model returns None and requires sample_tokens() from 0.11.1",
    scope=Scope.CONSUMER,
    vllm=SpecifierSet(">=0.11.1"),
    expect=Expect(Attr("vllm.v1.executor.multiproc_executor:MultiprocExecutor", "sample_tokens"),
                  old={ABSENT}, new={PRESENT}),
    speculators=SpecifierSet(SPECULATORS_03),  # 0.4 handles it itself
    patches=(Patch(generator_name("MultiprocExecutor"), function_wrapper(flush_pending_samples)),),
    verified_through="0.34.0",  # ran on the H200 under 0.34.0, generator states = HF (docs/compatibility.md)
    bridges_steps=("executor.sample_tokens",),  # speculators 0.3 never samples; 0.4 makes the step itself
    evidence="docs/drift-atlas.md, \"Deferred sampling (0.11.1)\": "
             "vllm/v1/executor/multiproc_executor.py:253-275 (0.11.1)",
)
