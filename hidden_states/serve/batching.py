"""Requests to the engine in batches, each request's states to its file (``hidden-states serve``).

Every client request is one row. The gatherer takes the first request waiting, then whatever else
arrives within a short window, up to ``--batch-size`` rows and one engine step's tokens (the
backend's ``tokens_per_submit``; a longer row alone), and submits them as one batch: the engine
backend's feed keeps vLLM's engine running across batches, and rows of one batch share vLLM's prefix
cache. When the batch resolves, each row's states (views of the backend's shared-memory regions) are
written to a file on a writer thread and the request's future gets its path; the region returns to
the backend as the file is written.

Backpressure is holding: while the engine holds ``engine_tokens`` tokens of requests, or the
backend's regions are all taken (the writers behind), the gatherer waits before its next submit and
requests wait in its queue; none is refused. The engine is kept as full as ``extract`` keeps it, not
fuller: every request gathered at once would wait inside vLLM's scheduler instead.
"""
from __future__ import annotations

import itertools
import queue
import threading
import time
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor

from .. import fp8_states
from ..certify.witness import probe_positions
from .state_files import StateFiles

STOP = object()


class Draining(RuntimeError):
    """The server is shutting down: no new request is taken."""


def _settle(future: Future, result=None, error: BaseException | None = None) -> bool:
    """Resolve ``future`` unless it already is (a request the server failed when its engine died,
    whose batch resolves after); True when this call resolved it."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:
        return False
    return True


class _Request:
    def __init__(self, ids: list[int], number: int = 0):
        self.ids = ids
        self.number = number  # the server's count of requests taken (a failing certificate names it)
        self.future: Future = Future()  # the file's path
        self.taken = time.monotonic()  # the moments it passes each stage (``Stages``)
        self.submitted = self.returned = self.resolved = self.writing = 0.0


class Stages:
    """Where the answered requests spent their time, summed over requests (``GET /stats``): in the
    gatherer's queue, in submit (backpressure: waiting for room under ``engine_tokens``, then for a
    free region in the backend's ``submit``), in the engine, waiting for a writer thread, writing.
    Divided by ``requests``, each is a mean latency; which one grows with the clients' concurrency
    says where a server's rate goes."""

    FIELDS = ("queued", "in_submit", "in_engine", "to_writer", "writing")

    def __init__(self):
        self._lock = threading.Lock()
        self.requests = 0
        self.seconds = dict.fromkeys(self.FIELDS, 0.0)
        self.writing_now = self.most_writing = 0  # rows handed to the writers, not yet in their files

    def handed_to_writers(self, rows: int) -> None:
        with self._lock:
            self.writing_now += rows
            self.most_writing = max(self.most_writing, self.writing_now)

    def left_writers(self) -> None:
        with self._lock:
            self.writing_now -= 1

    def answered(self, request: _Request, written: float) -> None:
        with self._lock:
            self.requests += 1
            seconds = self.seconds
            seconds["queued"] += request.submitted - request.taken
            seconds["in_submit"] += request.returned - request.submitted
            seconds["in_engine"] += request.resolved - request.returned
            seconds["to_writer"] += request.writing - request.resolved
            seconds["writing"] += written - request.writing

    def snapshot(self) -> dict:
        with self._lock:
            return {"requests": self.requests, "seconds": {k: round(v, 3) for k, v in self.seconds.items()},
                    "most_rows_at_writers": self.most_writing}


