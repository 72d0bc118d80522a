"""Overlapped generator calls (hidden_states/backends/overlap.py): call N+1's GPU phase runs while
call N copies its states out, and no reply overwrites a segment still being copied. A fake
generator stands in for speculators' here (its two phases, one shared segment per worker); the real
one runs overlapped in every e2e test of the speculators backend, compared with HF."""
import threading
import time
from collections import defaultdict

import pytest

from hidden_states.backends.overlap import OverlappedCalls

STEPS = 0.02  # one call's forward
COPY = 0.03  # the copy of one sequence's slice out of the segment
# A bound no loaded host reaches for what takes milliseconds here; only a broken gate waits it out
WAIT = 120


class FakeGenerator:
    """speculators' generate() in miniature: steps, then one ``_get_captured_states`` whose reply views
    the worker's one shared segment, then a slow clone of every sequence's slice out of it."""

    def __init__(self, fail_batch=None):
        self.segment = [None] * 8  # the worker's segment: rewritten by every reply
        self.executor = self
        self.events = []  # (what, batch id), in the order they happened
        self.fail_batch = fail_batch
        # {batch id: (event, other batch id)}: that batch copies its states only once the other
        # reached the event (or WAIT passed), so that an overlap the gate allows always happens,
        # however the host schedules the threads
        self.copy_after = {}
        self._reached = defaultdict(threading.Event)
        self._lock = threading.Lock()

    def _event(self, what, batch):
        with self._lock:
            self.events.append((what, batch[0][0]))
        self._reached[what, batch[0][0]].set()

    def collective_rpc(self, method, *args, **kwargs):
        if method == "_get_captured_states":
            batch = kwargs["batch"]
            self._event("fetch", batch)
            self.segment[:len(batch)] = [list(ids) for ids in batch]
            return self.segment
        return None

    def generate(self, batch):
        self._event("steps", batch)
        time.sleep(STEPS)
        if batch[0][0] == self.fail_batch:
            raise RuntimeError("worker raised in execute_model")
        view = self.collective_rpc("_get_captured_states", batch=batch)
        if batch[0][0] in self.copy_after:
            self._reached[self.copy_after[batch[0][0]]].wait(WAIT)
        copies = []
        for i in range(len(batch)):
            time.sleep(COPY)
            copies.append(list(view[i]))
        self._event("returned", batch)
        return copies


def batches(count, size=4):
    return [[[100 * b + i] for i in range(size)] for b in range(count)]


def pipelined(calls, work):
    """The extraction loop's order: submit batch N+1, then wait for batch N."""
    results, in_flight = [], None
    for batch in work:
        submitted = calls.submit(batch)
        if in_flight is not None:
            results.append(in_flight.result(timeout=WAIT))
        in_flight = submitted
    results.append(in_flight.result(timeout=WAIT))
    return results


def times(generator, what):
    """When each batch reached ``what``: its place in the order of all events."""
    return {batch: place for place, (event, batch) in enumerate(generator.events) if event == what}


def test_the_next_forward_runs_while_the_states_are_copied_and_each_batch_gets_its_own():
    generator = FakeGenerator()
    calls = OverlappedCalls(generator.executor, generator.generate)
    work = batches(4)
    generator.copy_after = {n: ("steps", n + 100) for n in (0, 100, 200)}

    results = pipelined(calls, work)

    assert results == work  # every sequence's states, its own, in order
    steps, fetched, returned = times(generator, "steps"), times(generator, "fetch"), times(generator, "returned")
    for n in (0, 100, 200):
        assert steps[n + 100] < returned[n]  # the next batch's forward began during this one's copy
        assert fetched[n + 100] >= returned[n]  # ... but its reply waited for the copy to end
    # forwards never overlap: each begins after the previous one's reply
    assert all(steps[n + 100] >= fetched[n] for n in (0, 100, 200))


def test_without_the_wait_for_the_copy_a_reply_overwrites_states_still_being_copied(monkeypatch):
    """Negative proof: the wait is what keeps batch N's states from being replaced by N+1's."""
    generator = FakeGenerator()
    calls = OverlappedCalls(generator.executor, generator.generate)
    monkeypatch.setattr(calls._copied, "wait", lambda timeout=None: True)
    work = batches(2)
    generator.copy_after = {0: ("fetch", 100)}  # the next reply lands before this copy

    results = pipelined(calls, work)

    assert results[0] != work[0]
    assert results[0][-1] == work[1][-1]  # the last slice copied came from the next batch's reply


def test_a_call_that_fails_before_its_reply_reports_and_lets_the_next_run():
    generator = FakeGenerator(fail_batch=100)
    calls = OverlappedCalls(generator.executor, generator.generate)
    first, second, third = batches(3)

    done = calls.submit(first)
    failing = calls.submit(second)  # starts once the first has its reply
    after = calls.submit(third)  # starts once the failed call gave the GPU phase back

    assert done.result(timeout=WAIT) == first
    with pytest.raises(RuntimeError, match="execute_model"):
        failing.result(timeout=WAIT)
    assert after.result(timeout=WAIT) == third


def test_calls_outside_submit_pass_the_gate_untouched():
    """The forward check calls the executor directly, before any batch: nothing waits for it."""
    generator = FakeGenerator()
    OverlappedCalls(generator.executor, generator.generate)

    assert generator.executor.collective_rpc("_get_captured_states", batch=[[7]])[0] == [7]
    assert generator.executor.collective_rpc("_reset_capture") is None


@pytest.mark.parametrize("declared", [True, False])
def test_adapters_that_tell_callers_apart_still_see_the_generator_calling(monkeypatch, declared):
    """rpc_single_reply reshapes only the replies of calls the generator makes (``caller_module``);
    the gate's wrapper sits between them and must not count as the caller (negative: undeclared)."""
    from vllm_compat import wrapping

    monkeypatch.setattr(wrapping, "_pass_through", set())
    if not declared:  # the gate's wrapper installed without saying it is transparent
        monkeypatch.setattr(wrapping, "pass_through", lambda function: None)
    generator = FakeGenerator()
    callers = []

    def recording(wrapped, instance, args, kwargs):
        callers.append(wrapping.caller_module())
        return wrapped(*args, **kwargs)

    wrapping.wrap_instance_method(generator.executor, "collective_rpc", recording)  # as the adapter, at construction
    calls = OverlappedCalls(generator.executor, generator.generate)
    calls.submit(batches(1)[0]).result(timeout=WAIT)

    assert callers == [__name__ if declared else "hidden_states.backends.overlap"]
