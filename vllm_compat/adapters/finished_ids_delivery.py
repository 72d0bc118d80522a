"""speculators 0.3.0 drops the last scheduler output of every call, and the workers never hear
which requests it aborted.

Not a vLLM drift but the 0.3.0 generator's own defect: its step loop aborts each request right after
the step that ran it, then calls ``schedule()`` once more, sees nothing to run, and stops. That last
output is never executed, and it carries ``finished_req_ids``: the aborted requests of the final
step. The scheduler has forgotten them; the workers keep their state. Model Runner V1 only grows its
request dict; Model Runner V2 holds one state slot per request and fails with ``No free indices``
once they run out (seen on an H200 with vLLM 0.20.0, ``VLLM_USE_V2_MODEL_RUNNER=1``).

What it does: on the scheduler the generator builds, the finished ids of an output with no tokens to
run are handed to the scheduler's next output, so the workers free them at their next step.

Scope: consumer (the ``Scheduler`` name inside the speculators generator module), speculators 0.3.x.
Disable: ``VLLM_COMPAT_DISABLE=finished_ids_delivery``.
"""
from packaging.specifiers import SpecifierSet

from ..adapter import Adapter, Patch, Scope
from ..consumer import SPECULATORS_03, generator_name
from ..wrapping import wrap_constructed

HELD = "_vllm_compat_undelivered"  # on the scheduler object: ids of an output the generator dropped


def _schedule_with_undelivered(run, scheduler, args, kwargs):
    held = scheduler.__dict__.pop(HELD, None)
    if held:
        scheduler.finished_req_ids.update(held)
    output = run(*args, **kwargs)
    if output.total_num_scheduled_tokens == 0 and output.finished_req_ids:
        scheduler.__dict__[HELD] = set(output.finished_req_ids)
    return output


ADAPTER = Adapter(
    id="finished_ids_delivery",
    summary="deliver the aborts of speculators 0.3's last step to the workers with the next step",
    drift="speculators 0.3.0 never executes the scheduler output that carries its final aborts",
    scope=Scope.CONSUMER,
    vllm=SpecifierSet(">=0.10.0"),
    speculators=SpecifierSet(SPECULATORS_03),
    patches=(Patch(generator_name("Scheduler"), wrap_constructed("schedule", _schedule_with_undelivered)),),
    verified_through="0.34.0",  # ran on the H200 under 0.34.0, generator states = HF (docs/compatibility.md)
    evidence="H200, vLLM 0.20.0, VLLM_USE_V2_MODEL_RUNNER=1: 'No free indices' (vllm/v1/worker/gpu/states.py:91)",
)
