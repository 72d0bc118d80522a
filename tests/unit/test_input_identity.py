"""One input per output directory: what data_config.json records of the input and its tokenization,
the refusal of another input (and ``--start-over``), the directory a refused or failed run leaves,
a run stopped by a bad row (status, the corrected rerun), and the preflight's disk estimate per
input kind. With the small fake backend of test_extraction_stages; the real CLI runs in
tests/e2e/test_extractor.py."""
import hashlib
import json
import random
from dataclasses import replace
from pathlib import Path

import pytest

from hidden_states import backends
from hidden_states.inputs import identity
from hidden_states.plan.batches import ShardBatches
from hidden_states.shards import Shard
from hidden_states.cli import main
from hidden_states.errors import InputError, OutputError, PreflightError

pytest.importorskip("torch")

from hidden_states.extract.command import Extraction  # noqa: E402
from hidden_states.status import status  # noqa: E402
from tests.unit.fakes import FakeBackend, quiet  # noqa: E402


def rows_file(path: Path, lengths, bad_line: int | None = None) -> Path:
    lines = [json.dumps({"input_ids": [5] * n}) for n in lengths]
    if bad_line is not None:
        lines[bad_line - 1] = '{"input_ids": [5, "x"]}'
    path.write_text("".join(line + "\n" for line in lines))
    return path


def files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.is_file()}


def config(out) -> dict:
    return json.loads((Path(out) / "data_config.json").read_text())


def test_the_config_records_the_input_and_how_its_rows_were_made(job):
    Extraction(job, log=quiet).run()
    data = Path(job.prepared_data)
    recorded = config(job.output_dir)
    assert recorded["input"] == {"path": str(data), "resolved": str(data.resolve()), "container": "jsonl",
                                 "bytes": data.stat().st_size, "sha256": hashlib.sha256(data.read_bytes()).hexdigest()}
    assert recorded["tokenization"] == {"rows": "tokenized", "max_seq_len": job.max_seq_len}


