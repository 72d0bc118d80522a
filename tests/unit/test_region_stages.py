"""Regions with a counter block and a token-id array per capturing pipeline stage (regions.py):
one stage lays a region out as before, byte for byte; with more, a row is stored once every stage
stored it, the stages agree on the first row, and the stage whose ids disagree is named."""
import struct
import threading
import time

import pytest
import torch

from hidden_states.backends.shared.regions import (FIRST_ROW, HEADER, REWRITTEN, UNREWRITTEN, RegionPool, ids_start,
                                                   layer_start, region_bytes, scales_start)


def test_one_stage_is_the_layout_of_before():
    # the numbers of the single-stage layout: a 64-byte header, the ids padded to 64, then whole rows
    assert ids_start(10) == 64
    assert scales_start(10) == 128
    assert layer_start(10, 0, 128) == 128 and layer_start(10, 1, 128) == 128 + 10 * 128
    assert layer_start(10, 0, 96, scales=True) == 192
    assert region_bytes(20, 3, 256) == 256 + 3 * 20 * 256
    pool = RegionPool(1 << 16)
    offset = pool.reserve(region_bytes(10, 2, 128), timeout=1)
    assert struct.unpack_from("<qqqqq", pool.mapping, offset) == (0, 0, 0, 0, UNREWRITTEN)
    assert bytes(pool.mapping[offset + 40:offset + 64]) == bytes(24)  # nothing past the first block's counters
    pool.close()


def test_two_stages_lay_out_a_block_and_an_id_array_each():
    assert ids_start(10, 0, 2) == 128 and ids_start(10, 1, 2) == 192
    assert layer_start(10, 0, 128, stages=2) == 256
    assert scales_start(10, 2) == 256


def _pool(stages=(0, 1)):
    pool = RegionPool(1 << 16, stages=stages)
    return pool, pool.reserve(region_bytes(8, 2, 64, stages=len(stages)), timeout=1)


def _put(pool, at, value):
    struct.pack_into("<q", pool.mapping, at, value)


def test_rows_are_stored_once_the_slower_stage_stored_them():
    pool, offset = _pool()
    assert [struct.unpack_from("<q", pool.mapping, offset + HEADER + REWRITTEN)[0]] == [UNREWRITTEN]
    _put(pool, offset, 8)  # stage 0 done, stage 1 not yet
    assert pool.rows_stored(offset, 8, timeout=0) == 0
    started = time.monotonic()  # before the timer starts: a busy host may hold this thread between the two
    threading.Timer(0.05, _put, (pool, offset + HEADER, 8)).start()
    assert pool.rows_stored(offset, 8, timeout=5) == 8
    assert time.monotonic() - started >= 0.04
    pool.close()


def test_the_stages_must_agree_on_the_first_row():
    pool, offset = _pool((0, 1))
    _put(pool, offset + FIRST_ROW, 4)
    assert pool.first_row(offset, settled=False) == 4  # stage 1 has not stored yet
    with pytest.raises(RuntimeError, match=r"stage 0: 4, stage 1: 0"):
        pool.first_row(offset)
    _put(pool, offset + HEADER + FIRST_ROW, 4)
    assert pool.first_row(offset) == 4
    _put(pool, offset + HEADER + REWRITTEN, 2)
    assert pool.rewritten_from(offset) == 2  # the least over the stages
    pool.close()


def test_the_stage_whose_ids_disagree_is_named():
    pool, offset = _pool((0, 1))
    ids = [5, 6, 7, 8, 9, 10, 11, 12]
    for block in range(2):
        pool.view(offset + ids_start(8, block, 2), torch.int32, 8).copy_(torch.tensor(ids, dtype=torch.int32))
    assert pool.ids_disagree(offset, 8, ids) is None
    pool.view(offset + ids_start(8, 1, 2) + 4 * 3, torch.int32, 1).fill_(99)
    assert pool.ids_disagree(offset, 8, ids) == "from token 3 of 8 on, stored by pipeline stage 1"
    pool.close()
