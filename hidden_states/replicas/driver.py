"""The Ray driver: starts the replicas and hands batches out to them (``RayReplicas``, the runner a
run's lifecycle loads and finishes in place of ``run.model_here.ModelHere``).

The driver runs the plan and prepare as a single run does (one output directory, one config, one
finished set, one batch source: a single run's batches, or a static shard's), then hands its batches
out: each replica holds at most two calls in flight (one running, one queued behind it), so a slow
replica gets fewer. What a batch is and how its return is counted is the run's *batch kind*
(:class:`SampleBatches` for ``extract``; ``generate.on_ray.ConversationBatches``): ``batch_of`` (a
batch's sample files), ``account`` (a returned call in the summary), ``unreturned`` and ``again``
(which batches of a retired replica are lost, what of them runs again) and ``progressed`` (after
files were confirmed).

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

from ..errors import UsageError
from ..inputs.streams import Sample
from ..progress import Progress
from ..run.prepared import PreparedRun
from ..run.summary import ExtractionFailed, Summary
from .replica import Handle, Replica, ReplicaBatch, import_ray, remote_traceback

IN_FLIGHT = 2  # calls queued per replica: the next batch is there when one ends
OBJECT_STORE = 256 * 2**20  # bytes, for a local Ray
ATTEMPTS = 2  # replicas a batch may fail on before it is given up
RETIRE_SECONDS = 120  # for a replica whose call raised to finish its files and shut vLLM down
# the driver's environment the replicas get (a remote node has its own otherwise)
FORWARDED_ENV = ("VLLM_", "HF_", "TRANSFORMERS_", "VLLM_COMPAT_", "OMP_NUM_THREADS")


def on_ray(settings) -> bool:
    """Whether a run's batches go to Ray replicas (``--data-parallel-size`` over 1, ``--ray-address``
    without ``--pp-size``: with it, one engine in this process whose stages vLLM's Ray executor places)."""
    return settings.data_parallel_size > 1 or (bool(settings.ray_address) and getattr(settings, "pp_size", 1) <= 1)


class SampleBatches:
    """``extract``'s batch kind: a batch is samples; a returned call counts them; a retired replica's
    batch runs again less the samples whose files are whole."""

    def batch_of(self, samples: list[Sample]) -> ReplicaBatch:
        return ReplicaBatch(samples, [s.index for s in samples], ", ".join(f"{s.index} ({s.where})" for s in samples))

    def account(self, driver: RayReplicas, handle: Handle, batch: ReplicaBatch, result: dict) -> None:
        """A batch's call returned: its samples and tokens in the summary and the progress."""
        summary = driver.summary
        extracted = [s for s in batch.items if s.index not in batch.skip]
        tokens = sum(len(s.input_ids) for s in extracted)
        summary.extracted += len(extracted)
        summary.tokens += tokens
        summary.shared_rows += result["shared_rows"]
        summary.computed_tokens += result["computed_tokens"]
        summary.cached_tokens += result["cached_tokens"]
        todo, exact = driver.prepared.pending.todo()
        driver.progress.retotal(driver.prepared.source.expected(todo), exact)
        driver.progress.update(len(extracted), tokens)

    def progressed(self, driver: RayReplicas) -> None:
        """After files were confirmed or a replica retired: nothing more for samples."""

    def unreturned(self, driver: RayReplicas, replica_id: int, failed: ReplicaBatch) -> list[ReplicaBatch]:
        """Batches of a retired replica to look at besides those with files unconfirmed: none (a batch
        whose files are all on disk is done)."""
        return []

    def again(self, driver: RayReplicas, lost: ReplicaBatch) -> ReplicaBatch | None:
        """What of a batch whose replica retired runs again: the batch, less the samples whose files
        are whole (renamed into place before the death: kept); None when they all are."""
        whole = frozenset(index for index in lost.indices if driver.whole(index))
        for index in whole:
            driver.prepared.finished.setdefault(index, None)
        again = dataclasses.replace(lost, skip=lost.skip | whole, result=None)
        return None if len(again.skip) == len(again.indices) else again


