"""The extraction's stages and plug-ins (formats, batch sources) with a small fake backend; the real
vLLM runs in tests/e2e/test_extractor.py."""
import dataclasses
import json
import pathlib
import sys
import types
from pathlib import Path

import pytest

from hidden_states import backends
from hidden_states.output import formats
from hidden_states.plan.batches import Pending, Sequential, batched
from hidden_states.errors import InputError
from hidden_states.extract.command import Extraction
from hidden_states.output.formats.speculators_03 import Speculators03
from hidden_states.inputs.streams import InputStream, Sample
from hidden_states.plan.run_checks import FIRST_LINES
from hidden_states.settings import Settings, default
from tests.unit.fakes import FakeBackend, quiet

pytest.importorskip("torch")


def test_the_input_is_opened_once(job, monkeypatch):
    opened = []
    real = pathlib.Path.open

    def counting(self, *args, **kwargs):
        if self == Path(job.prepared_data):
            opened.append(args)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "open", counting)
    summary = Extraction(job, log=quiet).run()
    assert summary.extracted == 6
    assert len(opened) == 1, opened


def test_a_format_plug_in_gets_each_sample_its_states_in_listed_order_and_the_lengths(job, monkeypatch):
    seen = {"records": [], "finish": None}

    class Recording(Speculators03):
        name = "recording"

        def record(self, sample, states):
            seen["records"].append((sample.index, [int(state[0, 0]) for state in states]))
            return super().record(sample, states)

        def finish(self, lengths):
            seen["finish"] = lengths

    module = types.ModuleType("hidden_states.output.formats.recording")
    module.FORMAT = Recording
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(formats.FORMATS, "recording", "recording")
    job.format = "recording"

    Extraction(job, log=quiet).run()

    assert sorted(seen["records"]) == [(i, [3, 1]) for i in range(6)]
    assert seen["finish"] == {i: i + 3 for i in range(6)}
    config = json.loads((Path(job.output_dir) / "data_config.json").read_text())
    assert config["format"]["name"] == "recording"
    assert not (Path(job.output_dir) / "sample_lengths.json").exists()  # that file is speculators-0.3's


def test_a_rerun_in_another_format_is_refused(job):
    from hidden_states.errors import OutputError

    Extraction(job, log=quiet).run()
    config = Path(job.output_dir) / "data_config.json"
    written = json.loads(config.read_text())
    config.write_text(json.dumps({**written, "format": {**written["format"], "name": "speculators-0.5"}}))
    with pytest.raises(OutputError, match="holds another extraction \\(format 'speculators-0.5', this run "
                                          "'speculators-0.3'\\)"):
        Extraction(job, log=quiet).run()


def directory_bytes(directory: Path) -> dict[str, bytes]:
    return {str(path.relative_to(directory)): path.read_bytes() for path in sorted(directory.rglob("*")) if path.is_file()}


@pytest.mark.parametrize("first, then", [("speculators-0.3", "speculators-0.5"), ("speculators-0.5", "speculators-0.3")])
def test_a_rerun_in_another_format_over_the_real_files_of_the_first_is_refused_and_touches_nothing(
        job, first, then, monkeypatch):
    """The files of the first format's own layout lie on disk (written by its writer): the other
    format's pattern finds none of them, yet the directory holds finished work."""
    import importlib.util

    from hidden_states import extras
    from hidden_states.errors import OutputError
    from hidden_states.output.formats import speculators_05

    if importlib.util.find_spec("datasets") is None:  # the sample files are written all the same; not the index
        monkeypatch.setattr(extras, "require", lambda *args, **kwargs: None)
        monkeypatch.setattr(speculators_05, "write_dataset", lambda directory, count: None)
    Extraction(dataclasses.replace(job, format=first, layer_ids=[1, 3]), log=quiet).run()
    out = Path(job.output_dir)
    before = directory_bytes(out)
    assert sum(1 for name in before if name.endswith((".pt", ".safetensors"))) == 6
    other = dataclasses.replace(job, format=then, layer_ids=[1, 3])
    refused = f"holds another extraction \\(format '{first}', this run '{then}'\\) with 6 finished samples"
    with pytest.raises(OutputError, match=refused):
        Extraction(other, log=quiet).plan()  # `hidden-states plan` says so, before any load
    with pytest.raises(OutputError, match=refused):
        Extraction(other, log=quiet).run()
    assert directory_bytes(out) == before
    assert FakeBackend.created == 1  # the refused run loaded nothing

    Extraction(dataclasses.replace(other, start_over=True), log=quiet).run()  # the one way to replace it
    assert not any(name.endswith((".pt", ".safetensors")) and name in before for name in directory_bytes(out))


