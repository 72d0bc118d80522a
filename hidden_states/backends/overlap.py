"""Two calls of the unmodified generator at once: the next batch's forward runs while this batch's
states are copied out.

Every ``generate()`` of speculators 0.3/0.4 has two phases. First the GPU phase: requests into the
scheduler, the steps, and the ``_get_captured_states`` RPC, whose reply (``capture_transport``) is a
set of views of the worker's shared-memory segment. Then the copy phase, in the calling process
only: a ``.clone()`` of every sequence's slice of every layer out of that segment. Called one after
the other, the GPU idles during every copy (docs/reports/2026-11-30-first-gpu-runs.md, "Where the time goes", says how long).

:class:`OverlappedCalls` runs each call on its own thread and lets call N+1 start its GPU phase as
soon as call N has its reply, while N copies. Two rules keep every state where it belongs:

* GPU phases never overlap: the scheduler and the executor are used by one call at a time (a call
  holds ``_gpu_phase`` from its start until its reply has arrived).
* A reply never overwrites a segment that is still being copied: call N+1's ``_get_captured_states``
  waits until call N has returned, i.e. until its clones are made (``_copied``).

Nothing of the generator or of vLLM changes; the executor instance gets one wrapper on
``collective_rpc`` that only the ``_get_captured_states`` method passes through differently.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future

from vllm_compat.extractor_api import wrap_method

FETCH = "_get_captured_states"


class OverlappedCalls:
    """Submits calls of ``generate`` (a function of a batch that calls the generator whose executor
    is ``executor``, once) so that at most two run at once, overlapped as above."""

    def __init__(self, executor, generate):
        self._generate = generate
        self._gpu_phase = threading.Semaphore(1)
        self._copied = threading.Event()  # set: no call's reply is still being copied out
        self._copied.set()
        self._local = threading.local()  # per call: whether its reply has arrived (GPU phase over)
        # transparent: rpc_single_reply tells the generator's collective_rpc calls by their caller,
        # and this wrapper only passes them on
        wrap_method(executor, "collective_rpc", self._collective_rpc, transparent=True)

    def submit(self, batch: list[list[int]]) -> Future:
        """Start ``generate(batch)``; blocks while the previous call is still in its GPU phase."""
        self._gpu_phase.acquire()
        future: Future = Future()
        thread = threading.Thread(target=self._call, args=(batch, future), name="hidden-states-generate",
                                  daemon=True)  # a call stuck on a dead engine must not hold the exit
        try:
            thread.start()
        except BaseException:
            self._gpu_phase.release()
            raise
        return future

    def _call(self, batch, future: Future) -> None:
        self._local.replied = False
        try:
            result = self._generate(batch)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller through the future
            future.set_exception(exc)
        else:
            future.set_result(result)
        finally:
            if self._local.replied:  # its clones are made (or abandoned): the segment is free
                self._copied.set()
            else:  # failed before its reply: the next call may start; the segment is not this call's
                self._gpu_phase.release()

    def _collective_rpc(self, wrapped, executor, args, kwargs):
        method = args[0] if args else kwargs.get("method")
        if method != FETCH or not hasattr(self._local, "replied"):
            return wrapped(*args, **kwargs)  # other RPCs, and calls not made through submit()
        self._copied.wait()  # the previous call's clones are made: its segment may be rewritten
        self._copied.clear()
        try:
            return wrapped(*args, **kwargs)
        finally:
            self._local.replied = True
            self._gpu_phase.release()
