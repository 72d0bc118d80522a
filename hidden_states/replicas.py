"""Data parallelism on Ray: ``--data-parallel-size N`` replicas of the model, each a Ray actor, fed
batches by this process (the driver); ``extract``'s batches of samples and ``generate``'s batches of
conversations alike (the run's class says what a batch is: :attr:`Extraction.replica_class`).

The driver runs the extraction's plan and prepare as a single run does (one output directory, one
config, one finished set, one batch source: a single run's batches, or a static shard's), then hands
its batches out: each replica holds at most two calls in flight (one running, one queued behind it),
so a slow replica gets fewer. A replica is the same :class:`~hidden_states.extraction.Extraction`,
loaded in the actor: the same backend and forward check, and ``extract_batch`` writing through its
own :class:`~hidden_states.output.writer.BackgroundWriter` into the shared directory (tag ``replica-K``: its
ledger is ``done.replica-K.jsonl``). Hidden states never travel through Ray; each call returns the
samples its writer has put on disk since the last one. What differs between the two commands is
five methods of the driver: :meth:`RayExtraction._batch_of` (a batch's sample indices),
:meth:`~RayExtraction._account` (a returned call in the summary), :meth:`~RayExtraction._unreturned`
and :meth:`~RayExtraction._again` (which batches of a retired replica are lost, what of them runs
again) and :meth:`~RayExtraction._progressed` (after files were confirmed);
``generation.RayGeneration`` overrides them.

Faults. A replica whose actor dies (killed, its vLLM worker crashed, its node lost) or whose call
raises is retired; every sample handed to it and not confirmed on disk goes back to the queue as the
batch it came in (the same batch again: the same states), with the samples whose files are whole
already skipped, so no finished file is lost or written twice. A batch that fails twice is given up
and reported with every replica's full traceback. Ctrl-C: the first stops handing out batches and
waits for the calls in flight; a second kills every replica (their vLLM workers die with them,
``processes.contained``).
"""
from __future__ import annotations

import collections
import dataclasses
import os
import sys
import time
import traceback
from dataclasses import dataclass, field

from . import processes
from .errors import UsageError
from .extraction import Extraction, ExtractionFailed
from .plan.planner import check_memory_here
from .plan.run_plan import RunPlan
from .inputs.streams import Sample
from .progress import log_to_stderr

IN_FLIGHT = 2  # calls queued per replica: the next batch is there when one ends
OBJECT_STORE = 256 * 2**20  # bytes, for a local Ray
ATTEMPTS = 2  # replicas a batch may fail on before it is given up
RETIRE_SECONDS = 120  # for a replica whose call raised to finish its files and shut vLLM down
# the driver's environment the replicas get (a remote node has its own otherwise)
FORWARDED_ENV = ("VLLM_", "HF_", "TRANSFORMERS_", "VLLM_COMPAT_", "OMP_NUM_THREADS")


def import_ray():
    try:
        import ray
    except ImportError:
        raise UsageError("--data-parallel-size needs Ray: pip install 'vllm-compat[ray]'") from None
    return ray


class Replica:
    """One model replica, in a Ray actor: executes the driver's plan (its own ledger tag, the plan's
    ``for_replica``): loads the backend, extracts the batches it is given, writes their files through
    its own sink (``done.<tag>.jsonl``)."""

    def __init__(self, plan: RunPlan, replica_id: int, env: dict[str, str]):
        self.driver_env = env  # the driver's variables this replica got (FORWARDED_ENV)
        self.replica_id = replica_id
        self.extraction = (plan.runner or Extraction).executing(plan, log=self._log)
        self._reported: set[int] = set()

    def _log(self, message: str) -> None:
        log_to_stderr(f"replica {self.replica_id}: {message}")

    def load(self) -> dict:
        """Check the memory on this actor's devices, load the backend here, open the sink."""
        import socket

        if "OMP_NUM_THREADS" not in self.driver_env:
            # Ray sets OMP_NUM_THREADS to the actor's CPUs (1) where the driver has none: torch in this
            # process (the generator's copy of the states) and vLLM's workers would then run on one
            # thread, where a single run uses every core
            os.environ.pop("OMP_NUM_THREADS", None)

        ext = self.extraction
        ext.memory_check = check_memory_here(ext.settings, ext.facts)  # the load reads its CPU KV cache
        for line in ext.memory_check.lines:
            self._log(line)
        started = time.monotonic()
        with processes.contained():  # vLLM's workers die with this actor (a kill reaches them too)
            ext.load()
        ext.open_sink()
        return {"pid": os.getpid(), "host": socket.gethostname(), "load_seconds": time.monotonic() - started,
                "devices": os.environ.get("CUDA_VISIBLE_DEVICES")}

    def extract(self, batch: list, skip: frozenset[int]) -> dict:
        """One batch (``replica_batch`` of the plan's runner: samples, or conversations); returns what
        it says of the batch for the driver's summary and what the writer has finished since the
        last call."""
        return {**self.extraction.replica_batch(batch, skip), "written": self._written()}

    def finish(self) -> dict:
        """Drain the writer (raises its first error), shut vLLM down; the last files written."""
        ext = self.extraction
        try:
            ext.writer.close()
        finally:
            started = time.monotonic()
            ext.backend.close()
        stats = ext.writer.stats
        return {"written": self._written(), "bytes": stats.bytes, "stall_seconds": stats.stall_seconds,
                "shutdown_seconds": time.monotonic() - started,
                "closing_line": ext.backend.closing_line}

    def _written(self) -> dict[int, int]:
        lengths = self.extraction.writer.lengths_written()
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