def test_start_over_in_a_directory_holding_both_layouts_removes_both(job, tmp_path, monkeypatch):
    """Files of the layout the config does not name are finished work too (check counts them): with
    --start-over they are removed with the rest, never resumed as this run's."""
    import importlib.util
    import shutil

    from hidden_states import extras
    from hidden_states.output.formats import speculators_05

    if importlib.util.find_spec("datasets") is None:  # the sample files are written all the same; not the index
        monkeypatch.setattr(extras, "require", lambda *args, **kwargs: None)
        monkeypatch.setattr(speculators_05, "write_dataset", lambda directory, count: None)
    elsewhere = tmp_path / "elsewhere"
    Extraction(dataclasses.replace(job, format="speculators-0.5", layer_ids=[1, 3], output_dir=str(elsewhere)),
               log=quiet).run()
    Extraction(dataclasses.replace(job, layer_ids=[1, 3]), log=quiet).run()
    out = Path(job.output_dir)
    shutil.copytree(elsewhere / "hidden_states", out / "hidden_states", dirs_exist_ok=True)
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps({"input_ids": [7] * n}) + "\n" for n in range(3, 7)))
    summary = Extraction(dataclasses.replace(job, format="speculators-0.5", layer_ids=[1, 3], prepared_data=str(other),
                                             start_over=True), log=quiet).run()
    assert (summary.extracted, summary.skipped) == (4, 0)
    assert not list(out.glob("data_*.pt")) and len(list((out / "hidden_states").iterdir())) == 4


class EverySecond(Sequential):
    """A replica mode taking the even sample indices, one per batch."""

    def __init__(self):
        self.batch_sizes = []

    def batches(self, pending, batch_size):
        for batch in batched(pending.samples(lambda index: index % 2 == 0), 1):
            self.batch_sizes.append(len(batch))
            yield batch

    def expected(self, todo):
        return todo // 2


def test_a_batch_source_decides_which_samples_this_process_extracts(job):
    source = EverySecond()
    summary = Extraction(job, log=quiet, source=source).run()
    assert sorted(p.name for p in Path(job.output_dir).glob("data_*.pt")) == ["data_0.pt", "data_2.pt", "data_4.pt"]
    assert source.batch_sizes == [1, 1, 1] and summary.extracted == 3

    # every mode shares resume: a sequential rerun extracts the rest, skips what the source did
    summary = Extraction(job, log=quiet).run()
    assert (summary.extracted, summary.skipped) == (3, 3)
    assert json.loads((Path(job.output_dir) / "sample_lengths.json").read_text()) == {
        str(i): i + 3 for i in range(6)}


def test_nothing_left_to_do_loads_no_model(job):
    Extraction(job, log=quiet).run()
    assert FakeBackend.created == 1
    summary = Extraction(job, log=quiet).run()
    assert (summary.extracted, summary.skipped) == (0, 6)
    assert FakeBackend.created == 1


def test_the_backend_gets_the_plans_layer_count(job, monkeypatch):
    seen = []
    monkeypatch.setattr(backends, "create", lambda name, settings: seen.append(settings) or FakeBackend(settings))
    Extraction(job, log=quiet).run()
    assert [s.num_layers for s in seen] == [4]  # the fake model's config.json, as the plan read it


def test_the_extraction_reads_the_plans_it_holds_not_copies(job):
    run = Extraction(job, log=quiet)
    run.plan()
    run.prepared.prepare()
    prepared = run.prepared
    plan = prepared.run_plan
    assert plan.model is prepared.model_plan and prepared.config is plan.config
    assert (prepared.facts, prepared.layers, prepared.format_layer_ids) == (plan.model.facts, plan.model.layers, [3, 1])
    replica = Extraction.executing(plan.for_replica(0), log=quiet)
    assert replica.prepared.model_plan is plan.model and replica.prepared.config is plan.config
    assert replica.summary.layer_ids == [3, 1] and replica.prepared.output.tag == "replica-0"


