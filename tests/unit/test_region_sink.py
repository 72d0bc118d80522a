"""A pipeline stage on another host (``shared/region_sink``, ``worker/pool_access``): its rows reach
the parent's pool over a loopback sink as a local stage's would, counters after bytes; only this
run's stages write, only into their own parts; a stage that goes away fails the waiting batches at
once, naming it."""
import mmap
import struct
import threading
import time

import pytest
import torch

from hidden_states.backends import region_transport
from hidden_states.backends.shared import region_sink
from hidden_states.backends.shared.region_sink import SINK_ENV, RegionSender, RegionSink
from hidden_states.backends.shared.regions import HEADER, RegionPool, ids_start, layer_start, region_bytes
from hidden_states.backends.worker import pool_access
from hidden_states.backends.worker.pool_access import mapped_pool
from tests.unit.decoder_stack import extract_through_stages

PROMPTS = {"a": [3, 4, 5, 6, 7], "b": [9, 8, 7]}
LAYER_IDS = [0, 2, 3, 5]
SPLITS = [(0, 3), (3, 6)]
SECRET = b"s" * 32


def _regions(pool, offsets, lengths, snapshot):
    for offset, length in zip(offsets, lengths):
        assert pool.rows_stored(offset, length, timeout=5) == length
    snapshot.extend(bytes(pool.mapping[o:o + region_bytes(n, len(LAYER_IDS), 16, stages=2)])
                    for o, n in zip(offsets, lengths))


