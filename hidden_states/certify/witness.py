"""The engine's side of a certificate: its own log-probabilities at some of a row's positions, as vLLM
returns them for the request (``SamplingParams(logprobs=TOP)``: its sampler's raw log-probabilities,
from its logits path, mapped to the request by vLLM itself).

The row's last position comes free with its request (the one token it samples). A position inside the
row is *probed*: a request for the row's first ``p + 1`` tokens, under the row's cache salt once the row
has run, so vLLM's prefix cache serves all but its last block and the probe costs a block of tokens and
one position of the LM head (:func:`probe_positions` says which).
"""
from __future__ import annotations

import random
import zlib
from dataclasses import dataclass

from .certificate import PROBE_SLACK

TOP = 4  # ids per position: the engine's likeliest (a wrong state moves every one; 4 cost nothing more)
# a generated reply's positions certified in its training row (``generate``): each is a position of the
# LM head for the whole vocabulary (twice, with the bound's variances), stacked with the batch's others:
# every position of a thousand-token reply would cost a thousand, and a batch's product gigabytes
REPLY_POSITIONS = 8


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
        return self.picked({p for p in self.positions if p < length}, probed_from=length)

    def picked(self, keep, probed_from: int) -> Witness:
        """The positions in ``keep``, those from ``probed_from`` on counted as probed (their states come
        from another forward than their logprobs)."""
        at = [i for i, p in enumerate(self.positions) if p in keep]
        positions = [self.positions[i] for i in at]
        return Witness(positions, [self.token_ids[i] for i in at], [self.logprobs[i] for i in at],
                       tuple(p for p in positions if p in self.probed or p >= probed_from))

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
    return ranked(entry)


def ranked(entry: dict) -> tuple[list[int], list[float]]:
    """One position's logprobs as vLLM gives them (id -> ``Logprob``): the ids and their values,
    likeliest first (the ``TOP``, and the sampled id where it is not among them)."""
    best = sorted(entry.items(), key=lambda item: -item[1].logprob)[:TOP + 1]
    return [int(token) for token, _ in best], [float(value.logprob) for _, value in best]


def reply_witness(output, prompt_length: int, recomputed_from: int) -> Witness:
    """The engine's logprobs with each token a reply sampled (vLLM's ``RequestOutput``, asked with
    ``logprobs=TOP``): at the position before the token (the prompt's last for the first), from the
    forward whose states the reply's region holds. Positions from ``recomputed_from`` on were stored
    again (a preempted request's prefix computed again): their states come from another forward,
    counted as probed."""
    completion = output.outputs[0]
    entries = completion.logprobs or []
    if len(entries) != len(completion.token_ids) or not all(entries):
        raise RuntimeError(f"vLLM returned logprobs for {len(entries)} of a reply's {len(completion.token_ids)} "
                           f"tokens (asked with logprobs={TOP})")
    positions = [prompt_length - 1 + k for k in range(len(entries))]
    found = [ranked(entry) for entry in entries]
    return Witness(positions, [ids for ids, _ in found], [values for _, values in found],
                   tuple(p for p in positions if p >= recomputed_from))


def row_witness(reply: Witness, row_ids: list[int], shared: int, copied: int) -> Witness:
    """A training row's witness from its reply's (:func:`reply_witness`): :data:`REPLY_POSITIONS` of
    the reply's positions the row shares (before ``shared``: the same ids up to there), chosen by
    :func:`chosen_positions`. The row's rows before ``copied`` are the reply's own (its region's);
    those after were computed again by the row's prefill (another forward): counted as probed."""
    eligible = [p for p in reply.positions if p < shared]
    return reply.picked(set(chosen_positions(row_ids, eligible, copied)), copied)


def chosen_positions(ids: list[int], eligible: list[int], seam: int) -> list[int]:
    """At most :data:`REPLY_POSITIONS` of ``eligible`` (ascending): the first and the last (the
    prompt's last position, the reply's last), the two at ``seam`` (the last row copied from the reply,
    the first computed again: a copy from the wrong place or one row off shows there), and the rest
    drawn from the row's own ids (the same on every run; over many rows every part of a reply)."""
    if len(eligible) <= REPLY_POSITIONS:
        return eligible
    always = {eligible[0], eligible[-1], *({seam - 1, seam} & set(eligible))}
    rest = [p for p in eligible if p not in always]
    drawn = random.Random(_seed(ids)).sample(rest, REPLY_POSITIONS - len(always))
    return sorted(always | set(drawn))


def probe_positions(ids: list[int], served: list[int] = (), hit_tokens: int = 1) -> list[int]:
    """The positions of a row of ``ids`` to probe, ascending, all before its last: one drawn from the
    row's own ids (the same on every run; over many rows every part of a row, the rows its prefix cache
    gave it among them, is looked at), and the last position of each row ``served`` from its first
    tokens (``served``: their lengths), which certifies them.

    ``hit_tokens``: the granularity of vLLM's prefix-cache hits (its block size; 1: unknown). The drawn
    position is then the start of one of the row's blocks: the probe of the first ``p + 1`` tokens finds
    the ``p`` before it cached and computes one token, where a position inside a block would compute
    the block's tokens up to it again (half a block on average: 32 tokens with vLLM 0.34's blocks of
    64). A row too short to hold such a start draws from all its positions, as without a block size."""
    inside = len(ids) - 1
    if inside < 1:
        return []
    starts = (inside - 1) // hit_tokens if hit_tokens > 1 else 0  # block starts k * hit_tokens, 0 < k * hit_tokens < inside
    drawn = hit_tokens * (_seed(ids) % starts + 1) if starts else _seed(ids) % inside
    return sorted({drawn, *(length - 1 for length in served if 0 < length <= inside)})


def _seed(ids: list[int]) -> int:
    """A number drawn from a row's ids: the same on every run and host (its positions chosen alike)."""
    import array

    return zlib.crc32(bytes(memoryview(array.array("i", ids))))