def test_the_plan_is_the_planners_held_whole(job):
    """The extraction keeps what the planner found and reads it there: the model's plan, the lines,
    the input stream it peeked at."""
    run = Extraction(job, log=quiet)
    run.plan()
    prepared = run.prepared
    assert prepared.model_plan is prepared.planned.model and prepared.plan_lines is prepared.planned.lines
    assert prepared.input is prepared.planned.input and prepared.identity is prepared.planned.identity
    assert prepared.identity["layer_ids"] == [3, 1] and prepared.plan_lines[0] == "backend: fake (--backend)"
    assert prepared.plan_lines[1].startswith("settings: --backend fake")


def test_data_config_records_the_models_settings_and_the_runs(job):
    """The model's settings and the run's are two dataclasses; data_config.json records them as one."""
    from hidden_states.settings import ModelSettings

    Extraction(job, log=quiet).run()
    recorded = json.loads((Path(job.output_dir) / "data_config.json").read_text())["settings"]
    assert {field.name for field in dataclasses.fields(ModelSettings)} < set(recorded)
    assert set(recorded) == {field.name for field in dataclasses.fields(job)} and len(recorded) == 30
    assert recorded["prepared_data"] == job.prepared_data and recorded["batch_size"] == 2


def test_a_replicas_plan_takes_cuda_graphs_to_its_backend_checked_once(job, monkeypatch):
    """``--cuda-graphs`` travels in the run's plan (pickled, as it crosses to a Ray actor) to the
    replica's backend, which starts vLLM compiled with the graph capture on the plan's word: it does
    not check the environment again (speculators' capture asked for there: the plan refused that)."""
    import pickle

    from hidden_states.backends.shared.graph_store import LAYERS_ENV
    from hidden_states.backends.vllm_engine import CAPTURE_ENV, GRAPH_EXTENSION, OWN, VllmEngineBackend
    from hidden_states.errors import UsageError

    run = Extraction(job, log=quiet)
    run.plan()
    run.prepared.prepare()
    planned = dataclasses.replace(run.prepared.run_plan, settings=dataclasses.replace(run.prepared.run_plan.settings,
                                                                             backend="vllm-engine", cuda_graphs=True))
    replica = pickle.loads(pickle.dumps(planned.for_replica(1)))
    monkeypatch.setenv(CAPTURE_ENV, "speculators")
    monkeypatch.delenv(LAYERS_ENV, raising=False)
    monkeypatch.delenv("VLLM_DISABLE_COMPILE_CACHE", raising=False)
    backend = VllmEngineBackend(replica.backend_settings())
    assert backend.prepare(None)["capture"] == OWN and backend.enforce_eager is False
    assert backend.llm_keywords() == {"worker_extension_cls": GRAPH_EXTENSION}
    # the negative: a plan without it leaves vLLM eager, and the capture to the environment (which
    # asks here for a capture that no installed speculators has)
    monkeypatch.setattr("vllm_compat.extractor_api.speculators_version", lambda: None)
    eager = VllmEngineBackend(run.prepared.run_plan.for_replica(1).backend_settings())
    assert eager.enforce_eager is True
    with pytest.raises(UsageError, match=f"{CAPTURE_ENV}=speculators"):
        eager.prepare(None)


def test_progress_lines_go_through_the_extractions_logger(job):
    job.progress_interval = 0
    said = []
    Extraction(job, log=said.append).run()
    progress = [line for line in said if " samples, " in line and "tok/s" in line]
    assert progress and progress[-1].startswith("6/6 samples"), said  # exact once the input is read


def test_the_range_and_the_plan_line(job):
    job.start_index, job.max_samples = 1, 3
    said = []
    summary = Extraction(job, log=said.append).run()
    assert summary.extracted == 3
    assert sorted(p.name for p in Path(job.output_dir).glob("data_*.pt")) == ["data_1.pt", "data_2.pt", "data_3.pt"]
    assert "3 samples in range, 0 already finished, 3 to extract" in "\n".join(said)


