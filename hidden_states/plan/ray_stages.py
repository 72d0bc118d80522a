"""``--pp-size N --ray-address ADDR``: one engine in this process whose stages vLLM's Ray executor
places over the cluster (``distributed_executor_backend="ray"``), a stage on another host sending its
rows to this process's region sink (``backends/shared/region_sink``). What the plan checks first.

vLLM's Ray executor refuses the CPU platform: its platform's Ray device key is empty on CPU, and the
executor's placement check raises then (vLLM 0.17 ``v1/executor/ray_utils.py``, the check before it
builds the placement group; 0.32 the same). So on a CPU host the combination is refused here, before
the load, in vLLM's words.
"""
from __future__ import annotations

from ..backends.stage_layers import join_ray
from ..errors import UsageError

RAY_ON_CPU = "current platform cpu does not support ray."  # vLLM's ValueError, v1/executor/ray_utils.py


def refuse_ray_stages(pp_size: int, data_parallel_size: int, device: str | None) -> None:
    """With ``--ray-address`` and ``pp_size`` > 1: refuse what cannot run, before the load."""
    if pp_size <= 1:
        return
    if data_parallel_size > 1:
        raise UsageError(f"--data-parallel-size {data_parallel_size}: not with --pp-size {pp_size} and --ray-address "
                         f"(the stages of one engine over the cluster); use --data-parallel-size 1")
    if device == "cpu":
        raise UsageError(f"--ray-address: not with --pp-size {pp_size} on vLLM's CPU backend: vLLM's Ray executor, "
                         f"which places the stages over the cluster, refuses it (\"{RAY_ON_CPU}\"); drop "
                         f"--ray-address to run the stages on this host")


def ray_cluster_gpus(address: str) -> float | None:
    """The GPUs of the Ray cluster at ``address`` (this process joins it: the engine's Ray executor
    uses the Ray this process initialized); None where it cannot be asked."""
    try:
        import ray

        join_ray(address, ray)
        return float(ray.cluster_resources().get("GPU", 0))
    except Exception:  # noqa: BLE001 - advisory: vLLM's executor says it at the load
        return None


def check_ray_gpus(tp_size: int, pp_size: int, gpus: float | None) -> str:
    """``tp_size * pp_size`` GPUs over the Ray cluster, else refused before the load; the plan's line."""
    needed = tp_size * pp_size
    if gpus is None:
        return (f"GPUs: {needed} needed over the Ray cluster (--tp-size {tp_size} x --pp-size {pp_size}); not "
                f"checked (the cluster could not be asked)")
    if needed > gpus:
        raise UsageError(f"--pp-size {pp_size}: --tp-size {tp_size} x --pp-size {pp_size} needs {needed} GPUs, the "
                         f"Ray cluster has {gpus:g}")
    return f"GPUs: {needed} of the Ray cluster's {gpus:g} (--tp-size {tp_size} x --pp-size {pp_size})"
