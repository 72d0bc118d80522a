"""``hidden-states generate`` beyond one process, on CPU vLLM (0.32.0's lane, with Ray laid out for
it): two Ray replicas, and static shards 0/2 + 1/2, each write what one process writes for the same
conversations: the same sample files (``--format speculators-0.5``: a row per reply, numbered on
through the input, so the numbers must not depend on who regenerated what), the same ids and masks,
the same ``regenerated.jsonl``; every row's states within the bf16 floor of HF's forward of the row
(``harness``'s tolerances). The shards' own files partition the conversations; the check that says
so is shown to catch a pair that misses or duplicates one. The replicas run ``--cuda-graphs`` (vLLM
compiled, the capture inside its forward), each saying so at its end, against the eager one-process
run: a greedy reply may part from it only at a bf16 tie (``assert_near_tie``). The one-process run's
``token_freq.pt`` is ``prepare``'s of its regenerated rows.

Engine starts: the one-process run, two replicas, two shards (five); the conversations and the tiny
Llama of tests/e2e/generate_runs.py, 16 new tokens each. Marked ``extractor`` and ``data_parallel``:
the lane that lays Ray out (scripts/test_matrix.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.e2e import harness
from tests.e2e import generate_runs
from tests.e2e.generate_runs import assert_compiled_capture
from tests.e2e.trainers import speculators_09

pytestmark = [pytest.mark.vllm, pytest.mark.e2e, pytest.mark.extractor, pytest.mark.data_parallel]

LAYERS = [1, 3, 4, 6]  # speculators-0.5 counts layers done: the extractor's 0, 2, 3, 5
NEW_TOKENS = 16
# conversation 2 has two user turns: two rows, so every later conversation's numbers are shifted by one
PER_REPLY = {0: [0], 1: [1], 2: [2, 3], 3: [4], 4: [5]}
REPLICAS = ("replica 0: ", "replica 1: ")  # their lines in the driver's log


def run_generate(model, data, out, *extra):
    """``generate`` as tests/e2e/test_generate.py runs it, in ``--format speculators-0.5`` (speculators
    0.9.0's folder brings ``datasets`` for its index; the lane's own PYTHONPATH brings Ray)."""
    path = [speculators_09(), ROOT, *filter(None, [os.environ.get("PYTHONPATH")])]
    started = time.monotonic()
    proc = generate_runs.run_generate(model, data, out, "--batch-size", "1", *extra, layout="speculators-0.5",
                                       layers=LAYERS, new_tokens=NEW_TOKENS, pythonpath=path)
    print(f"generate {' '.join(extra) or '(one process)'}: {time.monotonic() - started:.0f} s")
    return proc


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("generate-dp")
    # generate_runs' conversations up to its short-first-reply one (turn feeding is proven there):
    # the five this file's counts are written for
    model, data = generate_runs.conversations_in(root, generate_runs.CONVERSATIONS[:generate_runs.SHORT])
    single = root / "single"
    proc = run_generate(model, data, single)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return model, data, single, proc


def samples(out: Path) -> dict[int, dict]:
    from safetensors.torch import load_file

    return {int(p.stem.split("_")[1]): load_file(str(p)) for p in (out / "hidden_states").glob("hs_*.safetensors")}


def regenerated(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def assert_one_process_output(out: Path, single: Path, near_ties: bool = False) -> None:
    """The files of the one-process run, no other, each with its ids and mask; every row's states
    within the bf16 floor of HF's forward of it; ``regenerated.jsonl`` the same, line for line.

    ``near_ties``: the run's forward was compiled, the one-process run's eager, and they round bf16
    otherwise: a greedy reply may part from the one-process run's where its two best tokens are tied
    within that rounding (:func:`assert_near_tie`); from there on that conversation's rows are its own
    regenerated conversation's, as ``generate`` tokenizes it."""
    import torch

    from hidden_states.inputs.conversations import MESSAGES, Record
    from hidden_states.fixtures.reference import decoder_layer_outputs, load_model, relative_errors
    from hidden_states.inputs.tokenization import ChatTokenizer, load_tokenizer

    got, want = samples(out), samples(single)
    assert sorted(got) == sorted(want) == sorted(i for indices in PER_REPLY.values() for i in indices)
    lines = {line["index"]: line for line in regenerated(out / "regenerated.jsonl")}
    wanted = {line["index"]: line for line in regenerated(single / "regenerated.jsonl")}
    assert {index: line["sample_indices"] for index, line in lines.items()} == PER_REPLY
    hf = load_model(out.parent / "tiny-llama-llama3")
    chat = ChatTokenizer(load_tokenizer(str(out.parent / "tiny-llama-llama3")), "speculators-0.5", 1024)
    parted = sorted(index for index in lines if lines[index]["generated"] != wanted[index]["generated"])
    assert near_ties or not parted, f"conversations {parted} were generated otherwise than by one process"
    expected = {index: (want[index]["token_ids"], want[index]["loss_mask"]) for index in want}
    for index in parted:
        assert_near_tie(hf, chat, lines[index], wanted[index])
        rows = chat.rows(Record("x", 1, {"messages": lines[index]["messages"]}), MESSAGES)
        assert len(rows) == len(PER_REPLY[index])
        for sample, row in zip(PER_REPLY[index], rows):
            expected[sample] = (torch.tensor(row.input_ids), torch.tensor(row.loss_mask))
    worst = 0.0
    for index, saved in sorted(got.items()):
        ids, mask = expected[index]
        assert saved["token_ids"].tolist() == ids.tolist(), index
        assert saved["loss_mask"].tolist() == mask.tolist(), index
        reference = decoder_layer_outputs(hf, [saved["token_ids"].tolist()], [layer - 1 for layer in LAYERS])[0]
        for j, ref in enumerate(reference):
            errors = relative_errors(saved["hidden_states"][:, j, :], ref)
            assert float(errors.max()) <= harness.TOLERANCE, f"sample {index} layer {LAYERS[j]}"
            assert float(errors.mean()) <= harness.MEAN_TOLERANCE, f"sample {index} layer {LAYERS[j]}"
            worst = max(worst, float(errors.max()))
    print(f"{out.name}: {len(got)} rows ({len(parted)} conversations parted at a bf16 tie), worst token "
          f"{worst:.4f} of HF")
    if not parted:
        assert (out / "regenerated.jsonl").read_text() == (single / "regenerated.jsonl").read_text()
    for index, line in lines.items():
        if index not in parted:
            assert line == wanted[index], index
        else:  # the input's turns and the files are the one-process run's; the replies its own
            assert {k: v for k, v in line.items() if k not in ("messages", "generated")} == \
                   {k: v for k, v in wanted[index].items() if k not in ("messages", "generated")}
            assert [m for m in line["messages"] if m["role"] != "assistant"] == \
                   [m for m in wanted[index]["messages"] if m["role"] != "assistant"]


