"""``VLLM_CPU_OMP_THREADS_BIND`` against the ranks of the run, before the load.

vLLM's CPU worker binds each rank's OpenMP threads to one core list of that variable ("0|1": rank 0
on core 0, rank 1 on core 1), the list at the rank's place among all ranks of the engine:
``--tp-size`` x ``--pp-size`` of them, a stage's tensor-parallel ranks together, stage 0 first. With
fewer lists than ranks vLLM 0.17's worker indexes past the end (``v1/worker/cpu_worker.py``,
``init_device``: ``omp_cpuids_list[self.rank]``, an IndexError in a worker's start-up, after the
engine has spawned its workers); 0.32 asserts as many lists as ranks
(``vllm/utils/ompmultiprocessing.py``). Fewer lists than ranks is refused here, on every release.
"""
from __future__ import annotations

import os

from ..errors import UsageError

THREADS_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
_NOT_LISTS = {"", "auto", "nobind"}  # vLLM's own choices, not core lists


def core_lists(value: str) -> list[str] | None:
    """The core lists ``value`` gives, one per rank; None for vLLM's ``auto`` or ``nobind``."""
    return None if value.strip() in _NOT_LISTS else value.split("|")


def check_thread_binding(tp_size: int, pp_size: int, value: str) -> None:
    """Refuse ``value`` when it names fewer core lists than the engine's ranks."""
    lists = core_lists(value)
    ranks = tp_size * pp_size
    if lists is None or len(lists) >= ranks:
        return
    example = "|".join(lists[rank % len(lists)] for rank in range(ranks))
    raise UsageError(f"{THREADS_BIND_ENV}={value!r}: {len(lists)} core list{'s' if len(lists) > 1 else ''} for "
                     f"{ranks} ranks (--tp-size {tp_size} x --pp-size {pp_size}); vLLM's CPU backend binds rank r "
                     f"to the r-th list (separated by '|'), so it needs {ranks}, e.g. {example!r} (ranks may share "
                     f"cores)")


def check_thread_binding_here(tp_size: int, pp_size: int) -> None:
    """:func:`check_thread_binding` with this environment's value, where vLLM runs on its CPU backend."""
    value = os.environ.get(THREADS_BIND_ENV, "")
    lists = core_lists(value)
    if lists is None or len(lists) >= tp_size * pp_size:
        return
    try:
        from vllm_compat.extractor_api import vllm_device_type

        device = vllm_device_type()
    except Exception:  # noqa: BLE001 - the platform unknown here: vLLM's worker says it at the load
        return
    if device == "cpu":
        check_thread_binding(tp_size, pp_size, value)