@pytest.mark.parametrize("through_sink", [(1,), (0, 1)])
def test_a_stage_through_the_sink_stores_the_bytes_a_local_stage_stores(monkeypatch, through_sink):
    local, sunk = [], []
    here, _, _ = extract_through_stages(monkeypatch, PROMPTS, LAYER_IDS, SPLITS,
                                        lambda *a: _regions(*a, local))
    there, backend, _ = extract_through_stages(monkeypatch, PROMPTS, LAYER_IDS, SPLITS,
                                               lambda *a: _regions(*a, sunk), through_sink=through_sink)
    assert backend.sink is not None and local == sunk
    for a, b in zip(here, there, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_the_counters_cross_after_the_bytes(monkeypatch):
    seen = []
    outside = RegionSink._outside

    def noting(self, block, region, length, offset, nbytes):
        seen.append((region, offset, nbytes))
        return outside(self, block, region, length, offset, nbytes)

    monkeypatch.setattr(RegionSink, "_outside", noting)
    extract_through_stages(monkeypatch, PROMPTS, LAYER_IDS, SPLITS, through_sink=(1,))
    regions = {region for region, _, _ in seen}
    assert len(regions) == 2
    for region in regions:
        frames = [(offset, nbytes) for r, offset, nbytes in seen if r == region]
        count = frames.index((region + HEADER, 8))  # stage 1's row count, in its block
        assert count == len(frames) - 1 and count > len(SPLITS)  # last, after its ids and its layers


def _sink(stages=(0, 1)):
    pool = RegionPool(1 << 16, stages=stages, nonce=b"n" * 16)
    pool.unlink()  # nothing here maps it by name: its file in /dev/shm is not left behind by a test
    offset = pool.reserve(region_bytes(8, 2, 16, stages=len(stages)), timeout=1)
    return pool, offset, RegionSink(pool, SECRET, {0: [0], 1: [1]}, 16, False)


def _host(pool):
    return torch.frombuffer(mmap.mmap(-1, pool.base + pool.capacity), dtype=torch.uint8)


def test_a_wrong_secret_is_refused_and_the_run_goes_on():
    pool, offset, sink = _sink()
    host = _host(pool)
    host[offset + HEADER:offset + HEADER + 8].view(torch.int64)[0] = 8
    with pytest.raises(RuntimeError, match=r"refused pipeline stage block 1 \(not this run's secret"):
        RegionSender(sink.address, b"x" * 32, 1, host)
    assert pool.rows_stored(offset + HEADER, 8, timeout=0) == 0 and pool.failure is None and sink.connected == []
    stage = RegionSender(sink.address, SECRET, 1, host)  # the stage itself still gets in, once
    assert sink.connected == [1]
    with pytest.raises(RuntimeError, match=r"or the block connected already"):
        RegionSender(sink.address, SECRET, 1, host)
    stage.send([], [(offset, 8, offset + HEADER, 8)])
    deadline = time.monotonic() + 5
    while struct.unpack_from("<q", pool.mapping, offset + HEADER)[0] != 8 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert struct.unpack_from("<q", pool.mapping, offset + HEADER)[0] == 8
    sink.close()
    stage.close()


def _fails(pool, offset, match):
    with pytest.raises(RuntimeError, match=match):
        pool.rows_stored(offset, 8, timeout=5)


@pytest.mark.parametrize("where", ["another stage's block", "another stage's ids", "another stage's layer",
                                   "outside the pool"])
def test_a_frame_outside_the_stages_parts_fails_the_run_naming_the_stage(where):
    pool, offset, sink = _sink()
    at = {"another stage's block": offset,
          "another stage's ids": offset + ids_start(8, 0, 2),
          "another stage's layer": offset + layer_start(8, 0, 16, stages=2),
          "outside the pool": pool.base + pool.capacity - 4}[where]
    stage = RegionSender(sink.address, SECRET, 1, _host(pool))
    stage.send([(offset, 8, at, 8)], [])
    _fails(pool, offset, r"^pipeline stage 1 sent rows .*: the region sink's protocol is broken")
    assert ("outside the pool" in pool.failure) == (where == "outside the pool")
    sink.close()


def test_a_stage_that_goes_away_fails_the_waiting_batches_at_once_naming_it():
    pool, offset, sink = _sink()
    stage = RegionSender(sink.address, SECRET, 1, _host(pool))
    threading.Timer(0.1, stage.close).start()
    started = time.monotonic()
    _fails(pool, offset + HEADER, r"^pipeline stage 1 stopped sending its rows: it closed its connection")
    assert time.monotonic() - started < 2  # not the rows' timeout
    sink.close()


def test_a_ray_replica_under_the_multiprocessing_executor_names_no_node(monkeypatch):
    """A data-parallel replica runs in a Ray worker and starts its engine's stages itself, on its own
    host: the workers are told no node (they map the file), which only vLLM's Ray executor sets."""
    pool = RegionPool(1 << 12, nonce=b"n" * 16)
    monkeypatch.delenv(SINK_ENV, raising=False)
    monkeypatch.setattr(region_transport, "ray_node_id", lambda: "the-replicas-node")
    sink, told = region_transport.open_transport(pool, {0: [0]}, 64, False, on_ray=False)
    assert sink is None and told["node"] is None
    pool.close()


def test_a_worker_maps_the_pool_only_where_it_finds_this_runs_nonce(monkeypatch):
    pool = RegionPool(1 << 12, nonce=b"n" * 16)
    monkeypatch.delenv(SINK_ENV, raising=False)
    here = {"nonce": b"n" * 16, "node": None}
    assert mapped_pool(pool.path, here) is not None
    assert mapped_pool(pool.path, {**here, "nonce": b"m" * 16}) is None  # another run's file of that name
    assert mapped_pool(pool.path, {**here, "node": "another-ray-node"}) is None  # same IP, same /dev/shm maybe
    assert mapped_pool(pool.path + "-gone", here) is None
    # a worker Ray runs, told of no node (its parent's stages are not Ray's): the file tells
    monkeypatch.setattr(pool_access, "ray_node_id", lambda: "a-ray-node")
    assert mapped_pool(pool.path, here) is not None
    monkeypatch.setenv(SINK_ENV, "always")
    assert region_sink.forced() and mapped_pool(pool.path, here) is None
    pool.close()
