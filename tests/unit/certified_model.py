"""A checkpoint holding only what a certificate reads (``config.json``, the final norm, the LM head),
and an engine stand-in that computes log-probabilities the way vLLM's bfloat16 path rounds them
(support module for the certificate's tests)."""
from __future__ import annotations

import json
from pathlib import Path

HIDDEN, VOCAB = 64, 512


def head_checkpoint(path: Path, *, seed: int = 0, tied: bool = False, **config) -> Path:
    """A checkpoint directory whose logits spread as a trained model's do (std ~3)."""
    import torch
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    path.mkdir(parents=True, exist_ok=True)
    weight = torch.randn(VOCAB, HIDDEN, generator=generator) * (3.0 / HIDDEN ** 0.5)
    tensors = {"model.norm.weight": 1 + 0.1 * torch.randn(HIDDEN, generator=generator),
               "model.embed_tokens.weight" if tied else "lm_head.weight": weight.to(torch.bfloat16)}
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "rms_norm_eps": 1e-5, "hidden_size": HIDDEN,
                                                  "vocab_size": VOCAB, "tie_word_embeddings": tied, **config}))
    return path


def states(rows: int, length: int, seed: int = 1):
    """``rows`` last-layer states ``[length, HIDDEN]`` as the engine holds them (bfloat16)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(length, HIDDEN, generator=generator) * 4).to(torch.bfloat16) for _ in range(rows)]


def engine_logprobs(head, state, positions, top: int = 4):
    """The engine's top ``top`` ids and log-probabilities at ``positions``, rounded as vLLM's bfloat16
    path rounds: the normed state to bfloat16, the logits (float32 accumulation) to bfloat16, then
    float32 for the log-softmax."""
    import torch

    normed = head.normed(state[positions].float()).to(torch.bfloat16).float()
    logits = (normed @ head.weight.T).to(torch.bfloat16).float()
    logprobs = torch.log_softmax(logits, dim=-1)
    values, ids = logprobs.topk(top, dim=-1)
    return ids, values
