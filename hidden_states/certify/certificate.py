"""A row's certificate: the engine's own log-probabilities at a few of the row's positions, and what the
row's written last-layer state gives there through the final norm and LM head (:mod:`.head`).

Two paths that share nothing past the model's weights: vLLM's logits for the request (its sampler's
logprobs, mapped to the request by vLLM itself) and ours from the state the row holds, read back as
the trainer reads it. A capture that wrote another position's, another request's or another layer's
state, or a state cut short, makes them disagree by far more than rounding can (:func:`bound`).

A certificate also holds a *sketch* of every written layer at its positions (each state projected on
one fixed random sign vector): the last layer is certified by the model, the others are bound to it,
so a layer taken from another row, or states moved after writing, fail ``verify`` too.

Stored in the row under ``certificate.*`` names (:func:`Certificate.tensors`), which no trainer reads.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

SIGMAS = 6.0  # rounding noise is a sum of many independent roundings: Gaussian; 6 sigma: ~1e-9 false alarms
SKETCH_SEED = 271828
SKETCH_TOLERANCE = 1e-9  # relative to sum |state|: float64 sums of the same values in another order
PREFIX = "certificate."
NAMES = ("positions", "token_ids", "logprobs", "error", "sketch", "slack")
# A probed position's logprobs come from a second forward of the row's first tokens, in a batch of
# another shape: in bfloat16 two forwards of one prefix differ by more than one state's rounding
# (another order of every sum, in every layer; in an MoE a router's near tie may pick another expert).
# Measured on an H100 (vLLM 0.34.0): up to 1.28x the bound on the 8B shape, 7x on the Kimi-K2-shaped
# INT4 MoE; planted capture bugs seen at probes 55x to 96x. A probe fails past this many bounds; the
# row's last position, from the request's own forward, past one.
PROBE_SLACK = 16.0
# half a unit in the last place, relative: the largest relative rounding error of one value of a dtype
HALF_ULP = {"float32": 2.0 ** -24, "bfloat16": 2.0 ** -8, "float16": 2.0 ** -11, "float8_e4m3fn": 2.0 ** -4}
FP8_SUBNORMAL = 2.0 ** -10  # half e4m3fn's smallest subnormal: a value's absolute rounding, times its scale


@dataclass
class Certificate:
    """What a row carries to prove itself.

    Attributes:
        positions: ``[p]`` long, the row positions certified (the state at ``i`` predicts token ``i + 1``).
        token_ids: ``[p, k]`` long, the ids whose log-probabilities the engine gave at each position
            (``-1``: none in that place).
        logprobs: ``[p, k]`` float32, the engine's log-probabilities of ``token_ids``.
        error: ``[p]`` float32, ``|ours - engine|`` at each position (the largest over its ids), as
            measured when the row was written.
        sketch: ``[p, layers]`` float64, each written layer's state at each position, projected
            (:func:`sketch`).
        slack: ``[p]`` float32, how many bounds the position may differ by: 1 where the engine's
            logprobs come from the row's own forward, :data:`PROBE_SLACK` where from a probe's.
    """

    positions: torch.Tensor
    token_ids: torch.Tensor
    logprobs: torch.Tensor
    error: torch.Tensor
    sketch: torch.Tensor
    slack: torch.Tensor

    def tensors(self) -> dict:
        """The certificate as a row's extra tensors (contiguous, on the CPU)."""
        return {PREFIX + name: getattr(self, name).detach().cpu().contiguous() for name in NAMES}

    @classmethod
    def from_tensors(cls, tensors: dict) -> Certificate | None:
        """The certificate a row's tensors hold; None when it holds none."""
        if PREFIX + NAMES[0] not in tensors:
            return None
        import torch

        held = {name: tensors[PREFIX + name] for name in NAMES if PREFIX + name in tensors}
        held.setdefault("slack", torch.ones(len(held["positions"])))  # a certificate of the row's own forward only
        return cls(**held)