class RayExtraction(Extraction):
    """An :class:`Extraction` whose batches run on ``settings.data_parallel_size`` Ray replicas."""

    # the replicas load the model, each on its own node's GPUs: each checks its memory as it loads
    # (Replica.load, planner.check_memory_here)
    loads_model_here = False

    def __init__(self, settings, **kwargs):
        super().__init__(settings, **kwargs)
        self.ray = import_ray()
        self.replicas: dict[int, Handle] = {}
        self.calls: dict = {}  # ObjectRef -> (replica id, ReplicaBatch)
        self.retry: collections.deque[ReplicaBatch] = collections.deque()
        self.failed: list[ReplicaBatch] = []
        self.shutdown_seconds = 0.0  # the slowest replica's vLLM shutdown, after its last file
        self.handed_out = 0  # batches, for their numbers

    # -- load: start Ray and the replicas
    def load(self) -> None:
        ray, settings = self.ray, self.settings
        env = {name: value for name, value in os.environ.items() if name.startswith(FORWARDED_ENV)}
        started = time.monotonic()
        if settings.ray_address:
            ray.init(address=settings.ray_address, log_to_driver=True, runtime_env={"env_vars": env})
        else:  # hidden states never pass through Ray's object store: only sample ids and small results
            # "local": a cluster of this run's own, even where another runs on this machine (ray.init()
            # alone would join that one, or fail on the address a dead one left in /tmp/ray)
            ray.init(address="local", include_dashboard=False, object_store_memory=OBJECT_STORE,
                     log_to_driver=True, runtime_env={"env_vars": env})
        resources = ray.cluster_resources()
        gpus = resources.get("GPU", 0)
        need = {"num_gpus": settings.tp_size} if gpus else {"num_gpus": 0}
        wanted = settings.data_parallel_size * (settings.tp_size if gpus else 1)
        have = gpus if gpus else resources.get("CPU", 0)
        if have < wanted:
            raise UsageError(f"--data-parallel-size {settings.data_parallel_size}: the Ray cluster has {have:g} "
                             f"{'GPUs' if gpus else 'CPUs'}, {wanted} needed "
                             f"({'--tp-size ' + str(settings.tp_size) + ' GPUs' if gpus else 'one CPU'} per replica)")
        self.log(f"Ray {ray.__version__} ({'cluster ' + settings.ray_address if settings.ray_address else 'local'}, "
                 f"{have:g} {'GPUs' if gpus else 'CPUs'}) in {time.monotonic() - started:.0f} s: starting "
                 f"{settings.data_parallel_size} replicas (each loads the model; tens of seconds)")
        actor_class = ray.remote(Replica).options(num_cpus=1, max_concurrency=1, max_restarts=0, **need)
        actors = {k: actor_class.remote(self.run_plan.for_replica(k), k, env)
                  for k in range(settings.data_parallel_size)}
        loads = {actors[k].load.remote(): k for k in actors}
        started = time.monotonic()
        for ref, k in loads.items():
            try:
                info = ray.get(ref)
            except Exception as exc:  # noqa: BLE001 - one replica failing to load leaves the others
                self.log(f"replica {k} failed to load, left out:\n{remote_traceback(exc)}")
                ray.kill(actors[k])
                continue
            self.replicas[k] = Handle(k, actors[k], info)
            self.log(f"replica {k} loaded in {info['load_seconds']:.0f} s (pid {info['pid']} on {info['host']}"
                     + (f", devices {info['devices']}" if info["devices"] else "") + ")")
        if not self.replicas:
            raise ExtractionFailed(f"none of the {len(actors)} replicas loaded the model (tracebacks above)")
        self.summary.load_seconds = time.monotonic() - started

    # -- loop: the one loop of Extraction hands every batch out here
    def hand_out(self, batch: list) -> None:
        self._retry_lost()  # batches of a retired replica first: they are older
        handed = self._batch_of(batch)
        handed.number, self.handed_out = self.handed_out, self.handed_out + 1
        self._dispatch(handed)

    def _batch_of(self, samples: list[Sample]) -> ReplicaBatch:
        """A batch as the driver follows it: its items, its sample files."""
        return ReplicaBatch(samples, [s.index for s in samples], ", ".join(f"{s.index} ({s.where})" for s in samples))

    def _dispatch(self, batch: ReplicaBatch) -> None:
        while True:
            free = [h for h in self.replicas.values() if h.in_flight < IN_FLIGHT]
            if free:
                handle = min(free, key=lambda h: h.in_flight)
                ref = handle.actor.extract.remote(batch.items, batch.skip)
                self.calls[ref] = (handle.replica_id, batch)
                handle.in_flight += 1
                batch.outstanding = set(batch.indices) - batch.skip
                for index in batch.indices:
                    handle.unconfirmed[index] = batch
                return
            if not self.replicas:
                raise self._all_failed()
            self._collect()

    def _collect(self, timeout: float | None = None) -> None:
        """Wait for one call to end; account for it, or retire its replica."""
        ready, _ = self.ray.wait(list(self.calls), num_returns=1, timeout=timeout)
        for ref in ready:
            replica_id, batch = self.calls.pop(ref)
            handle = self.replicas.get(replica_id)
            try:
                result = self.ray.get(ref)
            except Exception as exc:  # noqa: BLE001 - the actor died, or the batch raised in it
                self._retire(replica_id, batch, exc)
                continue
            if handle is None:  # retired while this call was queued
                continue
            handle.in_flight -= 1
            self._confirm(handle, result["written"])
            self._account(handle, batch, result)
            self._progressed()

    def _account(self, handle: Handle, batch: ReplicaBatch, result: dict) -> None:
        """A batch's call returned: its samples and tokens in the summary and the progress."""
        extracted = [s for s in batch.items if s.index not in batch.skip]
        tokens = sum(len(s.input_ids) for s in extracted)
        self.summary.extracted += len(extracted)
        self.summary.tokens += tokens
        self.summary.shared_rows += result["shared_rows"]
        self.summary.computed_tokens += result["computed_tokens"]
        self.summary.cached_tokens += result["cached_tokens"]
        todo, exact = self.pending.todo()
        self.progress.retotal(self.source.expected(todo), exact)
        self.progress.update(len(extracted), tokens)

    def _progressed(self) -> None:
        """After files were confirmed or a replica retired: nothing more here (``generate`` writes the
        lines of the batches whose files are all on disk)."""

    def _confirm(self, handle: Handle, written: dict[int, int]) -> None:
        for index, length in written.items():
            batch = handle.unconfirmed.pop(index, None)
            if batch is not None:
                batch.outstanding.discard(index)
            self.finished[index] = length

    def _retire(self, replica_id: int, batch: ReplicaBatch, exc: BaseException) -> None:
        """A replica failed: log why, stop it, queue again every batch it had not put on disk. One whose
        call raised is alive: it first finishes writing what it has (so no file of it is written again
        by another), within RETIRE_SECONDS; then it is killed."""
        handle = self.replicas.pop(replica_id, None)
        if handle is None:  # already retired (its other call in flight): its batches were queued again then
            return
        what = "died" if isinstance(exc, self.ray.exceptions.RayActorError) else "failed"
        batch.errors.append(f"replica {replica_id} {what}:\n{remote_traceback(exc)}")
        self.log(f"replica {replica_id} {what} on samples {batch.where()}; its unfinished batches go to the "
                 f"{len(self.replicas)} other replicas:\n{remote_traceback(exc)}")
        if what == "failed":
            try:
                self._confirm(handle, self.ray.get(handle.actor.finish.remote(), timeout=RETIRE_SECONDS)["written"])
            except Exception:  # noqa: BLE001 - broken for good: what it did not confirm is checked on disk
                pass
        self.ray.kill(handle.actor)
        lost = {id(b): b for b in [*handle.unconfirmed.values(), *self._unreturned(replica_id, batch)]}
        for lost_batch in lost.values():
            again = self._again(lost_batch)
            if again is None:
                continue
            if len(again.errors) >= ATTEMPTS:
                self.failed.append(again)
            else:
                self.retry.append(again)
        self._progressed()

    def _unreturned(self, replica_id: int, failed: ReplicaBatch) -> list[ReplicaBatch]:
        """Batches of a retired replica to look at besides those with files unconfirmed: none here
        (a batch whose files are all on disk is done; ``generate`` needs the lines its call returns)."""
        return []

    def _again(self, lost: ReplicaBatch) -> ReplicaBatch | None:
        """What of a batch whose replica retired runs again: the batch, less the samples whose files
        are whole (renamed into place before the death: kept); None when they all are."""
        whole = frozenset(index for index in lost.indices if self._whole(index))
        for index in whole:
            self.finished.setdefault(index, None)
        again = dataclasses.replace(lost, skip=lost.skip | whole, result=None)
        return None if len(again.skip) == len(again.indices) else again

    def _whole(self, index: int) -> bool:
        path = self.output.path / self.format.sample_file(index)
        return path.exists() and self.format.ends_whole(path)

    def _retry_lost(self) -> None:
        while self.retry and self.replicas:
            self._dispatch(self.retry.popleft())

    def _all_failed(self) -> ExtractionFailed:
        errors = "\n".join(e for b in [*self.failed, *self.retry] for e in b.errors[-1:])
        return ExtractionFailed(f"every replica failed; finished files are kept, rerun to resume. Last errors:\n"
                                f"{errors}")

    def open_sink(self) -> None:
        pass  # each replica writes through its own

    # -- finish: the calls in flight, the replicas' writers, then the shared end of run
    def finish(self) -> None:
        aborting = isinstance(sys.exc_info()[1], KeyboardInterrupt)  # a second Ctrl-C: kill, wait for nothing
        try:
            if not aborting:
                self._drain()
        finally:
            try:
                if not aborting:
                    self._finish_replicas()
            finally:
                for handle in self.replicas.values():
                    self.ray.kill(handle.actor)
                self.replicas.clear()
                if self.ray.is_initialized():
                    self.ray.shutdown()
                super().finish()
                # the rate counts until the last file is whole, as in a single run
                self.summary.seconds -= self.shutdown_seconds
                self.summary.shutdown_seconds += self.shutdown_seconds
        if not aborting:
            self._report_failures()

    def _drain(self) -> None:
        while self.calls or (self.retry and self.replicas):
            self._retry_lost()
            if self.calls:
                self._collect()

    def _finish_replicas(self) -> None:
        ends = {h.actor.finish.remote(): h for h in self.replicas.values()}
        for ref, handle in ends.items():
            try:
                result = self.ray.get(ref)
            except Exception as exc:  # noqa: BLE001 - its unwritten files are lost: say which
                lost = sorted(handle.unconfirmed)
                self.log(f"replica {handle.replica_id} failed finishing its files ({len(lost)} samples not on "
                         f"disk, a rerun extracts them):\n{remote_traceback(exc)}")
                continue
            self._confirm(handle, result["written"])
            self._progressed()
            if result["closing_line"]:  # what its backend said of the run (--cuda-graphs: where the capture ran)
                self.log(f"replica {handle.replica_id}: {result['closing_line']}")
            self.summary.bytes_written += result["bytes"]
            self.summary.stall_seconds += result["stall_seconds"]
            self.shutdown_seconds = max(self.shutdown_seconds, result["shutdown_seconds"])

    def _report_failures(self) -> None:
        left = [*self.failed, *self.retry]
        if not left:
            return
        lines = "\n".join(f"samples {b.where()}:\n" + "\n".join(b.errors) for b in left)
        unfinished, exact = self.unfinished()  # every sample of the range, not only the batches given up
        raise ExtractionFailed(f"{'' if exact else 'about '}{unfinished} samples were not extracted (finished files "
                               f"are kept; a rerun retries these). The batches given up:\n{lines}")


def remote_traceback(exc: BaseException) -> str:
    """The whole story of a replica's error: Ray's text carries the remote traceback."""
    text = str(exc).strip()
    if not text:
        text = "".join(traceback.format_exception(exc)).strip()
    return text or f"{type(exc).__name__} (no message)"
