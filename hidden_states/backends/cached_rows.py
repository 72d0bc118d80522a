"""Rows vLLM's prefix cache gave a request: whose states they are (``--backend vllm-engine``).

With the prefix cache on, a request whose first blocks another request already computed starts past
them: its forward computes no states for those tokens (vLLM issue #44485), and the worker stores its
rows from the first position it ran (``regions``: the header's first row stored). A token's state
depends only on the tokens before it, so those rows are the first rows of any request whose ids
begin the same way and whose own rows are whole. Each batch runs under a cache salt of its own
(``engine_feed.EngineBatch.cache_salt``): vLLM shares blocks only between requests of one batch, so every
row it skipped was computed by a request whose region the batch still holds.
"""
from __future__ import annotations


def fill_order(ids: list[list[int]], first: list[int]) -> list[tuple[int, int]]:
    """``(position, source)`` pairs: the rows ``[0, first[position])`` of ``position`` are the first
    rows of ``source``, whose rows are whole by then (computed, or filled by an earlier pair).

    ``first[p]`` is where the worker began storing ``p``'s rows (0: all computed). Raises when vLLM
    skipped tokens that no request of the batch holds."""
    whole = [p for p, start in enumerate(first) if start == 0]
    waiting = [p for p, start in enumerate(first) if start > 0]
    order: list[tuple[int, int]] = []
    while waiting:
        progress = False
        for p in list(waiting):
            head = ids[p][: first[p]]
            source = next((s for s in whole if len(ids[s]) >= len(head) and ids[s][: len(head)] == head), None)
            if source is not None:
                order.append((p, source))
                whole.append(p)
                waiting.remove(p)
                progress = True
        if not progress:
            p = waiting[0]
            raise RuntimeError(f"vLLM's prefix cache gave batch position {p} its first {first[p]} tokens, and no "
                               f"request of its batch computed them: their states are nowhere")
    return order
