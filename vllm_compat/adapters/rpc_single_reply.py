"""``collective_rpc(unique_reply_rank=r)`` returns the reply itself, not a list (vLLM 0.11.1).

Drift: up to 0.11.0 ``MultiprocExecutor.collective_rpc`` always returned a list (one element with
``unique_reply_rank``); from 0.11.1 it returns the single reply (``multiproc_executor.py:296-297,
346``). speculators 0.3.0 indexes ``[0]`` into it and *silently* takes the first layer's tensor
as the whole list of layers. Probed through ``kv_output_aggregator``, the parameter that arrived
with the new reply shape in the same change.

What it does: on the executor the generator builds, a call *the generator makes* with
``unique_reply_rank`` gets its reply wrapped in a one-element list again, the shape speculators
0.3.0 was written for; the executor's own calls through the same method keep the new shape.

Scope: consumer, speculators 0.3.x only (0.4.0 expects the new shape). Disable:
``VLLM_COMPAT_DISABLE=rpc_single_reply``.
"""
from packaging.specifiers import SpecifierSet

from ..adapter import Adapter, Expect, Patch, Scope
from ..consumer import GENERATOR, SPECULATORS_03, generator_name
from ..probes.shapes import ABSENT, OPTIONAL, Param
from ..wrapping import caller_module, wrap_constructed


def _reply_as_list(run, executor, args, kwargs):
    reply = run(*args, **kwargs)
    # Only the generator's own calls: the executor's execute_model/sample_tokens use the new shape.
    if kwargs.get("unique_reply_rank") is not None and caller_module() == GENERATOR:
        return [reply]
    return reply


ADAPTER = Adapter(
    id="rpc_single_reply",
    summary="give speculators 0.3 the list-shaped collective_rpc(unique_reply_rank=) reply it indexes",
    drift="collective_rpc with unique_reply_rank returns the single reply from 0.11.1",
    scope=Scope.CONSUMER,
    vllm=SpecifierSet(">=0.11.1"),
    expect=Expect(Param("vllm.v1.executor.multiproc_executor:MultiprocExecutor.collective_rpc",
                        "kv_output_aggregator"), old={ABSENT}, new={OPTIONAL}),
    speculators=SpecifierSet(SPECULATORS_03),
    patches=(Patch(generator_name("MultiprocExecutor"), wrap_constructed("collective_rpc", _reply_as_list)),),
    verified_through="0.34.0",  # ran on the H200 under 0.34.0, generator states = HF (docs/compatibility.md)
    evidence="docs/drift-atlas.md, \"Single reply from `collective_rpc` (0.11.1)\": "
             "vllm/v1/executor/multiproc_executor.py:237-271 (0.11.0) vs :296-297,346 (0.11.1)",
)
