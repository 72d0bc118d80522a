"""speculators 0.4.0 keeps finished prefills running: free their slots for waiting prompts.

Not a vLLM drift but the 0.4.0 generator's own defect: it aborts its requests only after the whole
call, and never feeds outputs back to the scheduler, so a request whose prompt is done keeps its
running slot. With more sequences in one call than ``max_num_seqs`` (32), the rest never get a
slot, the step loop sees nothing scheduled and ends, and ``generate()`` raises ``RuntimeError:
Request req_<n>_32 not found in captured states``.

What it does: on the scheduler the generator builds, when prompts are waiting for a slot, requests
whose prompt has been fully scheduled (so already computed: the generator executes every step it
schedules) are aborted just before the next ``schedule()``, which then admits the waiting ones. When
nothing waits, nothing changes, so no abort can ride on the last (unexecuted) scheduler output.

Scope: consumer (the ``Scheduler`` name inside the speculators generator module), speculators 0.4.x.
Disable: ``VLLM_COMPAT_DISABLE=prefill_slot_release``.
"""
from packaging.specifiers import SpecifierSet

from ..adapter import Adapter, Patch, Scope
from ..consumer import SPECULATORS_04, generator_name
from ..wrapping import wrap_constructed


def _schedule_after_release(run, scheduler, args, kwargs):
    if len(scheduler.waiting):
        from vllm.v1.request import RequestStatus

        done = [request_id for request_id, request in scheduler.requests.items()
                if not request.is_finished() and request.num_computed_tokens >= request.num_prompt_tokens]
        if done:
            scheduler.finish_requests(done, RequestStatus.FINISHED_ABORTED)
    return run(*args, **kwargs)


ADAPTER = Adapter(
    id="prefill_slot_release",
    summary="let speculators 0.4 extract more sequences per call than max_num_seqs",
    drift="speculators 0.4.0 holds finished prefills in their slots until the call ends",
    scope=Scope.CONSUMER,
    vllm=SpecifierSet(">=0.10.0"),
    speculators=SpecifierSet(SPECULATORS_04),
    patches=(Patch(generator_name("Scheduler"), wrap_constructed("schedule", _schedule_after_release)),),
    verified_through="0.32.0",
    evidence="speculators 0.4.0 generate(): finish_requests only after the loop; max_num_seqs=32",
)