def test_another_input_is_refused_naming_both_and_the_directory_is_left_as_it_was(job, tmp_path, capsys):
    Extraction(job, log=quiet).run()
    out = Path(job.output_dir)
    before = files(out)
    other = rows_file(tmp_path / "other.jsonl", [4, 4, 4])
    first = identity.describe_input(config(out)["input"])

    with pytest.raises(OutputError) as refused:
        Extraction(replace(job, prepared_data=str(other)), log=quiet).run()

    now = hashlib.sha256(other.read_bytes()).hexdigest()[:12]
    assert str(refused.value) == (
        f"{out} holds another extraction (input {first}; this run's {other} ({other.stat().st_size} B, sha256 {now})) with 6 finished "
        f"samples: use another --output-dir, or --start-over to remove its files and extract this one")
    assert f"sha256 {hashlib.sha256(Path(job.prepared_data).read_bytes()).hexdigest()[:12]}" in first
    assert files(out) == before
    # the CLI: one line, exit 2, before any model would load
    code = main(["extract", "--model-path", job.model_path, "--data", str(other), "--output-dir", str(out),
                 "--format", "speculators-0.3", "--layer-ids", "3", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith(f"hidden-states: error: {out} holds another extraction (input ")
    assert files(out) == before


def test_other_tokenization_is_refused(job):
    Extraction(job, log=quiet).run()
    with pytest.raises(OutputError, match=r"holds another extraction \(tokenization: max_seq_len 2048, this run 4\)"):
        Extraction(replace(job, max_seq_len=4), log=quiet).run()


def test_the_same_bytes_under_another_name_resume(job, tmp_path):
    Extraction(job, log=quiet).run()
    moved = tmp_path / "moved.jsonl"
    moved.write_bytes(Path(job.prepared_data).read_bytes())
    summary = Extraction(replace(job, prepared_data=str(moved)), log=quiet).run()
    assert (summary.extracted, summary.skipped) == (0, 6)
    assert config(job.output_dir)["input"]["resolved"] == str(moved.resolve())


def test_start_over_removes_only_the_other_extractions_files(job, tmp_path):
    Extraction(job, log=quiet).run()
    out = Path(job.output_dir)
    (out / "notes.txt").write_text("mine")
    other = rows_file(tmp_path / "other.jsonl", [4, 4, 4])
    said = []

    summary = Extraction(replace(job, prepared_data=str(other), start_over=True), log=said.append).run()

    assert summary.extracted == 3
    assert sorted(files(out)) == [".hidden-states.lock", "data_0.pt", "data_1.pt", "data_2.pt", "data_config.json",
                                  "done.jsonl", "notes.txt", "sample_lengths.json"]
    assert (out / ".hidden-states.lock").read_bytes() == b""  # the run that ended left no record in it
    assert json.loads((out / "sample_lengths.json").read_text()) == {"0": 4, "1": 4, "2": 4}
    assert config(out)["input"]["resolved"] == str(other.resolve())
    assert any("replaced the extraction it held (6 finished samples, input " in line for line in said)
    # the same command again (every shard of a run given it, say) resumes: nothing is removed twice
    again = Extraction(replace(job, prepared_data=str(other), start_over=True), log=quiet).run()
    assert (again.extracted, again.skipped) == (0, 3)


def test_a_run_refused_by_a_check_writes_nothing(job, monkeypatch):
    from hidden_states.plan import run_checks

    monkeypatch.setattr(run_checks.shutil, "disk_usage", lambda path: type("Usage", (), {"free": 0})())
    with pytest.raises(PreflightError, match="of hidden states expected"):
        Extraction(job, log=quiet).run()
    # the plan refuses before the directory is made
    assert not Path(job.output_dir).exists() or list(Path(job.output_dir).iterdir()) == []


def test_a_run_that_failed_before_its_first_sample_does_not_block_the_corrected_one(job, monkeypatch):
    def failing_start(self):
        raise RuntimeError("no device")

    monkeypatch.setattr(FakeBackend, "start", failing_start)
    with pytest.raises(RuntimeError):
        Extraction(replace(job, layer_ids=[0, 1]), log=quiet).run()
    out = Path(job.output_dir)
    assert config(out)["layer_ids"] == [0, 1] and (out / "sample_lengths.json").exists()
    monkeypatch.undo()
    monkeypatch.setattr(backends, "create", lambda name, settings: FakeBackend(settings))
    said = []

    summary = Extraction(job, log=said.append).run()

    assert summary.extracted == 6 and config(out)["layer_ids"] == [3, 1]
    assert any("replaced the extraction it held (no finished sample" in line for line in said)


def test_a_run_whose_directory_another_took_over_while_it_loaded_writes_nothing(job, tmp_path, monkeypatch):
    other = rows_file(tmp_path / "other.jsonl", [4, 4, 4])
    start = FakeBackend.start

    def taken_over_meanwhile(self):  # a shard given another input claims the empty directory
        claimer = Extraction(replace(job, prepared_data=str(other)), log=quiet, source=ShardBatches(Shard(1, 2, "test")))
        claimer.plan()
        claimer.prepared.prepare()
        claimer.prepared.unlock()
        return start(self)

    monkeypatch.setattr(FakeBackend, "start", taken_over_meanwhile)
    with pytest.raises(OutputError, match="another extraction took the directory over while the model loaded "
                                          "\\(input "):
        Extraction(job, log=quiet, source=ShardBatches(Shard(0, 2, "test"))).run()
    assert not list(Path(job.output_dir).glob("data_*.pt"))
    assert config(job.output_dir)["input"]["resolved"] == str(other.resolve())


def test_sample_files_without_a_config_are_refused(job):
    out = Path(job.output_dir)
    out.mkdir()
    (out / "data_0.pt").write_bytes(b"x" * 8 + b"PK\x05\x06" + bytes(18))
    with pytest.raises(OutputError, match="holds 1 sample files but no data_config.json"):
        Extraction(job, log=quiet).run()


def test_a_bad_row_stops_the_run_status_counts_up_to_it_and_the_corrected_input_continues(job, capsys):
    lengths = [3 + n % 6 for n in range(80)]
    data = rows_file(Path(job.prepared_data), lengths, bad_line=70)  # past the preflight's peek
    with pytest.raises(InputError, match=":70: input_ids\\[1\\] is 'x'"):
        Extraction(job, log=quiet).run()
    out = Path(job.output_dir)
    assert config(out)["input"]["stopped_at"]["line"] == 70

    said = status(out)
    assert f"the run stopped at {data}:70 (a bad row)" in said
    assert f"input {data.resolve()}: 69 samples before {data}:70: input_ids[1] is 'x', not an integer, where it " \
           f"stops; every one finished" in said
    assert main(["status", str(out)]) == 0 and "69 samples before" in capsys.readouterr().out

    # an input that differs before the bad row is another input
    rows_file(data, [4] + lengths[1:])
    with pytest.raises(OutputError, match="holds another extraction \\(input "):
        Extraction(job, log=quiet).run()
    # the input corrected at the bad row continues the extraction
    rows_file(data, lengths)
    summary = Extraction(job, log=quiet).run()
    assert (summary.extracted, summary.skipped) == (11, 69)
    assert "stopped_at" not in config(out)["input"] and "every one finished" in status(out)


def test_status_says_when_the_input_changed_since(job):
    Extraction(job, log=quiet).run()
    rows_file(Path(job.prepared_data), [9, 9])
    assert "changed since the extraction (now " in status(job.output_dir)


# --- the disk estimate, per input kind ---

LENGTHS = [random.Random(5).randrange(10, 60) for _ in range(300)]
MAX_SEQ_LEN = 50


def estimated(path, chat=None) -> tuple[int, int]:
    """(the preflight's token estimate, the tokens the input makes as extracted)."""
    from hidden_states.inputs.streams import InputStream
    from hidden_states.plan.run_checks import check_first_samples, estimate_tokens

    stream = InputStream(path, chat=chat)
    check_first_samples(stream)
    estimate = estimate_tokens(stream, MAX_SEQ_LEN)
    return estimate, sum(min(len(s.input_ids), MAX_SEQ_LEN) for s in InputStream(path, chat=chat))


def assert_close(estimate: int, actual: int) -> None:
    assert actual > 0 and abs(estimate - actual) / actual < 0.1, (estimate, actual)


def test_disk_estimate_of_jsonl_and_a_json_array(tmp_path):
    rows = [{"input_ids": [5] * n} for n in LENGTHS]
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    array = tmp_path / "rows.json"
    array.write_text(json.dumps(rows))
    assert_close(*estimated(jsonl))
    assert_close(*estimated(array))


@pytest.mark.datasets
def test_disk_estimate_of_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist([{"input_ids": [5] * n} for n in LENGTHS]), path, row_group_size=50)
    assert_close(*estimated(path))


@pytest.mark.datasets
def test_disk_estimate_and_hash_of_a_dataset_directory(tmp_path):
    import datasets
    from hidden_states.inputs.conversations import open_source

    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"input_ids": [5] * n}) + "\n" for n in LENGTHS))
    path = tmp_path / "saved"
    # as speculators' preprocessing makes one (Dataset.from_list pickles a pyarrow type some installs cannot)
    datasets.load_dataset("json", data_files=str(rows), split="train", cache_dir=str(tmp_path / "cache")) \
        .save_to_disk(str(path))
    assert_close(*estimated(path))  # was 0 B: a directory has no bytes read
    source = open_source(path, digest=True)
    data = [path / name for name in source.files]
    assert source.files and all(p.suffix == ".arrow" for p in data)
    assert source.size == sum(p.stat().st_size for p in data)
    assert source.sha256 == hashlib.sha256(b"".join(p.read_bytes() for p in data)).hexdigest()


