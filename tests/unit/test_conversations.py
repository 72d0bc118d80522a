"""Conversations as input: the containers and row kinds read, the chat-template masks of three
template families (judged by decoding what each mask trains), per-turn rows, truncation,
``token_freq.pt``, the ``prepare`` command and ``extract --data`` on conversations.

speculators' own preprocessing on the same data: tests/e2e/test_conversations.py (needs ``datasets``).
"""
import json
import shutil
from collections import Counter
from pathlib import Path

import pytest

from hidden_states.plan import planner
from hidden_states.cli import main
from hidden_states.inputs.conversations import Record
from hidden_states.errors import InputError
from hidden_states.inputs.streams import InputStream
from hidden_states.inputs.tokenization import ChatSettings, ChatTokenizer, token_frequencies
from tests.unit.fakes import fake_backends, rows_run

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

# A Qwen3 thinking conversation: a system turn, a reply with reasoning before the last query (the
# template drops its reasoning), a last reply with reasoning (shown), surrounding whitespace to trim.
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "<think>\nthe capital\n</think>\n\n Paris is the capital.\n"},
    {"role": "user", "content": "And the weather?"},
    {"role": "assistant", "content": "<think>\ncheck the weather\n</think>\n\nSunny and warm."},
]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    from transformers import AutoTokenizer

    from hidden_states.fixtures.chat_templates import FAMILIES, build_tokenizer

    root = tmp_path_factory.mktemp("chat-tokenizers")
    return {family: AutoTokenizer.from_pretrained(build_tokenizer(family, root / family)) for family in FAMILIES}


