"""The weights and KV cache each pipeline stage holds, from the checkpoint's tensors as the
preflight reads them (``preflight.estimate_memory``): one stage per GPU group of ``--tp-size`` ranks.

vLLM builds on each stage only its own decoder layers (``make_layers``: the others are empty
placeholders), the embedding on the first stage only, the final norm and the LM head on the last
only; with tied word embeddings the last stage's LM head is a copy of the embedding's shape, so a
model split into stages holds it twice. A tensor outside the decoder layers that is none of those
(a vision tower, a projector) is counted on the first stage.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from .pipeline import pp_partition

DECODER_LAYER = re.compile(r"model\.layers\.(\d+)\.")
_LAST_STAGE = re.compile(r"(^|\.)lm_head\.|^model\.norm\.")
_EMBEDDING = re.compile(r"(^|\.)embed_tokens\.")


@dataclass
class StageTally:
    """Bytes by where vLLM puts them: ``layers[L] = [split, whole]`` of decoder layer L (split: tensors
    of two or more dimensions, which tensor parallelism divides; whole: the rest), ``first``/``last``
    the same for the first and the last stage's own tensors, ``embedding`` the embedding's split bytes
    (the tied LM head's size), ``kv_layer`` the KV cache of one layer for one batch on one rank."""

    num_layers: int
    tied_head: bool = False
    layers: list[list[int]] = field(default_factory=list)
    first: list[int] = field(default_factory=lambda: [0, 0])
    last: list[int] = field(default_factory=lambda: [0, 0])
    embedding: int = 0
    has_head: bool = False
    kv_layer: int = 0

    def __post_init__(self):
        self.layers = [[0, 0] for _ in range(self.num_layers)]

    def add(self, name: str, dimensions: int, size: int) -> None:
        kind = 0 if dimensions >= 2 else 1
        layer = DECODER_LAYER.match(name)
        if layer:
            self.layers[int(layer.group(1))][kind] += size
        elif _LAST_STAGE.search(name):
            self.last[kind] += size
            self.has_head = self.has_head or "lm_head." in name
        else:
            self.first[kind] += size
            if _EMBEDDING.search(name) and kind == 0:
                self.embedding += size

    def stage_needs(self, stages: list[tuple[int, int]], tp_size: int) -> list[tuple[int, int]]:
        """(weights, KV cache) one rank of each stage holds."""
        needs = []
        for k, (start, end) in enumerate(stages):
            split = sum(self.layers[layer][0] for layer in range(start, end))
            whole = sum(self.layers[layer][1] for layer in range(start, end))
            if k == 0:
                split, whole = split + self.first[0], whole + self.first[1]
            if k == len(stages) - 1:
                split, whole = split + self.last[0], whole + self.last[1]
                if k > 0 and self.tied_head and not self.has_head:
                    split += self.embedding
            needs.append((math.ceil(split / tp_size) + whole, self.kv_layer * (end - start)))
        return needs

    def worst(self, stages: list[tuple[int, int]], tp_size: int) -> tuple[int, int, int]:
        """The stage that needs the most on one rank: (stage, weights, KV cache)."""
        needs = self.stage_needs(stages, tp_size)
        k = max(range(len(needs)), key=lambda s: sum(needs[s]))
        return k, *needs[k]

    def all_ranks(self, stages: list[tuple[int, int]], tp_size: int) -> int:
        """What every rank of every stage holds together (vLLM's CPU backend: one host's memory)."""
        return tp_size * sum(weights + kv for weights, kv in self.stage_needs(stages, tp_size))

    def fitting_pp_size(self, tp_size: int, pp_size: int, budget: int) -> int | None:
        """The least pipeline size above ``pp_size`` (vLLM's default split) whose worst stage fits
        ``budget`` on one rank; None when no split of the layers does."""
        for more in range(pp_size + 1, self.num_layers + 1):
            _, weights, kv = self.worst(pp_partition(self.num_layers, more, {}), tp_size)
            if weights + kv <= budget:
                return more
        return None


def stage_name(stage: int, stages: list[tuple[int, int]]) -> str:
    """``stage 0 (layers 0-30 + embedding)``: a stage and what it holds."""
    start, end = stages[stage]
    layers = "no layers" if end <= start else f"layer {start}" if end - start == 1 else f"layers {start}-{end - 1}"
    extra = (["embedding"] if stage == 0 else []) + (["LM head"] if stage == len(stages) - 1 else [])
    return f"stage {stage} ({layers}{''.join(' + ' + e for e in extra)})"
