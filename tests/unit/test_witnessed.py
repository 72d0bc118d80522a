"""A certified batch on an engine backend (``backends/witnessed.py``), with vLLM's outputs stood in for:
each row's witness is its probes' logprobs then its own request's at its last position, the rows the
prefix cache gave a request are probed at their last, and the states are handed out before the probes
run, which never hold them."""
from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace

import pytest

from hidden_states.backends.engine_feed import EngineBatch
from hidden_states.backends import witnessed
from hidden_states.certify import certificate as C


def output(ids, top):
    """A finished request as vLLM returns it: its prompt, and its one token's logprobs (id -> value)."""
    ranked = {token: SimpleNamespace(logprob=value) for token, value in top.items()}
    return SimpleNamespace(prompt_token_ids=list(ids), outputs=[SimpleNamespace(logprobs=[ranked])])


class States(list):
    """A row's layers (weak-referenceable, to see who keeps them)."""


def certified_batch(rows, probes, cached=None):
    batch = EngineBatch(rows, "salt-1")
    batch.probes, batch.cached = probes, cached
    for position, ids in enumerate(rows):
        batch.finished[position] = output(ids, {7: -0.5, 8: -1.5})
    return batch


def run_probes(probe):
    for index, ids in enumerate(probe.ids):
        probe.finished[index] = output(ids, {len(ids): -0.25})
    witnessed.finished(probe)


def test_a_row_is_witnessed_at_its_probes_and_its_last_position():
    rows = [[1, 2, 3, 4, 5], [9, 8, 7]]
    batch = certified_batch(rows, [[1], []])
    put = []
    witnessed.resolve(batch, [States(), States()], put.append)
    probe, = put
    assert probe.ids == [[1, 2]] and probe.cache_salt == "salt-1"
    (_, first), (_, second) = batch.future.result()  # the states are out before the probes have run
    assert not first.done() and not second.done()
    run_probes(probe)
    first, second = first.result(), second.result()
    assert (first.positions, first.token_ids, first.logprobs) == ([1, 4], [[2], [7, 8]], [[-0.25], [-0.5, -1.5]])
    assert (second.positions, second.token_ids) == ([2], [[7, 8]])
    assert first.probed == (1,) and second.probed == ()  # the last position is the request's own forward
    assert first.tensors()[3].tolist() == [C.PROBE_SLACK, 1.0] and first.within(3).probed == (1,)


def test_the_last_row_the_prefix_cache_gave_is_probed_and_a_batch_probing_nothing_resolves_at_once():
    batch = certified_batch([[1, 2, 3, 4, 5, 6]], [[]], cached=[4])
    assert witnessed.probed(batch) == [[3]]
    batch = certified_batch([[1, 2, 3]], [[]])
    witnessed.resolve(batch, [States()], pytest.fail)
    assert batch.future.result()[0][1].result().positions == [2]


def test_a_probe_of_other_token_ids_fails_its_batch():
    batch = certified_batch([[1, 2, 3, 4]], [[1]])
    put = []
    witnessed.resolve(batch, [States()], put.append)
    put[0].finished[0] = output([5, 5], {1: -1.0})
    witnessed.finished(put[0])
    with pytest.raises(RuntimeError, match="probe of batch position 0 holds other token ids"):
        batch.future.result()[0][1].result()


def test_a_probe_waiting_to_run_does_not_hold_the_states():
    """The states hold their regions of the pool until collected: once the writer is done with a row,
    its region goes back though its probes have not run yet (with the collector off, as in a process
    that allocates little)."""
    batch = certified_batch([[1, 2, 3, 4]], [[1]])
    states = States()
    kept = weakref.ref(states)
    put = []
    witnessed.resolve(batch, [states], put.append)
    del states
    gc.disable()
    try:
        batch.future = None  # the caller has taken the result and written the row
        assert kept() is None and not put[0].future.done()
        run_probes(put[0])
    finally:
        gc.enable()


def test_an_engine_failing_the_probes_fails_each_row_s_witness():
    batch = certified_batch([[1, 2, 3, 4], [5, 6, 7]], [[1], [1]])
    put = []
    witnessed.resolve(batch, [States(), States()], put.append)
    put[0].future.set_exception(RuntimeError("the engine loop has stopped"))
    for _, witness in batch.future.result():
        with pytest.raises(RuntimeError, match="engine loop has stopped"):
            witness.result()