def test_disk_estimate_of_conversations_counts_the_tokenized_rows(chat_model, tmp_path):
    from hidden_states.inputs.tokenization import ChatSettings

    rng = random.Random(3)
    words = "the quick brown fox jumps over lazy dog what is capital of France Paris".split()
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": " ".join(rng.choice(words) for _ in range(rng.randrange(2, 12)))},
        {"role": "assistant", "content": " ".join(rng.choice(words) for _ in range(rng.randrange(2, 12)))}]}) + "\n"
        for _ in range(300)))
    estimate, actual = estimated(path, ChatSettings(str(chat_model), "speculators-0.3", MAX_SEQ_LEN))
    assert_close(estimate, actual)


def test_conversations_record_the_tokenizer_and_layout(chat_model, tmp_path):
    from hidden_states.inputs.streams import InputStream
    from hidden_states.inputs.tokenization import ChatSettings

    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                             {"role": "assistant", "content": "hello"}]}) + "\n")
    stream = InputStream(path, chat=ChatSettings(str(chat_model), "speculators-0.3", 64), digest=True)
    stream.peek(1)
    _, tokenization = stream.identity(64)
    assert tokenization == {"rows": "conversations", "max_seq_len": 64, "layout": "speculators-0.3",
                            "tokenizer_sha256": identity.tokenizer_hash(chat_model), "unknown_roles": "skip"}
    before = tokenization["tokenizer_sha256"]
    template = next(p for p in (chat_model / "chat_template.jinja", chat_model / "tokenizer_config.json")
                    if p.exists() and "assistant" in p.read_text())
    template.write_text(template.read_text().replace("assistant", "Assistant", 1))
    assert identity.tokenizer_hash(chat_model) != before
