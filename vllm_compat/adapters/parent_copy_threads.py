"""Give the generator's process its torch threads back once its executor's workers are running.

Not a signature drift but a cost vLLM's executor puts on its caller's process. Building a
``MultiprocExecutor`` lowers torch's intra-op threads in the process that builds it, unless
``OMP_NUM_THREADS`` is set outside: ``set_multiprocessing_worker_envs()``, called by
``MultiprocExecutor._init_executor`` before the workers start, sets ``OMP_NUM_THREADS=1`` and
``torch.set_num_threads(1)`` to size the workers' pools (``vllm/v1/executor/multiproc_executor.py``,
0.11.0 to at least 0.26.0: "Reducing Torch parallelism from %d threads to 1"); from 0.32.0 it sets
``cpus // workers`` instead, and ``_init_executor`` then calls ``set_torch_threads_for_runtime()``
after ``WorkerProc.wait_for_ready`` to put this process on one thread ("this process only
schedules"). That suits vLLM's engine core, which only schedules. The speculators generator builds
the executor in its own process, which does more: it ``.clone()``s every captured state out of the
transport (GBs per call), and on one thread that copy runs several times slower than on the host's
cores (docs/reports/2026-12-01-generator-host-copy-and-overlap.md, "Measured on the H200 (2026-12-01)").

What it does: around the construction of the executor the generator builds, it records torch's
thread count and whether ``OMP_NUM_THREADS`` was set; when the constructor returns having lowered
the count and the user had not set ``OMP_NUM_THREADS``, it sets torch's count back to the recorded
one, at most ``PARENT_COPY_THREADS`` (8). Only torch's count in this process changes:
``os.environ`` is left as vLLM wrote it.

Why it is safe: the constructor returns after ``_init_executor`` has started the workers and waited
for them to be ready, so they have already read ``OMP_NUM_THREADS`` (spawned) or inherited torch's
count (forked); vLLM reads neither again in this process on the generator's path. (A child forked
from a process that has run a torch parallel region can hang in libgomp: this process's children
are spawned, ``worker_spawn`` sees to the workers.) The cap: the writer's threads and the workers
share the host's cores with the copy, and on a 16-core host 16 threads were slower than 8. What
the adapter gains, and the states unchanged: docs/reports/2026-12-01-generator-host-copy-and-overlap.md,
"The generator's process gets its threads back (`parent_copy_threads`)".

Scope: consumer (vLLM's own engine keeps its single thread), where vLLM's workers are not on the
CPU: vLLM's CPU workers use every core, which a multi-threaded parent would fight. Switch:
``VLLM_COMPAT_PARENT_THREADS=N`` caps the count at N instead of 8, ``0`` leaves vLLM's count.
Disable: ``VLLM_COMPAT_DISABLE=parent_copy_threads``.
"""
import logging
import os

from packaging.specifiers import SpecifierSet

from ..adapter import Adapter, Expect, Patch, Scope
from ..consumer import IN_PROCESS_SPECULATORS, generator_name
from ..host import vllm_device_type
from ..probes.shapes import MISSING, PRESENT, Exists
from ..wrapping import function_wrapper

logger = logging.getLogger("vllm_compat")

# the most threads the generator's process gets back (more were slower: see the module docstring)
PARENT_COPY_THREADS = 8
ENV_THREADS = "VLLM_COMPAT_PARENT_THREADS"
OMP = "OMP_NUM_THREADS"
LOWERS_THREADS = "vllm.v1.executor.multiproc_executor:set_multiprocessing_worker_envs"


def thread_cap() -> int:
    """The most threads to give back: ``VLLM_COMPAT_PARENT_THREADS``, else ``PARENT_COPY_THREADS``."""
    value = os.environ.get(ENV_THREADS, "").strip()
    if not value:
        return PARENT_COPY_THREADS
    try:
        cap = int(value)
    except ValueError:
        raise ValueError(f"{ENV_THREADS}={value!r}: expected a whole number of threads (0 disables)") from None
    if cap < 0:
        raise ValueError(f"{ENV_THREADS}={value!r}: expected 0 or more threads")
    return cap


def give_threads_back(wrapped, instance, args, kwargs):
    import torch

    cap = thread_cap()  # read first: a bad value fails before any worker starts
    user_set = OMP in os.environ
    before = torch.get_num_threads()
    executor = wrapped(*args, **kwargs)
    lowered = torch.get_num_threads()
    if user_set or cap == 0 or lowered >= before:
        return executor
    torch.set_num_threads(min(before, cap))
    logger.info("vllm-compat: the generator's process copies states on %d torch threads (vLLM left it %d; "
                "%s=0 keeps that)", torch.get_num_threads(), lowered, ENV_THREADS)
    return executor


def workers_off_cpu() -> tuple[bool, str]:
    device = vllm_device_type()
    if device == "cpu":
        return False, "vLLM's workers run on the CPU and use its cores: the generator's process keeps one thread"
    return True, f"vLLM's workers run on {device or 'no platform found'}, not the CPU: the generator's process copies the states"


ADAPTER = Adapter(
    id="parent_copy_threads",
    summary="give the generator's process its torch threads back (at most 8) once the executor's workers run",
    drift="MultiprocExecutor._init_executor lowers torch's threads in the process that builds it to 1 "
          "(set_multiprocessing_worker_envs; from 0.32.0 also set_torch_threads_for_runtime)",
    scope=Scope.CONSUMER,
    vllm=SpecifierSet(">=0.10.0"),
    expect=Expect(Exists(LOWERS_THREADS), old={MISSING}, new={PRESENT}),
    speculators=SpecifierSet(IN_PROCESS_SPECULATORS),
    host_probe=workers_off_cpu,
    host_note="where vLLM's workers are not on the CPU",
    patches=(Patch(generator_name("MultiprocExecutor"), function_wrapper(give_threads_back)),),
    verified_through="0.34.0",  # ran on the H200 under 0.34.0, generator states = HF (docs/compatibility.md)
    evidence="vllm/v1/executor/multiproc_executor.py: _init_executor -> set_multiprocessing_worker_envs "
             "(0.11.0, 0.12.0, 0.16.0, 0.17.0, 0.20.0, 0.26.0), + set_torch_threads_for_runtime after wait_for_ready "
             "(0.32.0: lines 136, 221; 0.33.0); docs/reports/2026-12-01-generator-host-copy-and-overlap.md 'Measured on the H200 (2026-12-01)'",
)