# HF's two best logits (fp32) closer than this are a tie that bf16 rounding may break either way:
# at the tiny Llama's logits (about 2.5, spread 0.9) bf16 resolves 0.016, and a forward's rounding adds up
NEAR_TIE = 0.05


def assert_near_tie(hf, chat, line: dict, wanted: dict) -> None:
    """Where ``line``'s replies first part from ``wanted``'s (the same conversation, generated by
    the one-process run), the two tokens are HF's two best next tokens, within ``NEAR_TIE``: a tie,
    not a forward computing something else. The turns before it are the same in both."""
    import torch

    turns = [turn for turn, message in enumerate(wanted["messages"]) if message["role"] == "assistant"]
    for turn, mine, theirs in zip(turns, line["generated"], wanted["generated"], strict=True):
        mine, theirs = mine["token_ids"], theirs["token_ids"]
        if mine == theirs:
            assert line["messages"][turn] == wanted["messages"][turn]
            continue
        at = next(k for k, (a, b) in enumerate(zip(mine, theirs)) if a != b)
        with torch.no_grad():
            logits = hf(torch.tensor([chat.prompt_ids(wanted["messages"][:turn]) + mine[:at]])).logits[0, -1]
        best = logits.topk(2)
        assert sorted(best.indices.tolist()) == sorted([mine[at], theirs[at]]), \
            f"conversation {line['index']}: token {at} of reply {turns.index(turn)} is {mine[at]}, one process " \
            f"generated {theirs[at]}, HF's best are {best.indices.tolist()}"
        gap = float(best.values[0] - best.values[1])
        assert gap <= NEAR_TIE, f"conversation {line['index']}: HF's two best logits {gap:.4f} apart: not a tie"
        return
    raise AssertionError(f"conversation {line['index']}: its replies are the one-process run's")


def ledgers(out: Path) -> dict[str, list[int]]:
    return {p.name: [json.loads(line)["index"] for line in p.read_text().splitlines() if line.strip()]
            for p in out.glob("done*.jsonl")}


def assert_partition(parts: list[Path], single: Path) -> None:
    """The shards' own files hold every conversation of the one-process run, each in one of them only,
    with its line."""
    held = [line["index"] for part in parts for line in regenerated(part)]
    assert len(held) == len(set(held)), f"a conversation in two shards: {sorted(held)}"
    wanted = {line["index"]: line for line in regenerated(single / "regenerated.jsonl")}
    assert sorted(held) == sorted(wanted), f"shards hold {sorted(held)}, one process {sorted(wanted)}"
    for part in parts:
        for line in regenerated(part):
            assert line == wanted[line["index"]], line["index"]


def test_one_process_numbers_rows_per_reply(workspace):
    _, _, single, proc = workspace
    assert {line["index"]: line["sample_indices"] for line in regenerated(single / "regenerated.jsonl")} == PER_REPLY
    assert "done: 6 samples extracted" in proc.stderr


