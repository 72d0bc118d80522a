"""Rows served from a longer row's states (hidden_states/inputs/prefixes.py): which rows run, and that every
row's file is what extracting it alone writes, across batches, resume and shards. A fake backend whose
states are causal (a token's state depends on the tokens up to it only) stands in for vLLM; the real
one runs in tests/e2e/test_formats.py."""
import json
from pathlib import Path

import pytest

from hidden_states.extract.command import Extraction
from hidden_states.inputs.streams import Sample
from hidden_states.inputs.prefixes import share
from hidden_states.settings import Settings
from hidden_states.shards import Shard
from tests.unit.fakes import FakeBackend, fake_backends, rows_run

torch = pytest.importorskip("torch")


def rows(*ids_lists) -> list[Sample]:
    return [Sample(i, i + 1, list(ids), None) for i, ids in enumerate(ids_lists)]


def test_each_row_is_served_by_the_longest_row_it_begins():
    batch = rows([1, 2], [1, 2, 3, 4], [9], [1, 2, 3], [1, 2, 5], [9], [1, 2, 3, 4, 6])
    shared = share(batch)
    # [1, 2] begins three rows: it goes with one of them; [1, 2, 5] branches off and runs itself
    assert [s.index for s in shared.carriers] == [4, 5, 6]
    served = {carrier: [s.index for s in rows_] for carrier, rows_ in shared.served.items()}
    assert served == {4: [0], 5: [2], 6: [1, 3]} or served == {6: [0, 1, 3], 5: [2]}
    assert shared.served_rows == 4


def test_rows_that_only_share_a_beginning_all_run():
    shared = share(rows([7, 1, 2], [7, 1, 3], [7, 1]))
    assert [s.index for s in shared.carriers] == [0, 1]
    assert shared.served_rows == 1


def causal_states(ids, layer_ids):
    """States of token t: the sum of the ids up to t, per layer and hidden unit."""
    running = torch.tensor(ids, dtype=torch.float64).cumsum(0)[:, None]
    return [running * (layer + 1) + torch.arange(8) for layer in layer_ids]


def conversation(first: int, turns: int) -> list[list[int]]:
    """Per-turn rows: each the one before with one more exchange."""
    return [[3, 4] + [first + k for k in range(4 * turn)] for turn in range(1, turns + 1)]


@pytest.fixture
def made(monkeypatch):
    """The causal fake backends the test's runs make (their ``batches``: what ran)."""
    return fake_backends(monkeypatch, states=causal_states)


@pytest.fixture
def job(fake_model, tmp_path, made):
    """Three conversations of 3, 2 and 3 turns (8 rows) and settings for the causal fake backend."""
    data = tmp_path / "data.jsonl"
    lines = conversation(10, 3) + conversation(30, 2) + conversation(40, 3)
    data.write_text("".join(json.dumps({"input_ids": ids, "loss_mask": [0] * (len(ids) - 1) + [1]}) + "\n"
                            for ids in lines))
    return Settings(model_path=str(fake_model), prepared_data=str(data), output_dir=str(tmp_path / "out"),
                    batch_size=4, layer_ids=[1, 3], backend="fake", format="speculators-0.3")


def files(settings) -> dict[int, dict]:
    return {int(p.stem.split("_")[1]): torch.load(p, weights_only=True)
            for p in Path(settings.output_dir).glob("data_*.pt")}


def alone(settings, tmp_path, name="alone") -> dict[int, dict]:
    whole = Settings(**{**settings.__dict__, "output_dir": str(tmp_path / name), "share_prefixes": False})
    Extraction(whole, log=lambda line: None).run()
    return files(whole)


def assert_same(got: dict[int, dict], want: dict[int, dict]):
    assert sorted(got) == sorted(want)
    for index, record in want.items():
        assert torch.equal(got[index]["input_ids"], record["input_ids"])
        assert torch.equal(got[index]["loss_mask"], record["loss_mask"])
        for mine, theirs in zip(got[index]["hidden_states"], record["hidden_states"], strict=True):
            assert torch.equal(mine, theirs), index
            # its own storage: torch.save would have written the carrier's whole tensor
            assert mine.untyped_storage().nbytes() == mine.numel() * mine.element_size()


def test_only_the_longest_row_of_each_batch_runs_and_every_file_equals_extracting_alone(job, made, tmp_path):
    said = []
    summary = Extraction(job, log=said.append).run()
    ran = rows_run(made)

    # batches of 4: rows 0-3 (conversation one's three turns, conversation two's first), rows 4-7
    # (conversation two's second turn, conversation three's three): the window is the batch
    assert [len(ids) for ids in ran] == [14, 6, 10, 14]
    assert (summary.extracted, summary.shared_rows) == (8, 4)
    lengths = [6, 10, 14, 6, 10, 6, 10, 14]
    assert (summary.tokens, summary.computed_tokens) == (sum(lengths), 44)
    assert "shared prefixes: 4 of 8 rows served from a longer row's states, 44 tokens computed for 76 row tokens" \
        in summary.shared_line()
    assert_same(files(job), alone(job, tmp_path))
    assert len(rows_run(made)) == len(ran) + 8  # --no-shared-prefix: every row ran


