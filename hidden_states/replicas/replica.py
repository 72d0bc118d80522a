"""One model replica, in a Ray actor, and what the driver keeps of each replica and batch.

A replica executes the driver's plan with the plan's runner (``RunPlan.runner``: extract's or
generate's ``executing``, which gives the replica's *work*: ``prepared``, ``model`` and ``start()``,
``replica_batch(batch, skip)``): it checks the memory on its own devices, loads the same backend
with the same forward check, and writes through its own background writer into the shared
directory (its ledger ``done.replica-K.jsonl``). Hidden states never travel through Ray; each call
returns the samples its writer has put on disk since the last one.
"""
from __future__ import annotations

import os
import time
import traceback
from dataclasses import dataclass, field

from .. import processes
from ..errors import UsageError
from ..plan.planner import check_memory_here
from ..progress import log_to_stderr
from ..plan.run_plan import RunPlan


def import_ray():
    try:
        import ray
    except ImportError:
        raise UsageError("--data-parallel-size needs Ray: pip install 'vllm-compat[ray]'") from None
    return ray


class Replica:
    """One model replica, in a Ray actor: executes the driver's plan (its own ledger tag, the plan's
    ``for_replica``): loads the backend, runs the batches it is given, writes their files through
    its own writer (``done.<tag>.jsonl``)."""

    def __init__(self, plan: RunPlan, replica_id: int, env: dict[str, str]):
        self.driver_env = env  # the driver's variables this replica got (replicas.driver.FORWARDED_ENV)
        self.replica_id = replica_id
        self.work = plan.runner.executing(plan, log=self._log)
        self._reported: set[int] = set()

    def _log(self, message: str) -> None:
        log_to_stderr(f"replica {self.replica_id}: {message}")

    def load(self) -> dict:
        """Check the memory on this actor's devices, load the backend here, open the writer."""
        import socket

        if "OMP_NUM_THREADS" not in self.driver_env:
            # Ray sets OMP_NUM_THREADS to the actor's CPUs (1) where the driver has none: torch in this
            # process (the generator's copy of the states) and vLLM's workers would then run on one
            # thread, where a single run uses every core
            os.environ.pop("OMP_NUM_THREADS", None)

        prepared = self.work.prepared
        prepared.memory_check = check_memory_here(prepared.run_plan.settings, prepared.facts)  # the load reads its CPU KV cache
        for line in prepared.memory_check.lines:
            self._log(line)
        started = time.monotonic()
        with processes.contained():  # vLLM's workers die with this actor (a kill reaches them too)
            self.work.start()
        return {"pid": os.getpid(), "host": socket.gethostname(), "load_seconds": time.monotonic() - started,
                "devices": os.environ.get("CUDA_VISIBLE_DEVICES")}

    def extract(self, batch: list, skip: frozenset[int]) -> dict:
        """One batch (the work's ``replica_batch``: samples, or conversations); returns what it says
        of the batch for the driver's summary and what the writer has finished since the last call."""
        return {**self.work.replica_batch(batch, skip), "written": self._written()}

    def finish(self) -> dict:
        """Drain the writer (raises its first error), shut vLLM down; the last files written."""
        model = self.work.model
        try:
            model.writer.close()
        finally:
            started = time.monotonic()
            model.backend.close()
        stats = model.writer.stats
        return {"written": self._written(), "bytes": stats.bytes, "stall_seconds": stats.stall_seconds,
                "shutdown_seconds": time.monotonic() - started,
                "closing_line": model.backend.closing_line}

    def _written(self) -> dict[int, int]:
        lengths = self.work.model.writer.lengths_written()
        new = {index: length for index, length in lengths.items() if index not in self._reported}
        self._reported.update(new)
        return new


@dataclass
class ReplicaBatch:
    """One batch handed out to a replica: ``items`` go to it as they are (samples; ``generate``:
    conversations), writing the sample files ``indices``."""

    items: list
    indices: list[int]
    described: str  # the batch in messages: each item's sample index or indices and input line
    number: int = 0  # in hand-out order (a retry keeps it)
    skip: frozenset[int] = frozenset()
    errors: list[str] = field(default_factory=list)  # one full traceback per failed attempt
    result: dict | None = None  # what its call returned (``generate``: held until its files are confirmed)
    outstanding: set[int] = field(default_factory=set)  # its files not confirmed on disk yet

    def where(self) -> str:
        return self.described


@dataclass
class Handle:
    replica_id: int
    actor: object
    info: dict
    unconfirmed: dict[int, ReplicaBatch] = field(default_factory=dict)  # sample index -> its batch, until on disk
    in_flight: int = 0


def remote_traceback(exc: BaseException) -> str:
    """The whole story of a replica's error: Ray's text carries the remote traceback."""
    text = str(exc).strip()
    if not text:
        text = "".join(traceback.format_exception(exc)).strip()
    return text or f"{type(exc).__name__} (no message)"
