"""A checkpoint holding only what a certificate reads (``config.json``, the final norm, the LM head),
and an engine stand-in that computes log-probabilities the way vLLM's bfloat16 path rounds them
(support module for the certificate's tests)."""
from __future__ import annotations

import json
from pathlib import Path

HIDDEN, VOCAB = 64, 512
LAYERS = [0, 1, 3]  # the extractor's ids of a run's written layers; 3 is the last of 4 decoder layers
ROWS = 6  # a run's rows (:func:`write_run`)
BACKEND_LAYERS = 3  # a row's layers in CertifyingBackend: its last is the one certified


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
    prefix_hit_tokens = 1

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
            layers = states(BACKEND_LAYERS, len(ids), seed=ids[0])
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


def witness(head, last, length):
    """The engine's witness at a row's first, middle and last positions, from its last-layer state ``last``."""
    import torch

    from hidden_states.certify.witness import Witness

    positions = sorted({0, length // 2, length - 1})
    ids, logprobs = engine_logprobs(head, last, torch.tensor(positions))
    return Witness(positions, ids.tolist(), logprobs.tolist())


def row_ids(index: int) -> list[int]:
    """Row ``index``'s token ids: its own first id, so that no row begins another."""
    length = 20 + 7 * index
    return [index + 1] + list(range(5, 4 + length))


def row_states(index: int, layers: int = len(LAYERS)) -> list:
    """Row ``index``'s states, one ``[T, HIDDEN]`` per written layer, as the engine computed them."""
    return states(layers, len(row_ids(index)), seed=100 + index)


def write_run(tmp_path, name, state_dtype="model", certified=range(ROWS), layer_ids=LAYERS):
    """An extraction's output directory of :data:`ROWS` rows in format ``name``, written by the real
    format; the rows of ``certified`` with their certificates (the run's certifier), the others without."""
    import json

    from hidden_states.certify.certifier import Certifier
    from hidden_states.certify.head import FinalHead
    from hidden_states.inputs.streams import Sample
    from hidden_states.output import formats

    model = head_checkpoint(tmp_path / "model", num_hidden_layers=4)
    head = FinalHead.load(model)
    out = tmp_path / "out"
    out.mkdir()
    layout = formats.create(name, out, formats.Layers(layer_ids, 4, HIDDEN), log=lambda line: None,
                            state_dtype=state_dtype)
    certifier = Certifier(head, layer_ids.index(3), fp8=state_dtype == "fp8")
    for index in range(ROWS):
        layers, ids = row_states(index, len(layer_ids)), row_ids(index)
        sample = Sample(index, index + 1, ids, None)
        extra = certifier.certify(sample, layers, witness(head, layers[-1], len(ids))).tensors() \
            if index in certified else None
        (out / layout.sample_file(index)).parent.mkdir(exist_ok=True)
        with open(out / layout.sample_file(index), "wb") as handle:
            layout.save(layout.record(sample, layers, extra), handle)
    ids = layer_ids if name == "speculators-0.3" else [layer + 1 for layer in layer_ids]
    (out / "data_config.json").write_text(json.dumps({"format": {"name": name}, "layer_ids": ids,
                                                      "model": str(model)}))
    return out


class FakeEngine:
    """Answers ``vllm.LLM.generate`` (``max_tokens=1``, ``logprobs=TOP``) as the engine would for the rows
    of :func:`write_run`: from their states as computed, not as written (a row changed after it was
    written disagrees). ``prompts``: each call's token ids, in order."""

    def __init__(self, head, rows=range(ROWS)):
        self.head = head
        self.rows = {tuple(row_ids(index)): row_states(index)[-1] for index in rows}
        self.prompts: list[list[list[int]]] = []
        self.closed = False

    def generate(self, prompts, params, use_tqdm=True):
        import torch
        from types import SimpleNamespace

        assert params.max_tokens == 1 and params.temperature == 0 and params.logprobs >= 1
        asked = [list(prompt["prompt_token_ids"]) for prompt in prompts]
        self.prompts.append(asked)
        answers = []
        for ids in asked:
            state = next(state for row, state in self.rows.items() if list(row[:len(ids)]) == ids)
            top, values = engine_logprobs(self.head, state, torch.tensor([len(ids) - 1]), top=params.logprobs + 1)
            entry = {int(i): SimpleNamespace(logprob=float(v)) for i, v in zip(top[0], values[0])}
            answers.append(SimpleNamespace(prompt_token_ids=ids, outputs=[SimpleNamespace(logprobs=[entry])]))
        return answers
