"""``hidden-states verify OUT --engine`` on rows written without a certificate (both layouts, FP8 too),
against an engine stand-in that answers as vLLM's bfloat16 path rounds: right rows hold and get their
certificate written (a plain ``verify`` holds them later, their states untouched), a row changed after
it was written is named and left as it was, certified rows are not asked again."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")  # the requests' SamplingParams

from hidden_states import verify_engine  # noqa: E402
from hidden_states.certify.certificate import PROBE_SLACK  # noqa: E402
from hidden_states.certify.certifier import Certifier  # noqa: E402
from hidden_states.certify.head import FinalHead  # noqa: E402
from hidden_states.certify.witness import probe_positions  # noqa: E402
from hidden_states.errors import OutputError  # noqa: E402
from hidden_states.output import formats  # noqa: E402
from hidden_states.output.sample_rows import file_tensors  # noqa: E402
from hidden_states.verify import verify  # noqa: E402
from tests.unit.certified_model import ROWS, FakeEngine, row_ids, write_run  # noqa: E402


def checked(out, engine=None):
    lines = []
    code = verify(out, lines.append, engine=None if engine is None else (lambda settings: engine))
    return code, lines


def head_of(out):
    return FinalHead.load(out.parent / "model")


def states_of(out, name):
    files = formats.sample_files(name, out)
    held = {index: file_tensors(name, path)["hidden_states"] for index, path in files.items()}
    return {index: torch.stack(states) if isinstance(states, list) else states for index, states in held.items()}


@pytest.mark.parametrize("name, state_dtype", [("speculators-0.3", "model"), ("speculators-0.5", "model"),
                                               ("speculators-0.5", "fp8")])
def test_uncertified_rows_are_certified_and_keep_their_certificates(tmp_path, name, state_dtype):
    out = write_run(tmp_path, name, state_dtype, certified=[])
    before = states_of(out, name)
    assert checked(out)[0] == 1  # none carries a certificate
    code, lines = checked(out, FakeEngine(head_of(out)))
    assert code == 0, lines
    assert lines[-1] == f"verify: ok: {ROWS} certified rows hold the engine's states", lines
    assert f"  the engine: {ROWS} of {ROWS} rows hold, their certificates written into their files" in lines[-5]
    code, lines = checked(out)  # no engine: the certificates it wrote
    assert code == 0 and lines[-1] == f"verify: ok: {ROWS} certified rows hold the engine's states", lines
    after = states_of(out, name)
    for index, states in before.items():
        assert after[index].dtype == states.dtype
        assert torch.equal(after[index].view(torch.uint8), states.view(torch.uint8)), index
    assert not [p for p in out.rglob("*") if p.name.startswith(".tmp-")]


def test_a_row_changed_after_it_was_written_is_named_and_left_as_it_was(tmp_path):
    out = write_run(tmp_path, "speculators-0.3", certified=[])
    record = torch.load(out / "data_2.pt", weights_only=True)
    record["hidden_states"] = [torch.roll(layer, 1, dims=0) for layer in record["hidden_states"]]
    torch.save(record, out / "data_2.pt")
    tampered = (out / "data_2.pt").read_bytes()
    code, lines = checked(out, FakeEngine(head_of(out)))
    assert code == 1, lines
    assert lines[-1] == f"verify: 1 of {ROWS} rows fail: 2"
    assert any(line.startswith("  row 2: data_2.pt: its written last-layer state is not the engine's (position ")
               for line in lines), lines
    assert (out / "data_2.pt").read_bytes() == tampered  # no certificate for a row that does not hold
    code, lines = checked(out)
    assert code == 0 and lines[-1] == f"verify: ok: {ROWS - 1} certified rows hold the engine's states (1 rows " \
                                      f"uncertified)", lines


def test_only_uncertified_rows_are_asked_whole_first_then_their_probes(tmp_path):
    out = write_run(tmp_path, "speculators-0.3", certified=[0, 1, 2])
    engine = FakeEngine(head_of(out))
    code, lines = checked(out, engine)
    assert code == 0, lines
    whole, probes = engine.prompts  # one pass: the rows, then the probes (the prefix cache holds their blocks)
    assert whole == [row_ids(index) for index in (3, 4, 5)]
    assert probes == [row_ids(index)[:p + 1] for index in (3, 4, 5) for p in probe_positions(row_ids(index))]


def test_every_position_of_a_witness_after_the_fact_is_allowed_a_probes_slack(tmp_path):
    out = write_run(tmp_path, "speculators-0.3", certified=[])
    rows = [row_ids(index) for index in range(ROWS)]
    for ids, witness in zip(rows, verify_engine.witness_rows(FakeEngine(head_of(out)), rows), strict=True):
        assert witness.positions == [*probe_positions(ids), len(ids) - 1]
        assert witness.tensors()[3].tolist() == [PROBE_SLACK] * len(witness.positions)


def test_the_engine_runs_as_the_extraction_did():
    settings = verify_engine.engine_settings({"settings": {"max_seq_len": 1024, "tp_size": 2,
                                                            "gpu_memory_utilization": 0.5}}, "/models/m")
    assert (settings.model_path, settings.max_seq_len, settings.tp_size, settings.gpu_memory_utilization,
            settings.trust_remote_code) == ("/models/m", 1024, 2, 0.5, False)
    assert verify_engine.engine_settings({}, "/m").max_seq_len == 2048  # none recorded: the extractor's default


def test_a_certificate_that_cannot_be_written_leaves_the_row_as_it_was(tmp_path, monkeypatch):
    out = write_run(tmp_path, "speculators-0.3", certified=[])
    held = (out / "data_0.pt").read_bytes()

    def cut_short(value, handle):
        handle.write(b"half a file")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", cut_short)
    with pytest.raises(OutputError, match="no space left on device"):
        checked(out, FakeEngine(head_of(out)))
    assert (out / "data_0.pt").read_bytes() == held
    assert not [p for p in out.iterdir() if p.name.startswith(".tmp-")]


def test_the_command_line_certifies_with_its_flag(tmp_path, monkeypatch, capsys):
    from hidden_states.cli import main

    out = write_run(tmp_path, "speculators-0.3", certified=[])
    monkeypatch.setattr(verify_engine, "open_engine", lambda settings: FakeEngine(head_of(out)))
    assert main(["verify", str(out)]) == 1
    assert main(["verify", str(out), "--engine"]) == 0
    assert capsys.readouterr().err.strip().splitlines()[-1] == \
        f"[hidden-states] verify: ok: {ROWS} certified rows hold the engine's states"


def test_a_run_whose_backend_does_not_certify_names_the_command_that_does():
    lines = []
    settings = SimpleNamespace(certificates=True, backend="speculators", output_dir="/data/out")
    assert Certifier.for_model(settings, None, SimpleNamespace(certifies=False), [], lines.append) is None
    assert lines == ["certificates: not during the run with --backend speculators: hidden-states verify /data/out "
                     "--engine certifies its rows after it (--backend vllm-engine certifies them as it writes them)"]


def test_a_row_whose_states_and_ids_differ_in_length_is_named_not_asked(tmp_path):
    out = write_run(tmp_path, "speculators-0.3", certified=[])
    record = torch.load(out / "data_1.pt", weights_only=True)
    record["hidden_states"] = [layer[:-3] for layer in record["hidden_states"]]
    torch.save(record, out / "data_1.pt")
    engine = FakeEngine(head_of(out))
    code, lines = checked(out, engine)
    assert code == 1 and lines[-1] == f"verify: 1 of {ROWS} rows fail: 1", lines
    length = len(row_ids(1))
    assert f"  row 1: data_1.pt: {length} token ids, {length - 3} states: cannot be certified" in lines
    assert row_ids(1) not in engine.prompts[0]


def test_without_the_last_layer_nothing_can_be_certified_and_the_engine_never_starts(tmp_path):
    import json

    from hidden_states.errors import UsageError

    out = write_run(tmp_path, "speculators-0.3", certified=[])
    config = json.loads((out / "data_config.json").read_text())
    (out / "data_config.json").write_text(json.dumps({**config, "layer_ids": [0, 1, 2]}))

    def never(settings):
        raise AssertionError("the engine started")

    with pytest.raises(UsageError, match=r"the last decoder layer \(3\) is not among the written layers \[0, 1, 2\]: "
                                         r"no row of it can be certified"):
        verify(out, lambda line: None, engine=never)
