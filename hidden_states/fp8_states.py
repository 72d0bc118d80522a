"""FP8 hidden states as speculators 0.9's hs-connectors store them (``--state-dtype fp8``).

The layout (``hs_connectors/fp8_hidden_states_connector.py`` in 0.9.0) is one ``float8_e4m3fn``
value per state and one float32 scale per token, shared by all of that token's layers:

* ``hidden_states``: float8_e4m3fn ``[T, n_layers, hidden]``;
* ``hidden_states_scales``: float32 ``[T, 1, 1]``, ``scale = max |state| over the token's layers
  / 448`` (e4m3fn's largest finite value), at least 1e-12;
* state ``= float(fp8) * scale``, which 0.9's ``FP8Transfer`` (``--hidden-states-backend fp8``)
  computes before its dataset and collate see the sample.

The quantizing here runs on whatever device the states are on (a GPU's: before the copy to the host,
so half the bytes cross it), one layer at a time: the token's scale needs every layer's maximum, and
no ``[T, n_layers, hidden]`` float32 copy is ever made.
"""
from __future__ import annotations

SCALES = "hidden_states_scales"
STATE_DTYPES = ("model", "fp8")  # --state-dtype: the model's own dtype (as computed), or FP8 with scales
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
SMALLEST_SCALE = 1e-12  # an all-zero token's scale (0.9's clamp): its states stay 0 and divide safely


class Quantized(list):
    """One sequence's FP8 states, one ``[T, hidden]`` per layer, with their per-token ``scales``
    ``[T, 1, 1]``: what a backend that quantizes where the states are computed hands over (the
    format writes them as they are)."""

    def __init__(self, layers, scales):
        super().__init__(layers)
        self.scales = scales


def pick(layers: list, order: list[int]) -> list:
    """``layers[k]`` for each ``k`` of ``order``, a :class:`Quantized` sequence's scales kept (a
    token's scale covers every layer captured, so it covers any of them)."""
    picked = [layers[k] for k in order]
    return Quantized(picked, layers.scales) if isinstance(layers, Quantized) else picked


def first_rows(layers: list, count: int) -> list:
    """The first ``count`` tokens of each layer (views), a :class:`Quantized` sequence's scales cut to
    match (a token's scale is its own: a prefix's are the prefix's)."""
    heads = [layer[:count] for layer in layers]
    return Quantized(heads, layers.scales[:count]) if isinstance(layers, Quantized) else heads


def fp8_dtype():
    import torch

    dtype = getattr(torch, "float8_e4m3fn", None)
    if dtype is None:
        raise RuntimeError("this torch has no float8_e4m3fn: --state-dtype fp8 needs torch >= 2.1")
    return dtype


def token_scales(layers: list):
    """float32 ``[T, 1, 1]``: each token's largest magnitude over all ``layers`` (each ``[T, hidden]``)
    / 448, on the layers' device."""
    import torch

    amax = torch.stack([layer.abs().amax(dim=-1).float() for layer in layers]).amax(dim=0)
    return (amax / FP8_MAX).clamp(min=SMALLEST_SCALE).view(-1, 1, 1)


def quantize(layers: list) -> tuple[list, object]:
    """``layers`` (each ``[T, hidden]``, any float dtype and device) as FP8 ``[T, hidden]`` each and
    their per-token scales ``[T, 1, 1]``, on the same device (already quantized: as they are)."""
    if isinstance(layers, Quantized):
        return list(layers), layers.scales
    scales = token_scales(layers)
    per_row = scales.view(-1, 1)
    dtype = fp8_dtype()
    return [(layer.float() / per_row).to(dtype) for layer in layers], scales


def dequantize(states, scales, dtype=None):
    """FP8 ``states`` ``[T, n_layers, hidden]`` with their ``[T, 1, 1]`` scales, as ``dtype``
    (float32 when None), the values the trainer sees."""
    import torch

    dtype = dtype or torch.float32
    return states.to(dtype) * scales.to(dtype)
