"""A checkpoint holding only what a certificate reads (``config.json``, the final norm, the LM head),
and an engine stand-in that computes log-probabilities the way vLLM's bfloat16 path rounds them
(support module for the certificate's tests)."""
from __future__ import annotations

import json
from pathlib import Path

HIDDEN, VOCAB = 64, 512
LAYERS = 3  # a row's layers in CertifyingBackend: its last is the one certified


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


class CertifyingBackend:
    """An engine backend's certified surface: each row's states (seeded by its first id) and the
    engine's witness at its probes and last position, computed from ``engine_states`` (the row's own
    states unless a test swaps in another's). ``hold``: the witnesses wait for :meth:`run_probes`, as
    a batch's wait for its probes to run behind the batches queued before them."""

    tokens_per_submit = None
    tokens_ahead = 0
    cached_tokens = 0

    def __init__(self, head, engine_states=None, hold: bool = False):
        self.head, self.engine_states, self.hold = head, engine_states or (lambda ids, layers: layers[-1]), hold
        self.submitted: list[list[int]] = []
        self._held: list[tuple] = []

    def engine_alive(self) -> bool:
        return True

    def submit_certified(self, rows, probes):
        from concurrent.futures import Future

        from hidden_states.certify.witness import Witness

        found = []
        for ids, inside in zip(rows, probes, strict=True):
            self.submitted.append(list(inside))
            layers = states(LAYERS, len(ids), seed=ids[0])
            positions = sorted({*inside, len(ids) - 1})
            top, logprobs = engine_logprobs(self.head, self.engine_states(ids, layers), positions)
            witness = Witness(positions, top.tolist(), logprobs.tolist(), tuple(p for p in inside if p != len(ids) - 1))
            found.append((layers, Future()))
            self._held.append((found[-1][1], witness))
        if not self.hold:
            self.run_probes()
        return resolved(found)

    def run_probes(self) -> None:
        """Every witness held so far resolves."""
        held, self._held = self._held, []
        for future, witness in held:
            future.set_result(witness)


def resolved(value):
    """A future already holding ``value``."""
    from concurrent.futures import Future

    future = Future()
    future.set_result(value)
    return future
