"""Multi-turn conversations for ``hidden-states generate``'s unit tests, a backend whose every reply is
``--max-new-tokens`` long, and a generation run around it (support module: tests import it, never
each other)."""
from __future__ import annotations

import json
from concurrent.futures import Future
from pathlib import Path

from hidden_states.backends import Reply, Sampling
from tests.unit.fakes import FakeGenerating

WORDS = "what is the capital of France then check the answer again why is the sea blue".split()


def conversations(count: int = 15) -> list[dict]:
    """``count`` conversations: every third one a single turn, the others two to four user turns (each
    with the reply the input had, which generate answers again), words of the tiny tokenizer."""
    made = []
    for number in range(count):
        turns = 1 if number % 3 == 0 else 2 + number % 3
        messages = [{"role": "system", "content": "be brief"}] if number % 5 == 0 else []
        for turn in range(turns):
            words = [WORDS[(number + turn + k) % len(WORDS)] for k in range(3 + (number * 7 + turn) % 9)]
            messages += [{"role": "user", "content": " ".join(words)}, {"role": "assistant", "content": "old"}]
        made.append({"messages": messages})
    return made


def write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


class LongReplies(FakeGenerating):
    """Every reply ``--max-new-tokens`` long (words, then <|eot_id|>): a later turn's prompt as long as
    the earlier replies can make it."""

    def answer(self, ids, sampling, stream=None, certified=False):
        eot = self.tokenizer.convert_tokens_to_ids("<|eot_id|>")
        words = self.tokenizer(" ".join(["sea"] * sampling.max_new_tokens), add_special_tokens=False)["input_ids"]
        generated = words[:sampling.max_new_tokens - 1] + [eot]
        self.asked += 1
        future = Future()
        future.set_result(Reply(ids, generated, self.tokenizer.decode(generated[:-1]), "stop", self.asked, 0,
                                len(ids) + len(generated) - 1, f"salt-{self.asked}"))
        return future


def fake_backends(monkeypatch, chat_model, backend=LongReplies) -> list:
    """``backend`` made for every run (returned as they are made), vLLM's checks not run."""
    from hidden_states import backends
    from hidden_states.inputs.tokenization import load_tokenizer
    from hidden_states.plan import planner

    tokenizer = load_tokenizer(str(chat_model))
    made = []

    def create(name, settings):
        made.append(backend(settings, tokenizer))
        return made[-1]

    monkeypatch.setattr(backends, "create", create)
    monkeypatch.setattr(planner, "check_vllm", lambda *args: "not run (a fake backend)")
    monkeypatch.setattr(planner, "check_environment", lambda: [])
    return made


def run_generation(model, data, out, max_seq_len: int, max_new_tokens: int):
    """A generation (speculators-0.3) with the fake backend; returns it and its log's lines."""
    from hidden_states.generate.command import Generation
    from hidden_states.settings import Settings

    settings = Settings(model_path=str(model), prepared_data=str(data), output_dir=str(out), backend="vllm-engine",
                        format="speculators-0.3", max_seq_len=max_seq_len, forward_check=False, batch_size=4,
                        layer_ids=[0, 2])
    lines = []
    generation = Generation(settings, Sampling(max_new_tokens=max_new_tokens), log=lines.append)
    generation.run()
    return generation, lines