def test_resume_redoes_only_the_rows_missing_and_serves_them_again(job, made, tmp_path):
    Extraction(job, log=lambda line: None).run()
    for index in (0, 1):  # a crash after the carrier's file, before the rows served from it
        (Path(job.output_dir) / f"data_{index}.pt").unlink()
    made.clear()

    summary = Extraction(job, log=lambda line: None).run()

    assert (summary.extracted, summary.skipped, summary.shared_rows) == (2, 6, 1)
    assert rows_run(made) == [[3, 4] + list(range(10, 18))]  # row 1 runs, row 0 is served from it
    assert_same(files(job), alone(job, tmp_path))


def test_static_shards_together_write_every_row_as_extracting_alone(job, tmp_path):
    for index in range(2):
        sharded = Settings(**{**job.__dict__, "shard": Shard(index, 2, "--shard")})
        Extraction(sharded, log=lambda line: None).run()
    assert_same(files(job), alone(job, tmp_path))


def test_ray_replicas_serve_rows_in_their_batches_and_the_driver_counts_them(job, tmp_path, monkeypatch):
    from hidden_states.replicas import driver
    from tests.unit.fake_ray import FakeRay

    monkeypatch.setattr(driver, "import_ray", lambda: FakeRay({}))
    driven = Settings(**{**job.__dict__, "data_parallel_size": 2})
    summary = Extraction(driven, log=lambda line: None).run()

    assert (summary.extracted, summary.shared_rows, summary.computed_tokens) == (8, 4, 44)
    assert_same(files(job), alone(job, tmp_path))


def chat(think: bool) -> dict:
    messages = [{"role": "system", "content": "Be brief."}]
    for k in range(3):
        reply = f"answer {k} is sunny and warm"
        messages += [{"role": "user", "content": f"question {k} about the weather"},
                     {"role": "assistant", "content": f"<think>\nreason {k}\n</think>\n\n{reply}" if think else reply}]
    return {"messages": messages}


@pytest.mark.parametrize("family, served", [("llama3", 2), ("llama3_generation", 2), ("deepseek_r1", 2), ("qwen3", 0)])
@pytest.mark.parametrize("think", [False, True], ids=["plain", "reasoning"])
def test_per_turn_rows_are_prefixes_where_the_template_keeps_earlier_turns(tmp_path, family, served, think):
    """speculators 0.5's rows (one per assistant turn) of a three-exchange conversation: Llama-3 keeps
    earlier turns as they were, DeepSeek-R1 drops every turn's reasoning alike, so each row begins the
    next; Qwen3 gives only the last turn a ``<think>`` block (empty without reasoning): no row begins
    another, and all run whole."""
    from hidden_states.fixtures.chat_templates import build_tokenizer
    from hidden_states.inputs.streams import InputStream
    from hidden_states.inputs.tokenization import ChatSettings

    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps(chat(think)) + "\n")
    tokenizer = build_tokenizer(family, tmp_path / family)
    batch = list(InputStream(data, chat=ChatSettings(str(tokenizer), "speculators-0.5", 4096)))

    assert len(batch) == 3 and share(batch).served_rows == served


@pytest.mark.parametrize("flag", [[], ["--no-shared-prefix"]], ids=["default", "no-shared-prefix"])
def test_the_cli_serves_per_turn_rows_and_says_so_unless_told_not_to(tmp_path, monkeypatch, capsys, flag):
    from hidden_states.plan import planner
    from hidden_states.cli import main
    from hidden_states.fixtures.chat_templates import build_tokenizer

    model = build_tokenizer("llama3", tmp_path / "model")
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 4, "hidden_size": 8, "vocab_size": 512}))
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(chat(think)) + "\n" for think in (False, True)))
    made = fake_backends(monkeypatch, states=causal_states)
    monkeypatch.setattr(planner, "check_vllm", lambda backend, touched=None, speculators=True: "audit: not run (a fake backend)")

    rows = tmp_path / "rows.jsonl"  # speculators 0.5's rows (its layout's index needs `datasets`, absent here)
    assert main(["prepare", "--model-path", str(model), "--data", str(data), "--output", str(rows),
                 "--format", "speculators-0.5"]) == 0
    code = main(["extract", "--model-path", str(model), "--prepared-data", str(rows), "--output-dir",
                 str(tmp_path / "out"), "--format", "speculators-0.3", "--layer-ids", "1", "3", "--backend",
                 "speculators", "--batch-size", "6", "--skip-forward-check", *flag])

    err = capsys.readouterr().err
    assert code == 0, err
    assert len(list((tmp_path / "out").glob("data_*.pt"))) == 6
    if flag:
        assert len(rows_run(made)) == 6 and "shared prefixes" not in err
    else:  # each conversation's last turn runs; its two earlier turns are served from it
        assert len(rows_run(made)) == 2
        assert "shared prefixes: 4 of 6 rows served from a longer row's states" in err, err


def test_a_failed_batch_names_the_rows_served_from_it_too(job, monkeypatch):
    from hidden_states.run.summary import ExtractionFailed

    def fail(self, batch):
        raise RuntimeError("boom")

    monkeypatch.setattr(FakeBackend, "extract", fail)
    with pytest.raises(ExtractionFailed, match=r"extracting samples 0 \(line 1\), 1 \(line 2\), 2 \(line 3\), 3 "):
        Extraction(job, log=lambda line: None).run()