def test_a_chat_tokenizer_names_the_class_transformers_4_and_5_both_load(tmp_path):
    from hidden_states.fixtures.chat_templates import build_tokenizer

    path = build_tokenizer("qwen3", tmp_path / "qwen3")  # the matrix shares it across vLLM releases
    assert json.loads((path / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"


def trained(tokenizer, ids, mask) -> list[str]:
    """The trained stretches of a row, decoded."""
    spans, current = [], []
    for token, bit in [*zip(ids, mask), (None, 0)]:
        if bit:
            current.append(token)
        elif current:
            spans.append(tokenizer.decode(current))
            current = []
    return spans


def rows(tokenizer, layout, messages=CONVERSATION, max_seq_len=4096):
    chat = ChatTokenizer(tokenizer, layout, max_seq_len)
    return chat, chat.rows(Record("data.jsonl:1", 1, {"messages": messages}), "messages")


@pytest.mark.parametrize("family, method, expected", [
    # Llama-3 trims each content; no markers: the reply as placed, without <|eot_id|>
    ("llama3", "content spans", ["<think>\nthe capital\n</think>\n\n Paris is the capital.",
                                 "<think>\ncheck the weather\n</think>\n\nSunny and warm."]),
    # the markers wrap the reply and <|eot_id|>
    ("llama3_generation", "generation markers", ["<think>\nthe capital\n</think>\n\n Paris is the capital.<|eot_id|>",
                                                 "<think>\ncheck the weather\n</think>\n\nSunny and warm.<|eot_id|>"]),
    # Qwen3 rewrites the first reply (reasoning dropped: only the answer is in the render) and shows the
    # last one's reasoning, after the '<think>\n' the template writes for every shown block
    ("qwen3", "content spans", [" Paris is the capital.\n", "check the weather\n</think>\n\nSunny and warm."]),
    # DeepSeek-R1 drops every reply's reasoning, keeping what follows </think>
    ("deepseek_r1", "content spans", ["\n\n Paris is the capital.\n", "\n\nSunny and warm."]),
])
def test_one_row_per_conversation_trains_each_reply_as_the_template_renders_it(tokenizers, family, method, expected):
    chat, made = rows(tokenizers[family], "speculators-0.3")

    assert chat.method == method
    assert len(made) == 1
    assert trained(tokenizers[family], made[0].input_ids, made[0].loss_mask) == expected
    text = tokenizers[family].apply_chat_template(CONVERSATION, tokenize=False)
    assert made[0].input_ids == tokenizers[family](text, add_special_tokens=False)["input_ids"]


def test_one_row_per_turn_holds_the_history_as_the_model_saw_it_at_that_turn(tokenizers):
    tok = tokenizers["qwen3"]
    chat, made = rows(tok, "speculators-0.5")

    assert chat.method == "turn boundaries" and len(made) == 2
    first, second = (tok.decode(r.input_ids) for r in made)
    # turn 2 was the last reply when it was generated: its reasoning is in its row...
    assert "<think>\nthe capital\n</think>" in first
    # ...and dropped from the history of turn 4's row, as Qwen3's template renders it there
    assert "the capital\n</think>" not in second
    assert "<|im_start|>assistant\n Paris is the capital.\n<|im_end|>" in second
    assert [trained(tok, r.input_ids, r.loss_mask) for r in made] == [
        ["<think>\nthe capital\n</think>\n\n Paris is the capital.\n<|im_end|>\n"],
        ["<think>\ncheck the weather\n</think>\n\nSunny and warm.<|im_end|>\n"]]


def test_a_generation_prompt_the_reply_does_not_continue_falls_back_to_the_common_start(tokenizers):
    """DeepSeek-R1's generation prompt pre-fills '<think>\\n', which the recorded reply (reasoning
    stripped) does not continue: the boundary is where the two renders part."""
    tok = tokenizers["deepseek_r1"]
    prompt = tok.apply_chat_template(CONVERSATION[:2], tokenize=False, add_generation_prompt=True)
    full = tok.apply_chat_template(CONVERSATION[:3], tokenize=False)
    assert not full.startswith(prompt)  # the case this test is about

    _, made = rows(tok, "speculators-0.5")

    assert [trained(tok, r.input_ids, r.loss_mask) for r in made] == [
        ["\n\n Paris is the capital.\n<｜end▁of▁sentence｜>"], ["\n\nSunny and warm.<｜end▁of▁sentence｜>"]]


def test_truncation_keeps_the_first_tokens_and_is_counted_or_refused_with_strict(tokenizers):
    tok = tokenizers["llama3"]
    _, whole = rows(tok, "speculators-0.3")
    chat, cut = rows(tok, "speculators-0.3", max_seq_len=40)

    assert cut[0].input_ids == whole[0].input_ids[:40] and cut[0].loss_mask == whole[0].loss_mask[:40]
    assert chat.counts.truncated == 1
    assert "1 truncated to --max-seq-len 40 (the first 40 tokens kept)" in chat.summary()
    strict = ChatTokenizer(tok, "speculators-0.3", 40, strict=True)
    with pytest.raises(InputError, match=r"data.jsonl:1: \d+ tokens with the chat template, more than --max-seq-len"):
        strict.rows(Record("data.jsonl:1", 1, {"messages": CONVERSATION}), "messages")


def test_a_turn_whose_prompt_fills_the_window_is_skipped_per_turn(tokenizers):
    tok = tokenizers["qwen3"]
    _, whole = rows(tok, "speculators-0.5")
    limit = len(whole[0].input_ids) + 1  # the first turn fits, the second turn's prompt does not
    second_prompt = tok.apply_chat_template(CONVERSATION[:4], tokenize=False, add_generation_prompt=True)
    assert len(tok(second_prompt, add_special_tokens=False)["input_ids"]) >= limit

    chat, made = rows(tok, "speculators-0.5", max_seq_len=limit)

    assert [r.input_ids for r in made] == [whole[0].input_ids]
    assert chat.counts.skipped == Counter({"a turn whose prompt alone fills --max-seq-len": 1})


def write(path: Path, rows_) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows_))
    return path


SHAREGPT = {"conversations": [{"from": "human", "value": "What is the capital of France?"},
                              {"from": "gpt", "value": "Paris."}]}
