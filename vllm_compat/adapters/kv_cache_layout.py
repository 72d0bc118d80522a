"""The KV-cache layout must be resolved before KV-cache configs are built (vLLM 0.29.0).

Drift: from 0.29.0 ``get_kv_cache_config_from_groups`` reads
``cache_config.get_resolved_kv_cache_layout()``, which raises ``ValueError("KV cache layout has not
been resolved yet ...")`` unless someone resolved it (``vllm/config/cache.py:344-351``,
``vllm/v1/core/kv_cache_utils.py:1407,1435``). vLLM's engine core does, right after building its
executor: ``resolve_kv_cache_layout(config, executor.get_supported_kv_cache_layouts(), specs)``,
then ``executor.set_kv_cache_layout(name)`` (``vllm/v1/engine/core.py:289-294``). The speculators
generator builds its executor itself and never does.

What it does: right after the generator's executor is built, the same two calls, with vLLM's own
``resolve_kv_cache_layout`` (it records the layout on the config and tells the workers). From
0.33.0 ``set_kv_cache_layout`` also requires ``cp_kv_cache_interleave_size``
(``vllm/v1/executor/abstract.py:183``), which the engine core takes from
``parallel_config.cp_kv_cache_interleave_size`` (``core.py:292-296``): passed the same way wherever
the method's signature has the parameter.

Scope: consumer. Disable: ``VLLM_COMPAT_DISABLE=kv_cache_layout``.
"""
import inspect

from packaging.specifiers import SpecifierSet

from ..adapter import Adapter, Expect, Patch, Scope
from ..consumer import IN_PROCESS_SPECULATORS, generator_name
from ..probes.shapes import ABSENT, PRESENT, Attr
from ..wrapping import function_wrapper


def resolve_layout(wrapped, instance, args, kwargs):
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout

    executor = wrapped(*args, **kwargs)
    specs = [spec for per_worker in executor.get_kv_cache_specs() for spec in per_worker.values()]
    layout = resolve_kv_cache_layout(executor.vllm_config, executor.get_supported_kv_cache_layouts(), specs)
    if "cp_kv_cache_interleave_size" in inspect.signature(executor.set_kv_cache_layout).parameters:
        interleave = executor.vllm_config.parallel_config.cp_kv_cache_interleave_size
        executor.set_kv_cache_layout(layout.name, interleave)
    else:
        executor.set_kv_cache_layout(layout.name)
    return executor


ADAPTER = Adapter(
    id="kv_cache_layout",
    summary="resolve the KV-cache layout for the generator's executor, as vLLM's engine core does",
    drift="KV-cache configs need a resolved layout from 0.29.0 (ValueError otherwise)",
    scope=Scope.CONSUMER,
    vllm=SpecifierSet(">=0.29.0"),
    expect=Expect(Attr("vllm.v1.executor.multiproc_executor:MultiprocExecutor", "set_kv_cache_layout"),
                  old={ABSENT}, new={PRESENT}),
    speculators=SpecifierSet(IN_PROCESS_SPECULATORS),
    patches=(Patch(generator_name("MultiprocExecutor"), function_wrapper(resolve_layout)),),
    verified_through="0.34.0",  # ran on the H200 under 0.34.0, generator states = HF (docs/compatibility.md)
    bridges_steps=("executor.get_supported_kv_cache_layouts", "executor.set_kv_cache_layout"),
    evidence="docs/drift-atlas.md, \"The caller resolves the KV-cache layout (0.29.0)\": "
             "vllm/config/cache.py:344-351; vllm/v1/engine/core.py:289-294",
)