def test_a_jsonl_files_sample_count_is_estimated_while_streaming_and_exact_at_its_end(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"input_ids": [7] * 10}) + "\n" for _ in range(100)))
    stream = InputStream(data)
    assert [s.index for s in stream.peek(10)] == list(range(10))
    assert stream.expected_samples() == (100, False)
    assert [s.index for s in stream] == list(range(100))  # the peeked ones first, then the rest, once
    assert stream.expected_samples() == (100, True)


class _DropsSkip:
    """A chat tokenizer that makes one row of a text, none of a text "skip" (as a conversation whose
    every turn is dropped makes none)."""

    def rows(self, record, kind):
        text = record.value["text"]
        return [] if text == "skip" else [types.SimpleNamespace(input_ids=[len(text)], loss_mask=[1])]


def test_a_counted_inputs_estimate_counts_the_rows_that_made_no_sample(tmp_path):
    data = tmp_path / "data.json"
    data.write_text(json.dumps([{"text": "skip"}] + [{"text": "x" * 3}] * 9))  # 10 rows, 9 samples
    stream = InputStream(data, chat=types.SimpleNamespace(tokenizer=_DropsSkip))
    assert len(stream.peek(3)) == 3  # 4 rows read: 3 samples is not one per row
    assert stream.expected_samples() == (7, False)  # 3 + the 6 rows left at 3 samples per 4 rows
    assert len(list(stream)) == 9
    assert stream.expected_samples() == (9, True)


def test_a_bad_line_after_the_peek_first_hands_out_the_samples_before_it(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text('{"input_ids": [1]}\n' * 5 + '{"input_ids": ["x"]}\n' + '{"input_ids": [1]}\n')
    pending = Pending(InputStream(data), _settings(max_seq_len=8), set())
    batches = batched(pending.samples(), 2)
    assert [[s.index for s in next(batches)] for _ in range(3)] == [[0, 1], [2, 3], [4]]
    with pytest.raises(InputError, match=r"data.jsonl:6: input_ids\[0\] is 'x', not an integer"):
        next(batches)


def _settings(**fields) -> Settings:
    return Settings(model_path="m", prepared_data="d", output_dir="o", **fields)


def test_the_range_runs_from_start_index_up_to_but_not_including_start_index_plus_max_samples():
    ranged = _settings(start_index=2, max_samples=3)
    assert [index for index in range(8) if ranged.in_range(index)] == [2, 3, 4]
    assert ranged.end_index == 5 and not ranged.in_range(5) and ranged.in_range(4) and not ranged.in_range(1)
    to_the_end = _settings(start_index=2)
    assert not to_the_end.in_range(1) and to_the_end.in_range(2) and to_the_end.in_range(10**9)
    assert not any(_settings(start_index=2, max_samples=0).in_range(index) for index in range(8))


def test_pending_hands_out_the_range_and_stops_reading_at_its_end(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"input_ids": [1] * n}) + "\n" for n in range(1, 11)))
    stream = InputStream(data)
    pending = Pending(stream, _settings(start_index=3, max_samples=4), finished={4, 9})
    assert [s.index for s in pending.samples()] == [3, 5, 6]
    assert stream.samples_read == 8  # the first past the range (7) read, nothing after it
    assert (pending.skipped, pending.todo()) == (1, (3, True))


def test_pending_skips_finished_and_fits_lengths(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"input_ids": [1] * n, "loss_mask": [1] * n}) + "\n" for n in (2, 9, 3, 12)))
    pending = Pending(InputStream(data), _settings(max_seq_len=8), {2})
    got = list(pending.samples())
    assert [(s.index, len(s.input_ids), len(s.loss_mask)) for s in got] == [(0, 2, 2), (1, 8, 8), (3, 8, 8)]
    assert (pending.skipped, pending.truncated) == (1, 2)
    assert pending.todo() == (3, True)

    strict = Pending(InputStream(data), _settings(max_seq_len=8, strict=True), set())
    with pytest.raises(InputError, match=r"data.jsonl:2: 9 tokens, more than --max-seq-len 8 \(--strict\)"):
        list(strict.samples())