@dataclass(frozen=True)
class Agreement:
    """How the written last-layer state agrees with the engine at the certified positions.

    Attributes:
        error: ``[p]``, the largest ``|ours - engine|`` over each position's ids.
        bound: ``[p]``, the largest difference rounding explains there (:func:`bound`).
    """

    error: torch.Tensor
    bound: torch.Tensor

    @property
    def failing(self) -> list[int]:
        """Indexes (into the certificate's positions) where the error is past the bound."""
        return [i for i, bad in enumerate((self.error > self.bound).tolist()) if bad]

    @property
    def worst(self) -> float:
        """The largest error as a fraction of its bound (1 and above: failing)."""
        if self.error.numel() == 0:
            return 0.0
        return float((self.error / self.bound).max())


def sketch_vector(hidden: int, device="cpu") -> torch.Tensor:
    """The fixed random sign vector the sketch projects on (float64, the same on every host)."""
    import torch

    generator = torch.Generator().manual_seed(SKETCH_SEED)
    return (torch.randint(0, 2, (hidden,), generator=generator).double() * 2 - 1).to(device)


def sketch(rows: list) -> torch.Tensor:
    """``[p, layers]``: each layer's written (dequantized) states at the certified positions, ``[p,
    hidden]`` each, projected on :func:`sketch_vector`, in float64."""
    import torch

    if not rows:
        return torch.zeros(0, 0, dtype=torch.float64)
    vector = sketch_vector(rows[0].shape[-1], rows[0].device)
    return torch.stack([layer.double() @ vector for layer in rows], dim=1).cpu()


def sketch_mismatch(rows: list, certificate: Certificate) -> list[int]:
    """Indexes of the layers whose written states (``rows``: at the certificate's positions) no longer
    match its sketch."""
    import torch

    now = sketch(rows)
    if now.shape != certificate.sketch.shape:
        return list(range(max(now.shape[1], certificate.sketch.shape[1])))
    scale = torch.stack([layer.double().abs().sum(dim=-1).cpu() for layer in rows], dim=1)
    off = (now - certificate.sketch).abs() > SKETCH_TOLERANCE * scale + 1e-30
    return [i for i, bad in enumerate(off.any(dim=0).tolist()) if bad]


def roundings(dtype, scales=None) -> tuple[float, float, object]:
    """``(state_unit, engine_unit, state_floor)`` for a row's written states of ``dtype``, read back
    with FP8 ``scales`` (those at the certified positions; None: not FP8)."""
    if scales is not None:  # FP8's rounding, and where its values go subnormal an absolute floor
        # FP8 rows do not say the engine's dtype: the coarsest it runs
        return HALF_ULP["float8_e4m3fn"], HALF_ULP["bfloat16"], scales.reshape(-1).float().cpu() * FP8_SUBNORMAL
    # the engine's own states, in its dtype (an unknown one counted as the coarsest)
    unit = HALF_ULP.get(str(dtype).removeprefix("torch."), HALF_ULP["bfloat16"])
    return unit, unit, 0.0