def test_one_process_writes_prepares_token_freq_of_the_regenerated_rows(workspace, tmp_path):
    """``token_freq.pt`` beside the rows (speculators 0.9 reads ``<data-path>/token_freq.pt``; the
    layout whose trainer reads it), written once the run has every conversation: the counts
    ``prepare`` makes of ``regenerated.jsonl`` (a resumed run's: tests/unit/test_generate.py)."""
    import torch

    model, _, single, _ = workspace
    proc = subprocess.run([sys.executable, "-m", "hidden_states", "prepare", "--model-path", str(model), "--data",
                           str(single / "regenerated.jsonl"), "--output", str(tmp_path / "prepared.jsonl"), "--format",
                           "speculators-0.5", "--max-seq-len", "1024"], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": ROOT, "HF_HUB_OFFLINE": "1"})  # 1024: cpu-tiny's
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected = torch.load(tmp_path / "token_freq.pt", weights_only=True)
    assert expected and torch.load(single / "token_freq.pt", weights_only=True) == expected


def test_two_replicas_with_cuda_graphs_write_what_one_process_writes(workspace):
    """The replicas run ``--cuda-graphs`` (each its engine compiled, the capture's copies inside its
    forward) and write what the eager one-process run writes. Negative: the check that each replica
    ran the capture inside vLLM's compiled forward fails on the eager run's log."""
    pytest.importorskip("ray")
    model, data, single, reference = workspace
    out = single.parent / "replicas"
    proc = run_generate(model, data, out, "--data-parallel-size", "2", "--cuda-graphs")
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert json.loads((out / "data_config.json").read_text())["settings"]["cuda_graphs"] is True
    assert_compiled_capture(proc.stderr, REPLICAS)
    with pytest.raises(AssertionError, match="inside vLLM's compiled forward"):
        assert_compiled_capture(reference.stderr, REPLICAS)
    assert_one_process_output(out, single, near_ties=True)
    # the negative of a tie: a reply parting at HF's least likely token
    import torch

    from hidden_states.fixtures.reference import load_model
    from hidden_states.inputs.tokenization import ChatTokenizer, load_tokenizer

    hf, chat = load_model(model), ChatTokenizer(load_tokenizer(str(model)), "speculators-0.5", 1024)
    line = regenerated(single / "regenerated.jsonl")[0]
    turn = next(turn for turn, message in enumerate(line["messages"]) if message["role"] == "assistant")
    ids = line["generated"][0]["token_ids"]
    with torch.no_grad():
        least = int(hf(torch.tensor([chat.prompt_ids(line["messages"][:turn]) + ids[:1]])).logits[0, -1].argmin())
    other = json.loads(json.dumps(line))
    other["generated"][0]["token_ids"] = [ids[0], least] + ids[2:]
    with pytest.raises(AssertionError, match="HF's best are"):
        assert_near_tie(hf, chat, other, line)
    shares = ledgers(out)
    assert sorted(shares) == ["done.replica-0.jsonl", "done.replica-1.jsonl"] and all(shares.values()), shares
    written = [index for indices in shares.values() for index in indices]
    assert sorted(written) == list(range(6)), shares  # each file once
    said = next(line for line in proc.stderr.splitlines() if "conversations regenerated" in line)
    want = next(line for line in reference.stderr.splitlines() if "conversations regenerated" in line)
    assert said.split("; ")[0] == want.split("; ")[0]  # conversations, replies, tokens generated, rows


def test_static_shards_union_is_one_process_and_a_bad_union_is_caught(workspace):
    model, data, single, _ = workspace
    out = single.parent / "shards"
    for shard in ("0/2", "1/2"):
        proc = run_generate(model, data, out, "--shard", shard)
        assert proc.returncode == 0, proc.stderr[-4000:]
        assert f"shard {shard} (from --shard)" in proc.stderr
    parts = sorted(out.glob("regenerated.shard-*.jsonl"))
    assert [p.name for p in parts] == ["regenerated.shard-0-of-2.jsonl", "regenerated.shard-1-of-2.jsonl"]
    assert [line["index"] for line in regenerated(parts[0])] == [0, 2, 4]  # every other batch of one
    assert_partition(parts, single)
    assert_one_process_output(out, single)  # the shard that ended last merged both into regenerated.jsonl
    assert sorted(ledgers(out)) == ["done.shard-0-of-2.jsonl", "done.shard-1-of-2.jsonl"]
    status = subprocess.run([sys.executable, "-m", "hidden_states", "status", str(out)], capture_output=True,
                            text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    assert status.returncode == 0, status.stderr
    assert "6 sample files whole" in status.stdout
    assert "done.shard-0-of-2.jsonl: 4 files written" in status.stdout
    assert "regenerated.shard-1-of-2.jsonl: 2 conversations" in status.stdout
    # the negative proof: a pair that misses a shard's conversations, and one holding them twice
    with pytest.raises(AssertionError, match="shards hold"):
        assert_partition([parts[0]], single)
    with pytest.raises(AssertionError, match="a conversation in two shards"):
        assert_partition([parts[0], parts[0]], single)