class Gatherer:
    """Gathers requests into the backend's batches and writes each row's file.

    Args:
        backend: a started engine backend (``submit(batch) -> Future`` of per-row layer lists).
        files: where each row's file goes.
        layer_order: where each served layer is among those the backend captures.
        batch_size: the most rows of one submit.
        window: seconds the gatherer waits for more rows after the first.
        writer_threads: threads writing files.
        engine_tokens: the most tokens of submitted, unresolved requests (a batch is submitted alone
            past it); None: as many as the backend's regions hold.
        certifier: certifies each row before its file is written (``certify.certifier``); a row that
            fails is answered with the error, never with a file. None: rows go uncertified.
    """

    def __init__(self, backend, files: StateFiles, layer_order: list[int], *, batch_size: int, window: float,
                 writer_threads: int, engine_tokens: int | None = None, certifier=None):
        self.backend, self.files, self.layer_order = backend, files, layer_order
        self.certifier = certifier
        self._numbers = itertools.count(1)  # requests as a failing certificate names them
        self.batch_size, self.window, self.engine_tokens = batch_size, window, engine_tokens
        self._in_engine = 0  # tokens submitted, not yet resolved
        self._engine_room = threading.Condition()
        self._incoming: queue.Queue = queue.Queue()
        self._writers = ThreadPoolExecutor(writer_threads, thread_name_prefix="hidden-states-serve-writer")
        self._open = threading.Lock()
        self._draining = False
        self._refusal = "the server is shutting down"  # what a request after the drain began hears
        self._pending = 0  # requests taken, not yet answered
        self._held: set[Future] = set()  # their futures
        self._idle = threading.Condition()
        self.batches = self.rows = self.tokens = 0
        self.failure: BaseException | None = None  # the backend refused a batch: its engine is gone
        # False once a process of the backend's engine has ended (a backend without one: always True)
        self._engine_alive = backend.engine_alive
        self.stages = Stages()
        self._thread = threading.Thread(target=self._gather, name="hidden-states-gatherer", daemon=True)
        self._thread.start()

    def submit(self, ids: list[int]) -> Future:
        """Queue one row; its future holds the file's path (or the error that stopped it)."""
        request = _Request(ids, next(self._numbers))
        with self._open:
            if self._draining:
                raise Draining(self._refusal)
            with self._idle:
                self._pending += 1
                self._held.add(request.future)
            request.future.add_done_callback(self._answered)
            self._incoming.put(request)
        return request.future

    def _answered(self, future) -> None:
        with self._idle:
            self._pending -= 1
            self._held.discard(future)
            self._idle.notify_all()

    @property
    def held(self) -> int:
        """Requests taken and not yet answered."""
        with self._idle:
            return self._pending

    def stop_with(self, error: BaseException) -> int:
        """The engine is gone: take no new request (they hear ``error``), and answer every request
        taken and not yet answered with ``error`` at once, whatever the engine would have done with it
        (a dead engine answers nothing). Returns how many were answered so."""
        with self._open:
            self.failure = self.failure or error
            self._draining = True
            self._refusal = f"the server is stopping: {error}"
        with self._idle:
            held = list(self._held)
        with self._engine_room:  # a submit waiting for room gives up (its batch then fails)
            self._engine_room.notify_all()
        return sum(_settle(future, error=error) for future in held)

    def drain(self, timeout: float | None = None) -> bool:
        """Take no new request, answer every one taken; True when all were answered within ``timeout``."""
        with self._open:
            self._draining = True
            self._incoming.put(STOP)
        with self._idle:
            done = self._idle.wait_for(lambda: self._pending == 0, timeout)
        self._thread.join(timeout=5)
        self._writers.shutdown(wait=done)
        return done

    def _gather(self) -> None:
        while True:
            first = self._incoming.get()
            if first is STOP:
                return
            batch, tokens = [first], len(first.ids)
            budget = self.backend.tokens_per_submit
            deadline = time.monotonic() + self.window
            stop = False
            while len(batch) < self.batch_size and (budget is None or tokens < budget):
                try:
                    request = self._incoming.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if request is STOP:
                    stop = True
                    break
                if budget is not None and tokens + len(request.ids) > budget:
                    self._submit(batch)  # the new row starts the next batch
                    batch, tokens = [], 0
                batch.append(request)
                tokens += len(request.ids)
            if batch:
                self._submit(batch)
            if stop:
                return

    def _submit(self, batch: list[_Request]) -> None:
        now = time.monotonic()
        for request in batch:
            request.submitted = now
        tokens = sum(len(request.ids) for request in batch)
        with self._engine_room:
            if self.engine_tokens is not None:
                self._engine_room.wait_for(lambda: not self._in_engine or self.failure is not None
                                           or self._in_engine + tokens <= self.engine_tokens)
            if self.failure is not None:  # the engine is gone: nothing more goes to it
                for request in batch:
                    _settle(request.future, error=self.failure)
                return
            self._in_engine += tokens
        try:
            rows = [request.ids for request in batch]
            submitted = self.backend.submit(rows) if self.certifier is None else \
                self.backend.submit_certified(rows, [probe_positions(ids, hit_tokens=self.backend.prefix_hit_tokens)
                                                     for ids in rows])
        except Exception as exc:  # noqa: BLE001 - each request of the batch answers with it, and the server stops
            self._left_engine(tokens)
            self.failure = self.failure or exc
            for request in batch:
                _settle(request.future, error=exc)
            return
        self.batches += 1
        self.rows += len(batch)
        self.tokens += tokens
        returned = time.monotonic()
        for request in batch:
            request.returned = returned
        submitted.add_done_callback(lambda done: self._resolved(batch, tokens, done))

    def _left_engine(self, tokens: int) -> None:
        with self._engine_room:
            self._in_engine -= tokens
            self._engine_room.notify_all()

    def _resolved(self, batch: list[_Request], tokens: int, done: Future) -> None:
        """On the backend's thread: hand each row to a writer thread (nothing here may block)."""
        self._left_engine(tokens)
        try:
            states = done.result()
        except Exception as exc:  # noqa: BLE001
            if not self._engine_alive():  # vLLM's own "engine dead" error: the server answers these
                self.failure = self.failure or exc  # requests (``stop_with``), naming the process that died
                return
            for request in batch:
                _settle(request.future, error=exc)
            return
        now = time.monotonic()
        self.stages.handed_to_writers(len(batch))
        for request, layers in zip(batch, states, strict=True):
            request.resolved = now
            layers, witness = layers if self.certifier is not None else (layers, None)
            self._writers.submit(self._write, request, fp8_states.pick(layers, self.layer_order), witness)
        states.clear()  # each row's layers now live only in its writer's task: its region frees as it ends

    def _write(self, request: _Request, layers: list, witness=None) -> None:
        request.writing = time.monotonic()
        try:
            extra = None
            if witness is not None:  # certified before its file is written: a failing row is answered with the error
                extra = self.certifier.certify(f"request {request.number} ({len(request.ids)} tokens)", layers,
                                               witness.result()).tensors()
            path = self.files.write(request.ids, layers, extra)
        except Exception as exc:  # noqa: BLE001 - the request's reply says it
            _settle(request.future, error=exc)
        else:
            if _settle(request.future, str(path)):
                self.stages.answered(request, time.monotonic())
        finally:
            self.stages.left_writers()