def bound(head, state: torch.Tensor, logits: torch.Tensor, token_ids: torch.Tensor, *, state_unit: torch.Tensor,
          engine_unit: torch.Tensor, state_floor: torch.Tensor) -> torch.Tensor:
    """``[p, k]``: the largest ``|ours - engine|`` rounding explains for each id, ``state`` ``[p, H]``
    being the written last-layer states at the certified positions (float32) and ``logits`` ours from
    them; ``token_ids`` ``[p, k]``, none negative; the units and floor ``[p, 1]``; all on the head's
    device (:func:`agreement` puts them there).

    The engine's log-probability of id ``j`` is ``z_j - logsumexp(z)``; both sides compute ``z`` from
    the same weights and differ only by roundings (``u``: half an ulp, relative):

    * the state: the written one is the engine's rounded to its stored dtype (``state_unit``, and for
      FP8 an absolute ``state_floor`` per position where its values go subnormal: ``scale * 2**-10``),
      and the engine rounds its normed state to its own dtype (``engine_unit``). Each element's
      rounding is independent and uniform (std ``e/sqrt(3)`` for a bound ``e``), so ``delta z_j`` is
      Gaussian with ``var_j = sum_i w_ji^2 e_i^2 / 3``, ``e_i`` the element's bound after the norm;
      :data:`SIGMAS` of it, for ``j`` and for the softmax's mean over ``z``;
    * the logits: the engine computes them in its dtype (vLLM's LM head runs in the model's dtype,
      its sampler turns the result to float32): each ``z_k`` is off by at most ``u_engine |z_k|``, so
      ``|delta| <= u_engine (|z_j| + sum_k p_k |z_k|)``, said exactly.

    On bfloat16 the logits term leads for a real model (``|z|`` of 10-30: a few hundredths). The bound
    is computed per id from the row's own values: no constant is fitted to a model.
    """
    import torch

    rms = torch.rsqrt(state.pow(2).mean(dim=-1, keepdim=True) + head.eps)
    stored = torch.maximum(state_unit * state.abs(), state_floor) * head.norm * rms  # the stored rounding, after the norm
    computed = engine_unit * (state * rms * head.norm).abs()  # the engine's rounding of its normed state
    variance = (stored.pow(2) + computed.pow(2)) @ head.squared.T / 3.0  # [p, V]
    probabilities = torch.softmax(logits, dim=-1)
    spread = variance.gather(1, token_ids).sqrt() + (probabilities * variance).sum(dim=-1, keepdim=True).sqrt()
    magnitude = (probabilities * logits.abs()).sum(dim=-1, keepdim=True)
    logits_term = engine_unit * (logits.abs().gather(1, token_ids) + magnitude)
    ours_term = 8 * HALF_ULP["float32"] * (logits.abs().max(dim=-1, keepdim=True).values + 1)  # our float32 itself
    return SIGMAS * spread + logits_term + ours_term


def agreement(head, last_rows: torch.Tensor, token_ids: torch.Tensor, logprobs: torch.Tensor, *,
              state_unit: float, engine_unit: float, state_floor=0.0, slack=None) -> Agreement:
    """The written last-layer states at the certified positions (``last_rows`` ``[p, H]``) against the
    engine's ``logprobs`` of ``token_ids`` ``[p, k]`` there, each position allowed ``slack`` ``[p]``
    bounds (None: one). Units, floor and slack: one number, or one per position.

    Everything the head's device needs goes there in one copy, and the result comes back in one: on a
    GPU that vLLM's engine (another process) keeps busy, a copy from this process waits for this
    process's turn on the GPU, so a copy per tensor waited for a turn each, and each turn is time the
    engine's step loses."""
    import torch

    count, width = token_ids.shape
    if count == 0 or width == 0:
        return Agreement(torch.zeros(count), torch.ones(count))
    hidden = last_rows.shape[-1]

    def column(value) -> torch.Tensor:
        return torch.as_tensor(value, dtype=torch.float32).cpu().reshape(-1, 1).expand(count, 1)

    # float32 holds every token id exactly (up to 2**24), the -1 of an empty place too
    packed = torch.cat([last_rows.float().cpu(), token_ids.float().cpu(), logprobs.float().cpu(),
                        *(column(v) for v in (state_unit, engine_unit, state_floor, 1.0 if slack is None else slack))],
                       dim=1).to(head.weight.device)
    state, ids, engine, units = packed.split([hidden, width, width, 4], dim=1)
    ids = ids.long()
    chosen = ids.clamp(min=0)  # an empty place (-1) reads id 0, and counts for nothing below
    logits = head.logits(state)
    mine = torch.log_softmax(logits, dim=-1).gather(1, chosen)
    limit = bound(head, state, logits, chosen, state_unit=units[:, 0:1], engine_unit=units[:, 1:2],
                  state_floor=units[:, 2:3]) * units[:, 3:4]
    off = (mine - engine).abs() * (ids >= 0)
    at = (off / limit).argmax(dim=-1, keepdim=True)  # each position's id furthest past (or nearest) its bound
    error, limit = torch.stack([off.gather(1, at).squeeze(1), limit.gather(1, at).squeeze(1)]).cpu()
    return Agreement(error, limit)