MESSAGES = {"messages": [{"role": "user", "content": "What is the capital of France?"},
                         {"role": "assistant", "content": "Paris."}]}


def stream_rows(path, model, layout="speculators-0.3"):
    return [(s.input_ids, s.loss_mask) for s in InputStream(path, chat=ChatSettings(str(model), layout, 4096))]


def test_sharegpt_messages_and_a_json_array_read_alike(chat_model, tmp_path):
    sharegpt = stream_rows(write(tmp_path / "a.jsonl", [SHAREGPT] * 2), chat_model)
    messages = stream_rows(write(tmp_path / "b.jsonl", [MESSAGES] * 2), chat_model)
    array = tmp_path / "c.json"
    array.write_text(json.dumps([MESSAGES, MESSAGES], indent=2))

    assert sharegpt == messages == stream_rows(array, chat_model)
    assert len(sharegpt) == 2 and sum(sharegpt[0][1]) > 0


def test_text_rows_train_every_token(chat_model, tmp_path):
    from transformers import AutoTokenizer

    [(ids, mask)] = stream_rows(write(tmp_path / "t.jsonl", [{"text": "the quick brown fox"}]), chat_model)

    assert ids == AutoTokenizer.from_pretrained(chat_model)("the quick brown fox")["input_ids"]
    assert mask == [1] * len(ids)


def test_tool_turns_are_kept_as_context(tokenizers):
    messages = [*CONVERSATION[:3], {"role": "tool", "content": "sunny, 25 C"}, CONVERSATION[4]]
    tok = tokenizers["qwen3"]

    _, [row] = rows(tok, "speculators-0.3", messages)

    text = tok.decode(row.input_ids)
    assert "<tool_response>\nsunny, 25 C\n</tool_response>" in text
    assert all("sunny, 25 C" not in span for span in trained(tok, row.input_ids, row.loss_mask))


@pytest.mark.parametrize("content, message", [
    ("hello\n", "not JSONL, a JSON array, Parquet or a saved dataset directory (it starts with b'hello\\n')"),
    (json.dumps(MESSAGES) + "\n" + json.dumps({"input_ids": [5, 6]}) + "\n",
     ":2: a tokenized row in a file whose first row is messages: tokenized rows and conversations do not mix"),
    (json.dumps({"messages": [{"role": 7, "content": "hi"}]}) + "\n",
     ":1: turn 0: role 7 is none of system, human, user, gpt, assistant, tool, function, ipython"),
    (json.dumps({"messages": [{"role": "narrator", "content": "hi"}]}) + "\n",
     ":1: no turn left: every turn's role is none of system, human,"),
    (json.dumps({"messages": []}) + "\n", ":1: 'messages' must be a non-empty list of turns"),
    (json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}) + "\n",
     ":1: turn 0: a content part of type 'image_url'; only text is supported"),
    ('[{"messages": 1}, ', ":1: not valid JSON"),
])
def test_bad_input_is_one_line_naming_the_file_and_line(chat_model, tmp_path, capsys, content, message):
    data = tmp_path / "in.jsonl"
    data.write_text(content)

    code = main(["prepare", "--model-path", str(chat_model), "--data", str(data), "--output",
                 str(tmp_path / "out.jsonl"), "--format", "speculators-0.3"])

    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1].startswith(f"hidden-states: error: {data}") and message in err[-1], err
    assert not (tmp_path / "out.jsonl").exists() and not list(tmp_path.glob(".tmp-*"))


