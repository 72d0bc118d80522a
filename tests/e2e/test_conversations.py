"""``hidden-states prepare`` against speculators' own preprocessing, on the same conversations and
tokenizer: rows, loss masks and ``token_freq.pt``.

Three template families on tiny local tokenizers (``hidden_states.fixtures.chat_templates``:
Llama-3 without and with generation markers, Qwen3 with thinking, DeepSeek-R1), ShareGPT and
OpenAI ``messages`` files of the same conversations (speculators reads a ``conversations`` column,
so its copy of the messages file carries the same turns under that name, as its UltraChat
normaliser does). Replies with leading and trailing whitespace, replies starting with markup, 60 %
with ``<think>`` reasoning in their content, one in seven long enough to be truncated. Past the
first eight, some conversations carry turns of roles no template knows, as real ShareGPT dumps do
(``bing`` before a reply, ``chatgpt`` after one): each release's own normaliser decides what they
become (0.3.0 and 0.4.0 skip the turn, 0.9.0 takes it as the assistant's), and ours, by default,
follows the trainer of the format compared.

* ``--format speculators-0.3`` against 0.4.0's and 0.3.0's ``load_and_preprocess_dataset``: every
  row identical where the release masks by the template (0.4.0: generation markers or its detected
  pattern; 0.3.0: its pattern), with the differences it is known for counted and checked one by one
  (``DIFFERENCES``): rows it leaves untruncated on the generation-marker path (ours are their first
  ``--max-seq-len`` tokens), Qwen3 replies its pattern cannot see, 0.3.0 ignoring generation markers.
* ``--format speculators-0.5`` against 0.9.0's ``prepare-data`` steps (``speculators_prep_driver``):
  identical rows, one per assistant turn.

``token_freq.pt`` is compared as the dict it holds (speculators' is counted over its shuffled
rows, ours in the file's order: the same counts, keys in another order).

speculators 0.9.0 and ``datasets`` need Python >= 3.11 and transformers >= 5: the vLLM 0.32.0 venv,
with speculators 0.9.0's folder (which brings ``datasets``) built as tests/e2e/trainers.py builds it.
Marked ``formats``: run on vLLM 0.32.0 only; no engine starts.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.e2e import harness
from tests.e2e.trainers import speculators_09

pytestmark = [pytest.mark.formats]

SEQ_LEN = 200
DRIVER = Path(__file__).with_name("speculators_prep_driver.py")
FAMILIES = ("llama3", "llama3_generation", "qwen3", "deepseek_r1")
WORDS = ("the quick brown fox jumps over lazy dog what is capital of France Paris sea wind light water night "
         "first add numbers then check answer again sure here short poem weather today sunny warm city London "
         "def return print result 42 17 3.5 hello thanks please explain why because").split()
SHAREGPT_ROLES = {"system": "system", "user": "human", "assistant": "gpt"}  # any other role is written as is


def sentence(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


def conversations(count: int, seed: int) -> list[list[tuple[str, str]]]:
    """(role, content) turns: an optional system turn, one to three exchanges."""
    rng = random.Random(seed)
    made = []
    for number in range(count):
        turns = [("system", sentence(rng, 3, 10))] if rng.random() < 0.4 else []
        for _ in range(rng.randint(1, 3)):
            turns.append(("user", sentence(rng, 2, 20)))
            reply = sentence(rng, 1, 40 if number % 7 else 120)
            if rng.random() < 0.2:
                reply = f" {reply}\n"
            if rng.random() < 0.15:
                reply = "<b>" + reply
            if rng.random() < 0.6:
                reply = f"<think>\n{sentence(rng, 2, 15)}\n</think>\n\n{reply}"
            turns.append(("assistant", reply))
        made.append(turns)
    return made


def with_unknown_roles(convs: list[list[tuple[str, str]]], seed: int) -> int:
    """Turns of roles no chat template knows, in every fourth conversation past the first eight (those
    the real-generator test reads stay as made): a ``bing`` turn before the first reply, or a
    ``chatgpt`` turn after it. Returns how many were added."""
    rng = random.Random(seed)
    added = 0
    for number in range(8, len(convs), 4):
        turns = convs[number]
        first_reply = next(i for i, (role, _) in enumerate(turns) if role == "assistant")
        if number % 8 == 0:
            turns.insert(first_reply, ("bing", f"Searching the web for: {sentence(rng, 2, 8)}"))
        else:
            turns.insert(first_reply + 1, ("chatgpt", sentence(rng, 2, 25)))
        added += 1
    return added


def write(path: Path, convs, kind: str) -> Path:
    with path.open("w") as handle:
        for conv in convs:
            if kind == "sharegpt":
                row = {"conversations": [{"from": SHAREGPT_ROLES.get(r, r), "value": c} for r, c in conv]}
            elif kind == "messages":
                row = {"messages": [{"role": r, "content": c} for r, c in conv]}
            else:  # the messages as speculators reads them
                row = {"conversations": [{"role": r, "content": c} for r, c in conv]}
            handle.write(json.dumps(row) + "\n")
    return path


def read_rows(path: Path) -> list[tuple[list[int], list[int]]]:
    return [(r["input_ids"], r["loss_mask"]) for r in map(json.loads, path.read_text().splitlines())]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    from hidden_states.fixtures.chat_templates import build_tokenizer

    root = tmp_path_factory.mktemp("conversations")
    convs = conversations(40, seed=7)
    assert with_unknown_roles(convs, seed=8) == 8
    files = {"sharegpt": write(root / "sharegpt.jsonl", convs, "sharegpt"),
             "messages": write(root / "messages.jsonl", convs, "messages"),
             "messages-for-speculators": write(root / "messages-speculators.jsonl", convs, "speculators")}
    tokenizers = {family: build_tokenizer(family, root / "tokenizers" / family) for family in FAMILIES}
    return root, files, tokenizers


def ours(workspace, family: str, kind: str, layout: str) -> tuple[list, dict]:
    import torch

    from hidden_states.prepare import prepare
    from hidden_states.inputs.tokenization import ChatSettings

    root, files, tokenizers = workspace
    out = root / "ours" / f"{family}-{kind}-{layout}.jsonl"
    freq = out.with_suffix(".token_freq.pt")
    # in this process: the CLI around prepare() is the unit suite's (tests/unit/test_conversations.py)
    prepare(ChatSettings(str(tokenizers[family]), layout, SEQ_LEN, False), str(files[kind]), str(out), str(freq),
            log=lambda line: None)
    return read_rows(out), torch.load(freq, weights_only=True)


def theirs(workspace, family: str, kind: str, release: str) -> tuple[list, dict]:
    """speculators' rows for one family and file; the first call for a release runs every family and
    file of it in one driver process."""
    import torch

    root, files, tokenizers = workspace
    out = root / "theirs" / f"{family}-{kind}-{release}"
    if not (out / "rows.jsonl").is_file():
        jobs = [{"tokenizer": str(tokenizers[f]), "data": str(files["messages-for-speculators" if k == "messages" else k]),
                 "seq_len": SEQ_LEN, "out": str(root / "theirs" / f"{f}-{k}-{release}")}
                for f in FAMILIES for k in ("sharegpt", "messages")]
        listed = root / f"jobs-{release}.json"
        listed.write_text(json.dumps(jobs))
        if release == "0.9":
            path = [str(speculators_09()), ROOT]
        else:
            path = [str(harness.speculators_path(f"{release}.0")), str(speculators_09()), ROOT]
        proc = subprocess.run([sys.executable, str(DRIVER), release, str(listed)],
                              cwd=ROOT, env={**os.environ, "PYTHONPATH": os.pathsep.join(path), "HF_HUB_OFFLINE": "1",
                                             "HF_DATASETS_OFFLINE": "1"},
                              capture_output=True, text=True, timeout=1800)
        assert proc.returncode == 0, proc.stderr[-3000:]
    return read_rows(out / "rows.jsonl"), torch.load(out / "token_freq.pt", weights_only=True)


def decoded_spans(tokenizer, ids, mask) -> list[str]:
    spans, current = [], []
    for token, trained in zip(ids, mask):
        if trained:
            current.append(token)
        elif current:
            spans.append(tokenizer.decode(current))
            current = []
    if current:
        spans.append(tokenizer.decode(current))
    return spans


def explain(family: str, release: str, mine, their, tokenizer) -> str | None:
    """Why one row differs, when it is a difference the release is known for; None otherwise."""
    ids, mask = mine
    their_ids, their_mask = their
    if ids != their_ids[:SEQ_LEN] or len(ids) > SEQ_LEN:
        return None
    if len(their_ids) > SEQ_LEN and (ids, mask) == (their_ids[:SEQ_LEN], their_mask[:SEQ_LEN]):
        # 0.4.0's generation-marker path does not truncate (its pattern path does)
        return "untruncated by speculators (generation-marker path); ours is its first --max-seq-len tokens"
    if ids != their_ids:
        return None
    if family == "qwen3":
        # Qwen3's pattern, detected on a two-reply probe, expects the empty '<think>\n\n</think>\n\n' the
        # template writes for a last reply without reasoning: replies before the last query (shown without
        # the block) and replies with reasoning never match. Where its pattern matched, the spans agree.
        theirs_trained = [i for i, m in enumerate(their_mask) if m]
        if all(mask[i] for i in theirs_trained):
            return "Qwen3: speculators' pattern misses replies shown without an empty think block"
    if family == "llama3_generation" and release == "0.3":
        # 0.3.0 has no generation-marker path: its pattern trains the reply without <|eot_id|>
        spans, their_spans = decoded_spans(tokenizer, ids, mask), decoded_spans(tokenizer, their_ids, their_mask)
        if [s.removesuffix("<|eot_id|>") for s in spans] == their_spans:
            return "speculators 0.3.0 ignores generation markers: its pattern leaves <|eot_id|> untrained"
    return None


def compare(workspace, family, kind, layout, release):
    from transformers import AutoTokenizer

    mine, my_freq = ours(workspace, family, kind, layout)
    their, their_freq = theirs(workspace, family, kind, release)
    assert len(mine) == len(their), f"{len(mine)} rows, speculators {release}: {len(their)}"
    tokenizer = AutoTokenizer.from_pretrained(workspace[2][family])
    reasons: dict[str, int] = {}
    for number, (row, other) in enumerate(zip(mine, their)):
        if row == other:
            continue
        why = explain(family, release, row, other, tokenizer)
        assert why is not None, (f"row {number} differs unexplained: ours {decoded_spans(tokenizer, *row)}, "
                                 f"speculators {release} {decoded_spans(tokenizer, *other)}")
        reasons[why] = reasons.get(why, 0) + 1
    print(f"\n{family} {kind} {layout} vs speculators {release}: {len(mine)} rows, "
          f"{len(mine) - sum(reasons.values())} identical, differences: {reasons or 'none'}")
    return mine, my_freq, their, their_freq, reasons


@pytest.mark.parametrize("kind", ["sharegpt", "messages"])
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("release", ["0.4", "0.3"])
def test_speculators_03_layout_matches_load_and_preprocess_dataset(workspace, family, kind, release):
    mine, my_freq, their, their_freq, reasons = compare(workspace, family, kind, "speculators-0.3", release)
    if not reasons:
        assert my_freq == their_freq
    else:  # the frequencies of the rows both made alike agree; the rest follow their masks
        from hidden_states.inputs.tokenization import token_frequencies

        assert my_freq == token_frequencies(mine)
        assert their_freq == token_frequencies(their)
    if family in ("llama3", "deepseek_r1") or (family == "llama3_generation" and release == "0.4"):
        assert not [r for r in reasons if not r.startswith("untruncated")], reasons


@pytest.mark.parametrize("kind", ["sharegpt", "messages"])
@pytest.mark.parametrize("family", FAMILIES)
def test_speculators_05_layout_matches_prepare_data(workspace, family, kind):
    mine, my_freq, their, their_freq, reasons = compare(workspace, family, kind, "speculators-0.5", "0.9")
    assert not reasons
    assert my_freq == their_freq


def test_parquet_and_a_dataset_directory_read_as_the_jsonl_does(workspace):
    """The same conversations as Parquet and as a ``save_to_disk`` directory (written by pyarrow and
    datasets from the 0.9.0 folder, whose columns then hold every key of every turn, missing ones
    None) prepare to the JSONL's rows."""
    root, files, tokenizers = workspace
    path = os.pathsep.join([ROOT, str(speculators_09())])
    env = {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    writer = ("import json, sys, datasets, pyarrow as pa, pyarrow.parquet as pq\n"
              "rows = [json.loads(line) for line in open(sys.argv[1])]\n"
              "pq.write_table(pa.Table.from_pylist(rows), sys.argv[2])\n"
              "datasets.load_dataset('json', data_files=sys.argv[1], split='train', cache_dir=sys.argv[3] + '.cache')"
              ".save_to_disk(sys.argv[3])\n")
    for kind in ("sharegpt", "messages"):
        parquet, directory = root / f"{kind}.parquet", root / f"{kind}-dataset"
        subprocess.run([sys.executable, "-c", writer, str(files[kind]), str(parquet), str(directory)], env=env,
                       check=True, capture_output=True, timeout=300)
        outputs = []
        for data in (files[kind], parquet, directory):
            out = root / "containers" / data.name / "rows.jsonl"  # a folder each: one token_freq.pt per prepare
            proc = subprocess.run([sys.executable, "-m", "hidden_states", "prepare", "--model-path",
                                   str(tokenizers["qwen3"]), "--data", str(data), "--output", str(out), "--format",
                                   "speculators-0.3"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
            assert proc.returncode == 0, proc.stderr[-3000:]
            outputs.append(out.read_text())
        assert outputs[0] == outputs[1] == outputs[2] and outputs[0].count("\n") == 40


@pytest.mark.vllm
@pytest.mark.e2e
def test_extract_takes_conversations_through_the_real_generator(workspace, tmp_path):
    """``extract --data`` on eight conversations of the messages file (one with a turn of a role no
    template knows, which speculators 0.3/0.4 skip), with the tiny Llama and a Qwen3 chat tokenizer,
    through speculators 0.3.0's generator on vLLM: each file holds the row ``prepare`` made for that
    conversation, and states for every one of its tokens. No other file whose name ends in "pt" lies
    beside them: speculators 0.3.0's own ``Eagle3SampleFileDataset``, given the directory (it loads
    every such file under it as a sample), loads the eight and yields each one's item. Converted to
    speculators-0.5, the directory gets ``token_freq.pt`` (where speculators 0.9 looks for it,
    ``<data-path>/token_freq.pt``): prepare's of the same rows."""
    import torch

    from tests.e2e.extract_runs import LAYERS, run_cli

    root, files, tokenizers = workspace
    model = tmp_path / "tiny-llama-qwen3-template"
    shutil.copytree(harness.tiny_model("llama"), model)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        (model / name).unlink(missing_ok=True)
        if (tokenizers["qwen3"] / name).exists():
            shutil.copy(tokenizers["qwen3"] / name, model / name)
    rows = [json.loads(line) for line in files["messages"].read_text().splitlines()[:8]]
    rows[3]["messages"].insert(1, {"role": "bing", "content": "Searching the web for an answer."})
    data = tmp_path / "eight.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    prepared = tmp_path / "prepared.jsonl"
    proc = subprocess.run([sys.executable, "-m", "hidden_states", "prepare", "--model-path", str(model), "--data",
                           str(data), "--output", str(prepared), "--format", "speculators-0.3",
                           "--max-seq-len", str(SEQ_LEN)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": ROOT, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "out"

    proc = run_cli("--model-path", str(model), "--data", str(data), "--output-dir", str(out), "--preset",
                   "cpu-tiny", "--format", "speculators-0.3", "--layer-ids", *LAYERS, "--max-seq-len", str(SEQ_LEN),
                   "--backend", "speculators", env_extra={
                       "PYTHONPATH": os.pathsep.join([str(harness.speculators_path("0.3.0")), ROOT])})

    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "conversations tokenized with the model's chat template for speculators-0.3" in proc.stderr
    assert "1 turns with unknown roles skipped" in proc.stderr
    expected = read_rows(prepared)
    assert len(expected) == 8
    for number, (ids, mask) in enumerate(expected):
        saved = torch.load(out / f"data_{number}.pt", weights_only=True)
        assert saved["input_ids"].tolist() == ids and saved["loss_mask"].tolist() == mask
        assert all(state.shape[0] == len(ids) for state in saved["hidden_states"])
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.name.endswith("pt")) == \
        sorted(f"data_{number}.pt" for number in range(8))

    loaded = tmp_path / "loaded.json"
    proc = subprocess.run([sys.executable, "-c", SAMPLE_FILE_DATASET, str(out), str(SEQ_LEN), str(loaded)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1",
                          "PYTHONPATH": os.pathsep.join([str(harness.speculators_path("0.3.0")), ROOT])})
    assert proc.returncode == 0, proc.stderr[-4000:]
    items = json.loads(loaded.read_text())
    assert sorted(items) == sorted(str(out / f"data_{number}.pt") for number in range(8))
    for number, (ids, mask) in enumerate(expected):  # shift_batch drops each sample's first position
        assert items[str(out / f"data_{number}.pt")] == {"input_ids": ids[1:], "loss_mask": mask[1:],
                                                         "lengths": [len(ids) - 1], "rows": len(ids) - 1}

    converted = tmp_path / "converted"
    proc = subprocess.run([sys.executable, "-m", "hidden_states", "convert", str(out), str(converted), "--to",
                           "speculators-0.5"], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                               "PYTHONPATH": os.pathsep.join([ROOT, str(speculators_09())])})
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert torch.load(converted / "token_freq.pt", weights_only=True) == torch.load(tmp_path / "token_freq.pt",
                                                                                    weights_only=True)


# speculators 0.3.0's dataset, unmodified, on a directory: every sample file it finds, and what it
# yields for it (vllm_compat's apply() first: speculators 0.3/0.4 import under transformers 5 only so)
SAMPLE_FILE_DATASET = """
import json, sys
from vllm_compat.extractor_api import apply
apply()
from speculators.train.data import Eagle3SampleFileDataset
dataset = Eagle3SampleFileDataset(max_len=int(sys.argv[2]), datapath=sys.argv[1])
items = {}
for index in range(len(dataset)):
    item = dataset[index]
    items[str(dataset.data[index])] = {"input_ids": item["input_ids"].tolist(), "loss_mask": item["loss_mask"].tolist(),
                                       "lengths": item["lengths"].tolist(), "rows": int(item["hidden_states"].shape[0])}
json.dump(items, open(sys.argv[3], "w"))
"""