class RayReplicas:
    """``settings.data_parallel_size`` Ray replicas running ``prepared``'s batches of ``kind``.

    Args:
        kind: the run's batch kind (:class:`SampleBatches`, ``generate.on_ray.ConversationBatches``).

    Attributes:
        progress: the run's progress (the loop sets it before the first batch).
    """

    def __init__(self, prepared: PreparedRun, summary: Summary, kind, *, log, unfinished):
        self.prepared, self.summary, self.kind, self.log = prepared, summary, kind, log
        self.unfinished = unfinished  # () -> (samples of the range no file holds, exact): the run's count
        self.ray = import_ray()
        self.replicas: dict[int, Handle] = {}
        self.calls: dict = {}  # ObjectRef -> (replica id, ReplicaBatch)
        self.retry: collections.deque[ReplicaBatch] = collections.deque()
        self.failed: list[ReplicaBatch] = []
        self.shutdown_seconds = 0.0  # the slowest replica's vLLM shutdown, after its last file
        self.handed_out = 0  # batches, for their numbers
        self._aborting = False  # a second Ctrl-C: the replicas killed, nothing waited for
        self.progress: Progress | None = None

    # -- load: start Ray and the replicas
    def load(self) -> None:
        ray, settings = self.ray, self.prepared.settings
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
        per_replica = settings.tp_size * settings.pp_size  # each pipeline stage on --tp-size GPUs
        need = {"num_gpus": per_replica} if gpus else {"num_gpus": 0}
        wanted = settings.data_parallel_size * (per_replica if gpus else 1)
        have = gpus if gpus else resources.get("CPU", 0)
        if have < wanted:
            raise UsageError(f"--data-parallel-size {settings.data_parallel_size}: the Ray cluster has {have:g} "
                             f"{'GPUs' if gpus else 'CPUs'}, {wanted} needed "
                             f"({str(per_replica) + ' GPUs (--tp-size x --pp-size)' if gpus else 'one CPU'} per replica)")
        self.log(f"Ray {ray.__version__} ({'cluster ' + settings.ray_address if settings.ray_address else 'local'}, "
                 f"{have:g} {'GPUs' if gpus else 'CPUs'}) in {time.monotonic() - started:.0f} s: starting "
                 f"{settings.data_parallel_size} replicas (each loads the model; tens of seconds)")
        actor_class = ray.remote(Replica).options(num_cpus=1, max_concurrency=1, max_restarts=0, **need)
        actors = {k: actor_class.remote(self.prepared.run_plan.for_replica(k), k, env)
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

    # -- the loop hands every batch out here
    def hand_out(self, items: list) -> None:
        self._retry_lost()  # batches of a retired replica first: they are older
        handed = self.kind.batch_of(items)
        handed.number, self.handed_out = self.handed_out, self.handed_out + 1
        self._dispatch(handed)

    def drain(self) -> None:
        """Nothing: the calls in flight are waited for as the run finishes (:meth:`finish`)."""

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
            self.kind.account(self, handle, batch, result)
            self.kind.progressed(self)

    def _confirm(self, handle: Handle, written: dict[int, int]) -> None:
        for index, length in written.items():
            batch = handle.unconfirmed.pop(index, None)
            if batch is not None:
                batch.outstanding.discard(index)
            self.prepared.finished[index] = length

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
        lost = {id(b): b for b in [*handle.unconfirmed.values(), *self.kind.unreturned(self, replica_id, batch)]}
        for lost_batch in lost.values():
            again = self.kind.again(self, lost_batch)
            if again is None:
                continue
            if len(again.errors) >= ATTEMPTS:
                self.failed.append(again)
            else:
                self.retry.append(again)
        self.kind.progressed(self)

    def whole(self, index: int) -> bool:
        """Whether sample ``index``'s file is whole on disk."""
        path = self.prepared.output.path / self.prepared.format.sample_file(index)
        return path.exists() and self.prepared.format.ends_whole(path)

    def _retry_lost(self) -> None:
        while self.retry and self.replicas:
            self._dispatch(self.retry.popleft())

    def _all_failed(self) -> ExtractionFailed:
        errors = "\n".join(e for b in [*self.failed, *self.retry] for e in b.errors[-1:])
        return ExtractionFailed(f"every replica failed; finished files are kept, rerun to resume. Last errors:\n"
                                f"{errors}")

    # -- finish: the calls in flight, the replicas' writers
    def finish(self, started: float | None) -> None:
        """Wait for the calls in flight, finish every replica's files, stop Ray; the summary's times
        from ``started`` (the loop's start; None: now). A second Ctrl-C kills, waiting for nothing."""
        aborting = self._aborting = isinstance(sys.exc_info()[1], KeyboardInterrupt)
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
                # the rate counts until the last file is whole, as in a single run
                now = time.monotonic()
                self.summary.seconds = now - (started or now) - self.shutdown_seconds
                self.summary.shutdown_seconds = self.shutdown_seconds

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
            self.kind.progressed(self)
            if result["closing_line"]:  # what its backend said of the run (--cuda-graphs: where the capture ran)
                self.log(f"replica {handle.replica_id}: {result['closing_line']}")
            self.summary.bytes_written += result["bytes"]
            self.summary.stall_seconds += result["stall_seconds"]
            self.shutdown_seconds = max(self.shutdown_seconds, result["shutdown_seconds"])

    def report_failures(self) -> None:
        """The batches given up (each failed on ``ATTEMPTS`` replicas), with every replica's traceback:
        raised once the run's end is written (a second Ctrl-C waited for nothing: nothing to say)."""
        left = [*self.failed, *self.retry]
        if not left or self._aborting:
            return
        lines = "\n".join(f"samples {b.where()}:\n" + "\n".join(b.errors) for b in left)
        unfinished, exact = self.unfinished()  # every sample of the range, not only the batches given up
        raise ExtractionFailed(f"{'' if exact else 'about '}{unfinished} samples were not extracted (finished files "
                               f"are kept; a rerun retries these). The batches given up:\n{lines}")