def test_prepare_writes_rows_and_token_frequencies(chat_model, tmp_path, capsys):
    import torch

    data = write(tmp_path / "chats.jsonl", [MESSAGES, {"messages": CONVERSATION}])
    out = tmp_path / "prepared" / "rows.jsonl"

    code = main(["prepare", "--model-path", str(chat_model), "--data", str(data), "--output", str(out),
                 "--format", "speculators-0.3", "--max-seq-len", "50"])

    assert code == 0
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["input_ids"], r["loss_mask"]) for r in written] == [
        (ids[:50], mask[:50]) for ids, mask in stream_rows(data, chat_model)]
    expected = Counter(t for r in written for t, m in zip(r["input_ids"], r["loss_mask"]) if m)
    assert torch.load(out.with_name("token_freq.pt"), weights_only=True) == dict(expected)
    err = capsys.readouterr().err
    assert "2 rows read, 2 training rows, 1 truncated to --max-seq-len 50" in err, err
    assert "(mask from content spans)" in err


def test_token_frequencies_are_first_met_order_ascending_within_a_row():
    freq = token_frequencies([([9, 3, 9, 7], [1, 1, 1, 0]), ([1, 3], [1, 1])])

    assert freq == {3: 2, 9: 2, 1: 1} and list(freq) == [3, 9, 1]


def zero_states(ids, layer_ids):
    """States of zeros: what these tests check is the token ids each row was given."""
    import torch

    return [torch.zeros(len(ids), 8) for _ in layer_ids]


def test_extract_data_tokenizes_conversations_as_prepare_does(chat_model, tmp_path, monkeypatch, capsys):
    import torch

    data = write(tmp_path / "chats.jsonl", [MESSAGES, SHAREGPT, {"messages": CONVERSATION}])
    prepared = tmp_path / "prepared.jsonl"
    assert main(["prepare", "--model-path", str(chat_model), "--data", str(data), "--output", str(prepared),
                 "--format", "speculators-0.3"]) == 0
    made = fake_backends(monkeypatch, states=zero_states)
    monkeypatch.setattr(planner, "check_vllm", lambda backend, touched=None, speculators=True: "audit: not run (a fake backend)")

    extract = ["extract", "--model-path", str(chat_model), "--data", str(data), "--output-dir",
               str(tmp_path / "out"), "--format", "speculators-0.3", "--layer-ids", "1", "3", "--backend",
               "speculators", "--skip-forward-check", "--no-shared-prefix"]  # the first two rows are equal
    code = main(extract)

    assert code == 0, capsys.readouterr().err
    expected = [json.loads(line) for line in prepared.read_text().splitlines()]
    files = [torch.load(tmp_path / "out" / f"data_{i}.pt", weights_only=True) for i in range(3)]
    assert [f["input_ids"].tolist() for f in files] == [r["input_ids"] for r in expected] == rows_run(made)
    assert [f["loss_mask"].tolist() for f in files] == [r["loss_mask"] for r in expected]
    assert "conversations tokenized with the model's chat template for speculators-0.3" in capsys.readouterr().err
    # status counts the input's samples the way the run tokenized it
    from hidden_states.status import status

    assert f"input {data}: 3 samples; every one finished" in status(tmp_path / "out")
    # a resumed run redoes the missing sample alone
    (tmp_path / "out" / "data_1.pt").unlink()
    made.clear()
    assert main(extract) == 0, capsys.readouterr().err
    assert rows_run(made) == [expected[1]["input_ids"]]
    # no token_freq.pt: speculators 0.3/0.4 read none, and their dataset would load it as a sample
    # (tests/unit/test_token_frequencies.py: speculators-0.5's, prepare's)
    assert sorted(p.name for p in (tmp_path / "out").rglob("*pt")) == [f"data_{i}.pt" for i in range(3)]