def test_every_default_is_the_settings_one():
    from hidden_states.cli import build_parser
    from hidden_states.cli.runs import settings_from

    args = build_parser().parse_args(["extract", "--model-path", "m", "--prepared-data", "d", "--output-dir", "o"])
    assert settings_from(args) == Settings(model_path="m", prepared_data="d", output_dir="o")
    preset = settings_from(build_parser().parse_args(["extract", "--model-path", "m", "--prepared-data", "d",
                                                      "--output-dir", "o", "--preset", "cpu-tiny"]))
    assert (preset.batch_size, preset.max_seq_len, preset.writer_threads) == (8, 1024, default("writer_threads"))
    h200 = ["extract", "--model-path", "m", "--prepared-data", "d", "--output-dir", "o", "--preset", "h200"]
    assert settings_from(build_parser().parse_args(h200)).writer_threads == 4
    assert settings_from(build_parser().parse_args([*h200, "--writer-threads", "2"])).writer_threads == 2
    native = [*h200, "--backend", "vllm-native"]  # the backend's own setting over the preset's, under a flag
    assert settings_from(build_parser().parse_args(native)).writer_threads == 1
    assert settings_from(build_parser().parse_args([*native, "--writer-threads", "3"])).writer_threads == 3


def test_a_library_caller_gets_the_backends_own_defaults():
    """Settings built without the CLI: a field left out takes the backend's own default, as the
    CLI's do; a value given stays."""
    paths = {"model_path": "m", "prepared_data": "d", "output_dir": "o"}
    assert Settings(**paths).writer_threads == default("writer_threads") == 2
    assert Settings(**paths, backend="vllm-native").writer_threads == default("writer_threads", "vllm-native") == 1
    assert Settings(**paths, backend="vllm-engine").writer_threads == 2
    assert Settings(**paths, backend="vllm-native", writer_threads=3).writer_threads == 3


def test_a_backends_own_defaults_are_applied_by_the_settings_alone():
    """Settings.tuned applies no backend default itself: it leaves the preset's value out and the
    settings fill the field. That holds only for a field whose default is None, which each is."""
    from hidden_states.settings import BACKEND_DEFAULTS

    paths = {"model_path": "m", "prepared_data": "d", "output_dir": "o"}
    defaults = {field.name: field.default for field in dataclasses.fields(Settings)}
    assert BACKEND_DEFAULTS
    for backend, own in BACKEND_DEFAULTS.items():
        for name, value in own.items():
            assert defaults[name] is None, f"{backend}'s {name}: the field's default must be None"
            assert getattr(Settings(**paths, backend=backend), name) == value
            assert getattr(Settings.tuned(backend, {name: value + 5}, **paths), name) == value
            assert getattr(Settings.tuned(backend, {name: value + 5}, {name: value + 6}, **paths), name) == value + 6


def test_a_sample_records_file_and_length_follow_the_format(tmp_path):
    format = formats.create("speculators-0.3", tmp_path, formats.Layers([1], 2, 8), log=quiet)
    record = format.record(Sample(4, 5, [1, 2, 3], None), [])
    assert (format.sample_file(4), format.sample_index("data_4.pt"), format.sample_index("data_4.pt.tmp")) == (
        "data_4.pt", 4, None)
    assert format.length(record) == 3 and record["loss_mask"].tolist() == [1, 1, 1]


class OverlappingBackend(FakeBackend):
    """Like the speculators backend with overlap: ``submit`` returns before the batch's states
    exist; here they are made when the loop first asks for them."""

    def __init__(self, settings):
        super().__init__(settings)
        self.futures = []
        self.unfinished_at_submit = []  # per submit: batches submitted earlier whose states nobody took yet

    def submit(self, batch):
        from concurrent.futures import Future

        backend = self

        class Later(Future):
            def result(self, timeout=None):
                if not self.done():
                    self.set_result(backend.extract(batch))
                return super().result(timeout)

        self.unfinished_at_submit.append(sum(not f.done() for f in self.futures))
        self.futures.append(Later())
        return self.futures[-1]


