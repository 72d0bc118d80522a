"""Where a certificate's probes fall (``certify.witness.probe_positions``): with the engine's prefix-cache
granularity known, the drawn position starts one of the row's blocks, so that the probe of the row's
first ``p + 1`` tokens finds ``p`` of them cached and computes one token; without it (or in a row too
short to hold a block start) any position of the row, as before; the rows served from a row's first
tokens are probed at their last position either way. The extraction's loop asks its backend's
granularity (a fake certifying backend)."""
from __future__ import annotations

import random

import pytest

from hidden_states.certify.witness import _seed, probe_positions


def rows(count: int, length: int, seed: int = 0) -> list[list[int]]:
    draw = random.Random(seed)
    return [[draw.randrange(32000) for _ in range(length)] for _ in range(count)]


def computed_by_probe(p: int, hit_tokens: int) -> int:
    """The tokens vLLM computes for a probe of a row's first ``p + 1`` tokens whose blocks it holds: all
    but the last token may hit, and a hit ends at a multiple of ``hit_tokens``."""
    return p + 1 - (p // hit_tokens) * hit_tokens


@pytest.mark.parametrize("hit_tokens", [16, 64, 128])
def test_a_drawn_probe_starts_a_block_and_computes_one_token(hit_tokens):
    drawn = [probe_positions(ids, hit_tokens=hit_tokens) for ids in rows(400, 2048)]
    assert all(len(positions) == 1 for positions in drawn)
    positions = [p for (p,) in drawn]
    assert all(p % hit_tokens == 0 and 0 < p < 2047 for p in positions)
    assert {computed_by_probe(p, hit_tokens) for p in positions} == {1}
    # over many rows the probes still reach every part of a row: most block starts are drawn
    assert len(set(positions)) >= 0.8 * min(400, (2047 - 1) // hit_tokens)


def test_without_a_granularity_the_draw_is_any_position_and_costs_part_of_a_block():
    drawn = [p for ids in rows(400, 2048) for p in probe_positions(ids)]
    assert drawn == [_seed(ids) % 2047 for ids in rows(400, 2048)]  # the draw of rows certified before
    assert sum(computed_by_probe(p, 64) for p in drawn) / len(drawn) > 16  # half a block of 64 on average


def test_a_row_too_short_for_a_block_start_draws_as_without_one():
    for ids in rows(50, 60):
        assert probe_positions(ids, hit_tokens=64) == probe_positions(ids)
    for ids in rows(50, 66):  # 64 is a start before the last position (65): it is the one drawn
        assert probe_positions(ids, hit_tokens=64) == [64]


def test_rows_served_from_the_first_tokens_are_probed_at_their_last_position():
    (ids,) = rows(1, 300)
    positions = probe_positions(ids, served=[100, 300, 400], hit_tokens=64)
    assert 99 in positions and 299 not in positions  # the row's own last position comes with its request
    assert [p for p in positions if p != 99][0] % 64 == 0


def test_the_extraction_draws_with_its_backends_granularity(tmp_path):
    torch = pytest.importorskip("torch")
    del torch
    from hidden_states.certify.certifier import Certifier
    from hidden_states.certify.head import FinalHead
    from hidden_states.extract.rows import ExtractRows
    from hidden_states.inputs.streams import Sample
    from hidden_states.run.summary import Summary
    from tests.unit.certified_model import BACKEND_LAYERS, CertifyingBackend, head_checkpoint

    head = FinalHead.load(head_checkpoint(tmp_path / "model"))
    backend = CertifyingBackend(head)
    backend.prefix_hit_tokens = 8

    class Writer:
        def write(self, row, layers, extra):
            pass

    class Model:
        def __init__(self):
            self.backend, self.writer, self.layer_order = backend, Writer(), list(range(BACKEND_LAYERS))
            self.certifier = Certifier(head, BACKEND_LAYERS - 1)

    extraction = ExtractRows(Model(), Summary(), share_prefixes=False)
    samples = [Sample(index, index + 1, [(7 * index + k) % 500 for k in range(40)], None) for index in range(6)]
    extraction.hand_out(samples)
    extraction.drain()
    assert backend.submitted and all(len(p) == 1 and p[0] % 8 == 0 and 0 < p[0] < 39 for p in backend.submitted)