@pytest.mark.datasets
def test_speculators_09_builds_its_draft_vocabulary_from_the_token_frequencies_extract_writes(
        chat_model, tmp_path, monkeypatch, capsys):
    """speculators 0.9's ``--draft-vocab-size`` reads ``<data-path>/token_freq.pt`` (torch.load with
    weights_only=True) and keeps the most frequent trained tokens; without the file it silently trains
    on the whole vocabulary. Its own mapping function on the file extract writes keeps the tokens the
    written samples train most."""
    import torch
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    echo = {"messages": [{"role": "user", "content": "Say it three times."},
                         {"role": "assistant", "content": "Paris Paris Paris, the capital."}]}
    data = write(tmp_path / "chats.jsonl", [MESSAGES, SHAREGPT, {"messages": CONVERSATION}, echo])
    fake_backends(monkeypatch, states=zero_states)
    monkeypatch.setattr(planner, "check_vllm", lambda backend, touched=None, speculators=True: "audit: not run (a fake backend)")
    out = tmp_path / "out"
    assert main(["extract", "--model-path", str(chat_model), "--data", str(data), "--output-dir", str(out),
                 "--format", "speculators-0.5", "--layer-ids", "2", "4", "--backend", "speculators",
                 "--skip-forward-check", "--no-shared-prefix"]) == 0, capsys.readouterr().err

    # what the written samples train, counted from the samples themselves
    from hidden_states.output.formats.speculators_05 import read_sample

    trained_counts = Counter()
    for path in out.glob("hidden_states/hs_*.safetensors"):
        sample = read_sample(path)
        trained_counts.update(sample["token_ids"][sample["loss_mask"].bool()].tolist())
    target_vocab_size = json.loads((chat_model / "config.json").read_text())["vocab_size"]
    token_freq = torch.load(out / "token_freq.pt", weights_only=True)  # as speculators 0.9's trainer reads it

    # a draft vocabulary smaller than what is trained: the most frequent trained tokens, every one
    # trained more often than the least frequent kept is kept
    draft_vocab_size = len(trained_counts) // 2
    d2t, t2d = build_vocab_mappings_from_distribution(token_freq, draft_vocab_size, target_vocab_size)
    kept = (torch.arange(draft_vocab_size) + d2t).tolist()
    assert t2d.shape == (target_vocab_size,) and int(t2d.sum()) == draft_vocab_size
    assert kept == sorted(kept) == torch.nonzero(t2d).flatten().tolist()
    assert set(kept) <= set(trained_counts)
    least_kept = min(trained_counts[token] for token in kept)
    assert {token for token, count in trained_counts.items() if count > least_kept} <= set(kept)
    assert max(trained_counts.values()) > least_kept  # the frequencies decided, not the ids' order
    # one as large as what is trained keeps every trained token
    _, t2d = build_vocab_mappings_from_distribution(token_freq, len(trained_counts), target_vocab_size)
    assert set(torch.nonzero(t2d).flatten().tolist()) == set(trained_counts)


def test_conversations_without_a_model_tokenizer_are_refused_naming_the_input(tmp_path):
    data = write(tmp_path / "chats.jsonl", [MESSAGES])

    with pytest.raises(InputError, match="chats.jsonl: conversations, which need the model's tokenizer"):
        list(InputStream(data))


def test_a_tokenizer_without_a_chat_template_is_refused_naming_the_line(chat_model, tmp_path):
    config = chat_model / "tokenizer_config.json"
    settings = json.loads(config.read_text())
    settings.pop("chat_template", None)
    config.write_text(json.dumps(settings))
    for name in ("chat_template.jinja",):
        (chat_model / name).unlink(missing_ok=True)
    data = write(tmp_path / "chats.jsonl", [MESSAGES])

    with pytest.raises(InputError, match="chats.jsonl:1: a conversation, but the model's tokenizer has no chat template"):
        stream_rows(data, chat_model)
    shutil.rmtree(chat_model)


# A ShareGPT dump's turn from a role no template knows ("bing"), between a user turn and the reply.
UNKNOWN_ROLE = {"conversations": [{"from": "human", "value": "What is the capital of France?"},
                                  {"from": "bing", "value": "Searching the web."},
                                  {"from": "gpt", "value": "Paris."}]}


