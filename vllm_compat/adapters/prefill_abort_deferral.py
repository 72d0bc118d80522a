"""speculators 0.3.0 aborts requests after their first chunk: keep them until the prompt is done.

Not a vLLM drift but the 0.3.0 generator's own defect, exposed by chunked prefill (on by default
in vLLM's V1 scheduler whenever a step's token budget is smaller than the batch): the step loop
calls ``finish_requests([req_id], FINISHED_ABORTED)`` for every request scheduled in a step, so a
prompt split across steps loses its tail, and every later sequence's slice shifts, with no error
(docs/cpu-vllm.md, "Correctness traps").

What it does: on the scheduler the generator builds (only that one), an abort of a request whose
prompt is not yet fully scheduled is held back; the same call in a later step, after the last
chunk, goes through. Nothing else changes.

Scope: consumer (the ``Scheduler`` name inside the speculators generator module), speculators
0.3.x only. Disable: ``VLLM_COMPAT_DISABLE=prefill_abort_deferral``.
"""
from packaging.specifiers import SpecifierSet

from ..adapter import Adapter, Patch, Scope
from ..consumer import SPECULATORS_03, generator_name
from ..wrapping import wrap_constructed


def _prompt_pending(scheduler, request_id: str) -> bool:
    request = scheduler.requests.get(request_id)
    return request is not None and request.num_computed_tokens < request.num_prompt_tokens


def _finish_after_prefill(run, scheduler, args, kwargs):
    from vllm.v1.request import RequestStatus

    request_ids = kwargs.pop("request_ids") if "request_ids" in kwargs else args[0]
    finished_status = kwargs.pop("finished_status") if "finished_status" in kwargs else args[1]
    if finished_status != RequestStatus.FINISHED_ABORTED or request_ids is None:
        return run(request_ids, finished_status)
    ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
    return run([rid for rid in ids if not _prompt_pending(scheduler, rid)], finished_status)


ADAPTER = Adapter(
    id="prefill_abort_deferral",
    summary="hold back speculators 0.3's per-step aborts until each prompt is fully prefilled",
    drift="speculators 0.3.0 aborts chunked prompts after their first chunk (truncated states)",
    scope=Scope.CONSUMER,
    vllm=SpecifierSet(">=0.10.0"),
    speculators=SpecifierSet(SPECULATORS_03),
    patches=(Patch(generator_name("Scheduler"), wrap_constructed("finish_requests", _finish_after_prefill)),),
    verified_through="0.34.0",  # ran on the H200 under 0.34.0, generator states = HF (docs/compatibility.md)
    evidence="docs/drift-atlas.md, \"Defects of speculators 0.3.0\"; docs/cpu-vllm.md, \"Correctness traps\"",
)
