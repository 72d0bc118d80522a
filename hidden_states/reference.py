"""The yardstick for extracted states: HF transformers' decoder-layer outputs on the same ids.

speculators 0.3/0.4 capture, for layer id ``L``, the *output* of decoder layer ``L`` before the
final norm (``hidden_states + residual``). HF's ``output_hidden_states[L + 1]`` is the same thing for
every layer but the last, where HF applies the final norm; so the reference is taken with forward
hooks on the decoder layers themselves, which is right for every layer, the last included.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


def load_model(model_dir: str | Path, dtype: str = "float32", device: str = "cpu"):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    return model.to(device).eval()


def _decoder_layers(model):
    for path in ("model.layers", "model.language_model.layers", "language_model.model.layers"):
        obj = model
        try:
            for part in path.split("."):
                obj = getattr(obj, part)
        except AttributeError:
            continue
        return obj
    raise AttributeError(f"cannot find the decoder layers of {type(model).__name__}")


def decoder_layer_outputs(model, sequences, layer_ids) -> list[list]:
    """For each sequence, the outputs of the decoder layers ``layer_ids`` as ``[tokens, hidden]``.

    Args:
        model: an HF causal LM (see :func:`load_model`).
        sequences: token id lists, run one at a time (no padding to get wrong).
        layer_ids: decoder layer indices, speculators' convention (output of layer L).

    Returns:
        ``out[i][j]``: float32 CPU tensor of sequence ``i`` at layer ``layer_ids[j]``.
    """
    import torch

    layers = _decoder_layers(model)
    captured: dict[int, torch.Tensor] = {}
    hooks = []
    for layer_id in layer_ids:
        def hook(_module, _inputs, output, layer_id=layer_id):
            captured[layer_id] = (output[0] if isinstance(output, tuple) else output)[0]

        hooks.append(layers[layer_id].register_forward_hook(hook))
    device = next(model.parameters()).device
    outputs = []
    try:
        with torch.no_grad():
            for ids in sequences:
                captured.clear()
                model(torch.tensor([list(ids)], device=device))
                outputs.append([captured[layer_id].float().cpu() for layer_id in layer_ids])
    finally:
        for handle in hooks:
            handle.remove()
    return outputs


@dataclass(frozen=True)
class Agreement:
    """How far extracted states are from the reference, per layer: max over tokens of the
    relative L2 error ``|got - ref| / |ref|`` of each token's hidden vector."""

    layer_ids: tuple[int, ...]
    max_relative_error: tuple[float, ...]
    tokens: int

    @property
    def worst(self) -> float:
        return max(self.max_relative_error, default=0.0)


def relative_errors(got, ref):
    """Per-token relative L2 error of ``got`` against ``ref`` (both ``[tokens, hidden]``)."""
    got, ref = got.float(), ref.float()
    if got.shape != ref.shape:
        raise ValueError(f"shape {tuple(got.shape)} differs from the reference's {tuple(ref.shape)}")
    return (got - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-12)


def agreement(got_per_sequence, ref_per_sequence, layer_ids) -> Agreement:
    """Compare extracted states with the reference for many sequences at once."""
    worst = [0.0] * len(layer_ids)
    tokens = 0
    for got_layers, ref_layers in zip(got_per_sequence, ref_per_sequence, strict=True):
        if len(got_layers) != len(ref_layers):
            raise ValueError(f"{len(got_layers)} layers extracted, {len(ref_layers)} expected")
        for j, (got, ref) in enumerate(zip(got_layers, ref_layers)):
            worst[j] = max(worst[j], float(relative_errors(got, ref).max()))
        tokens += ref_layers[0].shape[0]
    return Agreement(tuple(layer_ids), tuple(worst), tokens)
