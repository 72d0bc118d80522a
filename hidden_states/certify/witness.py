"""The engine's side of a certificate: its own log-probabilities at some of a row's positions, as vLLM
returns them for the request (``SamplingParams(logprobs=TOP)``: its sampler's raw log-probabilities,
from its logits path, mapped to the request by vLLM itself).

The row's last position comes free with its request (the one token it samples). A position inside the
row is *probed*: a request for the row's first ``p + 1`` tokens, under the row's cache salt once the row
has run, so vLLM's prefix cache serves all but its last block and the probe costs a block of tokens and
one position of the LM head (:func:`probe_positions` says which).
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass

from .certificate import PROBE_SLACK

TOP = 4  # ids per position: the engine's likeliest (a wrong state moves every one; 4 cost nothing more)


@dataclass(frozen=True)
class Witness:
    """The engine's log-probabilities at ``positions`` of one row.

    Attributes:
        positions: row positions, ascending (the state at ``i`` predicts token ``i + 1``).
        token_ids: per position, the ids the engine gave (its likeliest first).
        logprobs: per position, their log-probabilities.
    """

    positions: list[int]
    token_ids: list[list[int]]
    logprobs: list[list[float]]
    probed: tuple[int, ...] = ()  # those of ``positions`` whose logprobs come from a probe's forward

    def within(self, length: int) -> Witness:
        """The positions inside a row's first ``length`` tokens: what certifies a row served from them."""
        keep = [i for i, p in enumerate(self.positions) if p < length]
        return Witness([self.positions[i] for i in keep], [self.token_ids[i] for i in keep],
                       [self.logprobs[i] for i in keep], tuple(p for p in self.probed if p < length))

    def tensors(self):
        """``(positions [p], token_ids [p, k], logprobs [p, k], slack [p])``, ids padded with -1; the
        slack :data:`.certificate.PROBE_SLACK` at probed positions, 1 at the row's own."""
        import torch

        width = max((len(ids) for ids in self.token_ids), default=0)
        ids = [row + [-1] * (width - len(row)) for row in self.token_ids]
        values = [row + [0.0] * (width - len(row)) for row in self.logprobs]
        slack = [PROBE_SLACK if p in self.probed else 1.0 for p in self.positions]
        return (torch.tensor(self.positions, dtype=torch.long), torch.tensor(ids, dtype=torch.long).view(-1, width),
                torch.tensor(values, dtype=torch.float32).view(-1, width), torch.tensor(slack, dtype=torch.float32))


def first_token_logprobs(output, position: int) -> tuple[list[int], list[float]]:
    """The engine's log-probabilities at a request's last prompt position: those its one output token
    came with (vLLM's ``RequestOutput``, asked with ``logprobs=TOP``), likeliest first."""
    completion = output.outputs[0] if output.outputs else None
    entry = completion.logprobs[0] if completion is not None and completion.logprobs else None
    if not entry:
        raise RuntimeError(f"vLLM returned no logprobs for batch position {position} (asked with logprobs={TOP})")
    ranked = sorted(entry.items(), key=lambda item: -item[1].logprob)[:TOP + 1]
    return [int(token) for token, _ in ranked], [float(value.logprob) for _, value in ranked]


def probe_positions(ids: list[int], served: list[int] = ()) -> list[int]:
    """The positions of a row of ``ids`` to probe, ascending, all before its last: one drawn from the
    row's own ids (the same on every run; over many rows every part of a row, the rows its prefix cache
    gave it among them, is looked at), and the last position of each row ``served`` from its first
    tokens (``served``: their lengths), which certifies them."""
    inside = len(ids) - 1
    if inside < 1:
        return []
    drawn = zlib.crc32(bytes(memoryview(_int32(ids)))) % inside
    return sorted({drawn, *(length - 1 for length in served if 0 < length <= inside)})


def _int32(ids: list[int]):
    import array

    return array.array("i", ids)