@pytest.mark.parametrize("layout, becomes, said", [
    ("speculators-0.3", None, "1 turns with unknown roles skipped"),  # speculators 0.3/0.4 drop the turn
    ("speculators-0.5", "assistant", "1 turns with unknown roles taken as assistant"),  # speculators 0.9's way
])
def test_an_unknown_role_follows_the_formats_trainer_and_is_counted(chat_model, tmp_path, capsys, layout, becomes,
                                                                   said):
    data = write(tmp_path / "dump.jsonl", [UNKNOWN_ROLE])
    turns = UNKNOWN_ROLE["conversations"]
    known = [turns[0], *([{**turns[1], "from": "gpt"}] if becomes else []), turns[2]]
    out = tmp_path / "rows.jsonl"

    code = main(["prepare", "--model-path", str(chat_model), "--data", str(data), "--output", str(out),
                 "--format", layout])

    assert code == 0
    written = [(r["input_ids"], r["loss_mask"]) for r in map(json.loads, out.read_text().splitlines())]
    assert written == stream_rows(write(tmp_path / "known.jsonl", [{"conversations": known}]), chat_model, layout)
    assert said in capsys.readouterr().err


def test_strict_refuses_an_unknown_role_naming_the_file_line_and_role(chat_model, tmp_path, capsys):
    data = write(tmp_path / "dump.jsonl", [SHAREGPT, UNKNOWN_ROLE])

    code = main(["prepare", "--model-path", str(chat_model), "--data", str(data), "--output",
                 str(tmp_path / "rows.jsonl"), "--format", "speculators-0.5", "--strict"])

    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1] == (f"hidden-states: error: {data}:2: turn 1: role 'bing' is none of system, human, user, gpt, "
                       f"assistant, tool, function, ipython (refused by --strict)"), err


def test_the_tokenization_identity_records_what_an_unknown_role_becomes(chat_model):
    from hidden_states.inputs.identity import tokenization_change, tokenization_record

    skip = tokenization_record(64, ChatSettings(str(chat_model), "speculators-0.3", 64))
    assistant = tokenization_record(64, ChatSettings(str(chat_model), "speculators-0.5", 64))

    assert (skip["unknown_roles"], assistant["unknown_roles"]) == ("skip", "assistant")
    assert "unknown_roles 'skip', this run 'assistant'" in tokenization_change(skip, assistant)
    # --strict refuses such a turn: it makes no sample of one, so it is the same tokenization
    assert tokenization_record(64, ChatSettings(str(chat_model), "speculators-0.3", 64, strict=True)) == skip


def test_two_prepares_into_one_folder_do_not_overwrite_each_others_token_frequencies(chat_model, tmp_path, capsys):
    import torch

    first, second = write(tmp_path / "a.jsonl", [MESSAGES]), write(tmp_path / "b.jsonl", [{"messages": CONVERSATION}])
    folder = tmp_path / "prepared"

    def prepare(data, name, *extra):
        return main(["prepare", "--model-path", str(chat_model), "--data", str(data), "--output",
                     str(folder / name), "--format", "speculators-0.3", *extra])

    assert prepare(first, "a.jsonl") == 0
    freq = torch.load(folder / "token_freq.pt", weights_only=True)
    assert prepare(first, "a.jsonl") == 0  # the same command again: its own pair, rewritten alike
    capsys.readouterr()

    assert prepare(second, "b.jsonl") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"hidden-states: error: --token-freq {folder / 'token_freq.pt'}: already holds token frequencies "
                   f"that are not those of --output {folder / 'b.jsonl'}'s rows (another prepare's into this "
                   f"folder?): name another file with --token-freq, or --start-over to replace it"], err
    assert torch.load(folder / "token_freq.pt", weights_only=True) == freq and not (folder / "b.jsonl").exists()

    assert prepare(second, "b.jsonl", "--token-freq", str(folder / "b.token_freq.pt")) == 0
    assert prepare(second, "b.jsonl", "--start-over") == 0
    assert torch.load(folder / "token_freq.pt", weights_only=True) == torch.load(folder / "b.token_freq.pt",
                                                                                 weights_only=True) != freq
