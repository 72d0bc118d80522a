"""The model's last step, from its last decoder layer's output to log-probabilities: the final norm and
the LM head, read from the checkpoint alone (two tensors and ``config.json``; no model is built, no vLLM).

A certificate is checked against this, so it is written here from the families' definitions, not taken
from vLLM: the engine's logprobs come from vLLM's path, ours from this one, and a capture that wrote
the wrong state makes the two disagree. A family whose last step is not a plain RMS norm and a linear
head (a soft cap on the logits, a scale, an offset norm) is refused by name (:class:`Uncertifiable`):
a certificate computed with the wrong last step would fail every row, or pass a wrong one.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING
from pathlib import Path

if TYPE_CHECKING:
    import torch

# model_type -> how its final norm is written: "rms" = x / sqrt(mean(x^2) + eps) * weight
FINAL_NORMS = {
    "llama": "rms", "mistral": "rms", "qwen2": "rms", "qwen3": "rms", "qwen3_moe": "rms", "qwen2_moe": "rms",
    "deepseek_v2": "rms", "deepseek_v3": "rms", "kimi_k2": "rms",
}
# config entries that change the last step; a family setting one (not to its neutral value) is refused
LAST_STEP_CHANGES = {"final_logit_softcapping": None, "logit_scale": 1.0, "logits_scaling": 1.0}
NORM_WEIGHT = "model.norm.weight"
HEAD_WEIGHT = "lm_head.weight"
EMBEDDINGS = "model.embed_tokens.weight"  # the head of a model whose word embeddings are tied


class Uncertifiable(Exception):
    """This checkpoint's last step is not one this module can compute; the message says why."""


@dataclass(frozen=True)
class FinalHead:
    """The final norm and the LM head of one checkpoint, in float32 on ``weight``'s device.

    Attributes:
        norm: the final norm's weight, ``[hidden]``.
        eps: the norm's epsilon.
        weight: the LM head, ``[vocab, hidden]``.
    """

    norm: torch.Tensor
    eps: float
    weight: torch.Tensor

    @classmethod
    def load(cls, model_path: str | Path, device: str = "cpu") -> FinalHead:
        """Read the two tensors from ``model_path``'s safetensors files (found through their index
        when there is one); raises :class:`Uncertifiable` for a family or file it cannot read."""
        path = Path(model_path)
        config = model_config(path)
        model_type = config.get("model_type")
        if FINAL_NORMS.get(model_type) != "rms":
            raise Uncertifiable(f"{path}: model_type {model_type!r}: its final norm is not one the certificate "
                                f"knows (known: {', '.join(sorted(FINAL_NORMS))})")
        changed = [key for key, neutral in LAST_STEP_CHANGES.items() if config.get(key, neutral) != neutral]
        if changed:
            raise Uncertifiable(f"{path}: config.json sets {', '.join(changed)}: the last step is not a plain "
                                f"norm and head")
        head_name = EMBEDDINGS if config.get("tie_word_embeddings") else HEAD_WEIGHT
        tensors = _read(path, [NORM_WEIGHT, head_name])
        eps = config.get("rms_norm_eps")
        if eps is None:
            raise Uncertifiable(f"{path}/config.json: no rms_norm_eps")
        return cls(tensors[NORM_WEIGHT].float().to(device), float(eps), tensors[head_name].float().to(device))

    @cached_property
    def squared(self) -> torch.Tensor:
        """The LM head squared, ``[vocab, hidden]``: every certificate's bound sums over it
        (:func:`.certificate.bound`), computed once."""
        return self.weight.pow(2)

    def normed(self, states: torch.Tensor) -> torch.Tensor:
        """``states`` ``[n, hidden]`` (the last decoder layer's output) through the final norm, float32."""
        import torch

        x = states.float().to(self.weight.device)
        return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps) * self.norm

    def logits(self, states: torch.Tensor) -> torch.Tensor:
        """``[n, vocab]`` float32 logits of ``states`` ``[n, hidden]``."""
        return self.normed(states) @ self.weight.T


def model_config(path: Path) -> dict:
    """The checkpoint's ``config.json`` (a multimodal one's text model's part)."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise Uncertifiable(f"{path}/config.json: unreadable ({exc})") from None
    return config.get("text_config", config) if "text_config" in config and "model_type" not in config else config


def _read(path: Path, names: list[str]) -> dict:
    """The tensors ``names`` from the checkpoint's safetensors files, each opened lazily."""
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        where = {name: path / weight_map[name] for name in names if name in weight_map}
    else:
        where = {}
        for file in sorted(path.glob("*.safetensors")):
            with safe_open(str(file), "pt") as handle:
                keys = set(handle.keys())
            where.update({name: file for name in names if name in keys and name not in where})
    missing = [name for name in names if name not in where]
    if missing:
        raise Uncertifiable(f"{path}: no {', '.join(missing)} in its safetensors files")
    found = {}
    for name, file in where.items():
        with safe_open(str(file), "pt") as handle:
            found[name] = handle.get_tensor(name)
    return found