def test_a_batch_in_flight_is_written_when_bad_input_stops_the_run(job, monkeypatch):
    """The loop submits batch N+1 before it writes batch N; bad input met while reading the next
    batch still leaves every batch that ran on disk."""
    data = Path(job.prepared_data)  # the bad line past the preflight's peek: met in the loop
    good = FIRST_LINES + 6
    data.write_text("".join(json.dumps({"input_ids": [5] * 3}) + "\n" for _ in range(good)) + '{"input_ids": [5, 6\n')
    backends_made = []
    monkeypatch.setattr(backends, "create", lambda name, settings: backends_made.append(
        OverlappingBackend(settings)) or backends_made[-1])

    with pytest.raises(InputError, match=f"data.jsonl:{good + 1}: not valid JSON"):
        Extraction(job, log=quiet).run()

    assert sorted(p.name for p in Path(job.output_dir).glob("data_*.pt")) == sorted(f"data_{i}.pt" for i in range(good))
    assert backends_made[0].unfinished_at_submit == [0] + [1] * (good // 2 - 1)  # each submitted while one ran


class EngineLikeBackend(OverlappingBackend):
    """Like the engine backends: asks for ``tokens_ahead`` tokens submitted beyond the batch awaited."""

    tokens_ahead = 12


def test_batches_are_submitted_until_the_backends_tokens_ahead_are_in_flight(job, monkeypatch):
    backends_made = []
    monkeypatch.setattr(backends, "create", lambda name, settings: backends_made.append(
        EngineLikeBackend(settings)) or backends_made[-1])

    summary = Extraction(job, log=quiet).run()

    assert summary.extracted == 6
    assert sorted(p.name for p in Path(job.output_dir).glob("data_*.pt")) == [f"data_{i}.pt" for i in range(6)]
    # batches of 7, 11 and 15 tokens: the first is awaited only once 12 tokens are submitted after it,
    # so the third is submitted while both others run (one batch ahead: [0, 1, 1])
    assert backends_made[0].unfinished_at_submit == [0, 1, 2]


def test_submit_groups_keep_order_and_hold_at_most_the_tokens_asked():
    from hidden_states.extract.rows import submit_groups

    batch = [Sample(i, i, [5] * n, None) for i, n in enumerate([3, 4, 5, 9, 2, 2, 4])]
    grouped = submit_groups(batch, 8)
    assert [[len(s.input_ids) for s in group] for group in grouped] == [[3, 4], [5], [9], [2, 2, 4]]
    assert [s for group in grouped for s in group] == batch  # a sample longer than 8 goes alone
    assert submit_groups(batch, None) == [batch]


class StepSizedBackend(OverlappingBackend):
    """Like the engine backends: asks for groups of at most one engine step's tokens."""

    tokens_ahead = 8
    tokens_per_submit = 8

    def __init__(self, settings):
        super().__init__(settings)
        self.submitted: list[list[int]] = []

    def submit(self, batch):
        self.submitted.append([len(ids) for ids in batch])
        return super().submit(batch)


def test_a_batch_goes_to_an_engine_backend_in_groups_of_one_step(job, monkeypatch):
    """The run's last states written after its last forward are one step's, whatever --batch-size:
    a batch of six samples (3..8 tokens) is submitted as five groups of at most 8 tokens (each would be
    served from the longest without --no-shared-prefix: their ids are all 5)."""
    backends_made = []
    monkeypatch.setattr(backends, "create", lambda name, settings: backends_made.append(
        StepSizedBackend(settings)) or backends_made[-1])

    summary = Extraction(dataclasses.replace(job, batch_size=6, share_prefixes=False), log=quiet).run()

    assert backends_made[0].submitted == [[3, 4], [5], [6], [7], [8]]
    assert summary.extracted == 6 and summary.tokens == sum(range(3, 9))
    assert sorted(p.name for p in Path(job.output_dir).glob("data_*.pt")) == [f"data_{i}.pt" for i in range(6)]
    # each group is written once 8 tokens are submitted after it, while those run
    assert backends_made[0].unfinished_at_submit == [0, 1, 2, 2, 2]
