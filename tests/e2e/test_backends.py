"""The extractor's backends on the same tiny model and samples: vllm-native (vLLM's own
extract_hidden_states, layer ids translated) and vllm-engine (our loop on vLLM's engine, speculators'
capture streamed per step; its own capture where speculators 0.3/0.4 is not installed) must find the
same hidden states as the speculators generator through the shim, and all must match HF. Where the
installed vLLM cannot run vllm-native, the extractor must say so clearly (exit 2), never hang or
crash. Three rows are the first tokens of the row after them (per-turn rows of one conversation):
each backend runs only the longer row, and the shorter one's file, cut from its states, must match HF
as every other row's does. Two rows of one batch begin with the same 300 tokens (a shared system
prompt): vllm-engine runs with vLLM's prefix cache on, and the second one's first rows, which its
forward skips, are copied from the first's."""
import json
import os
import re

import torch
from packaging.version import Version

import pytest

from tests.e2e import harness
from tests.e2e.extract_runs import data_files, extract_args, failure_line, run_cli, write_jsonl
from vllm_compat.versions import base, vllm_version

pytestmark = [pytest.mark.vllm, pytest.mark.e2e, pytest.mark.extractor, pytest.mark.backends]

VERSION = base(vllm_version())


SERVED = (1, 9, 17)  # each the first half of the row after it, in the same batch of 8
SYSTEM = (16, 18)  # the batch's first two rows to run (17 is served): they begin with the same 300 tokens


def with_prefixes(path, rows: list[dict]) -> list[dict]:
    """``rows`` with those of ``SYSTEM`` given a common beginning and each row of ``SERVED`` made the
    first half of the next row's tokens, rewritten to ``path``."""
    system = rows[0]["input_ids"][:300] + list(range(4, 4 + 300 - len(rows[0]["input_ids"][:300])))
    for i in SYSTEM:
        rows[i] = {"input_ids": system + rows[i]["input_ids"][:200]}
    for i in SERVED:
        longer = rows[i + 1]["input_ids"]
        rows[i] = {"input_ids": longer[: max(1, len(longer) // 2)]}
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    model = harness.tiny_model("llama")
    root = tmp_path_factory.mktemp("backends")
    rows = with_prefixes(root / "data.jsonl", write_jsonl(root / "data.jsonl", 24, seed=11))
    (root / "native-store").mkdir()
    runs = {backend: run_cli(*extract_args(model, root / "data.jsonl", root / backend, "--backend", backend),
                             env_extra={"VLLM_COMPAT_NATIVE_STORE": str(root / "native-store")})
            for backend in ("speculators", "vllm-native", "vllm-engine")}
    return model, root, rows, runs


def test_native_refuses_clearly_where_it_cannot_run(both):
    _, _, _, runs = both
    native = runs["vllm-native"]
    if VERSION < Version("0.17.0"):
        assert native.returncode == 2 and "--backend vllm-native needs vLLM >= 0.17.0" in native.stderr
    elif VERSION < Version("0.18.0"):  # the layers asked for include the last one
        assert native.returncode == 2 and "needs vLLM >= 0.18.0 with --backend vllm-native" in native.stderr
    else:
        assert native.returncode in (0, 2), native.stderr[-3000:]
        if native.returncode == 2:
            assert "CPU backend does not run speculative methods" in native.stderr


def test_same_states_from_both_backends(both):
    model, root, rows, runs = both
    if runs["vllm-native"].returncode != 0:
        pytest.skip(f"vllm-native cannot run on vLLM {VERSION} here (checked above)")
    assert runs["speculators"].returncode == 0, runs["speculators"].stderr[-3000:]
    assert sorted(data_files(root / "vllm-native")) == sorted(data_files(root / "speculators")) == list(range(24))
    from hidden_states.fixtures.reference import decoder_layer_outputs, load_model, relative_errors

    reference = decoder_layer_outputs(load_model(model), [r["input_ids"] for r in rows], [0, 2, 3, 5])
    for i in range(24):
        native = torch.load(root / "vllm-native" / f"data_{i}.pt", weights_only=True)
        generator = torch.load(root / "speculators" / f"data_{i}.pt", weights_only=True)
        assert native["input_ids"].tolist() == generator["input_ids"].tolist() == rows[i]["input_ids"]
        for a, b, ref in zip(native["hidden_states"], generator["hidden_states"], reference[i]):
            assert float(relative_errors(a, b).max()) < harness.paths_agree()
            assert float(relative_errors(a, ref).max()) < harness.TOLERANCE


def test_rows_that_begin_a_longer_row_are_served_from_its_states(both):
    """The rows' states against HF are checked with every row's above and below; here, that each
    backend that ran served them (the run's summary line)."""
    _, _, _, runs = both
    for backend, run in runs.items():
        if run.returncode == 0:
            assert f"shared prefixes: {len(SERVED)} of 24 rows served from a longer row's states" in run.stderr, backend
    assert runs["vllm-engine"].returncode == 0 and runs["speculators"].returncode == 0
    # the second SYSTEM row's first blocks (all of the 300 shared tokens a block holds) from vLLM's prefix cache
    cached = re.search(r"; ([\d,]+) from vLLM's prefix cache\)", runs["vllm-engine"].stderr)
    assert cached and 0 < int(cached.group(1).replace(",", "")) <= 300, runs["vllm-engine"].stderr[-2000:]


def test_native_store_is_the_named_one_and_left_empty(both, tmp_path):
    """The backend reads VLLM_COMPAT_NATIVE_STORE (a store it cannot use is an error naming the
    variable) and leaves nothing in the one it used."""
    model, root, _, runs = both
    if runs["vllm-native"].returncode != 0:
        pytest.skip(f"vllm-native cannot run on vLLM {VERSION} here (checked above)")
    assert list((root / "native-store").iterdir()) == []
    proc = run_cli(*extract_args(model, root / "data.jsonl", tmp_path / "out", "--backend", "vllm-native"),
                   env_extra={"VLLM_COMPAT_NATIVE_STORE": str(tmp_path / "no-such-dir")}, timeout=900)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"VLLM_COMPAT_NATIVE_STORE={tmp_path / 'no-such-dir'}: not a writable directory" in proc.stderr


def test_engine_backend_finds_the_generators_states(both):
    model, root, rows, runs = both
    assert runs["vllm-engine"].returncode == 0, runs["vllm-engine"].stderr[-3000:]
    assert runs["speculators"].returncode == 0, runs["speculators"].stderr[-3000:]
    assert sorted(data_files(root / "vllm-engine")) == list(range(24))
    # speculators 0.3.0 is on the path: its capture, so the shim's worker adapters stay exercised
    assert json.loads((root / "vllm-engine" / "data_config.json").read_text())["capture"] == "speculators"
    from hidden_states.fixtures.reference import decoder_layer_outputs, load_model, relative_errors

    reference = decoder_layer_outputs(load_model(model), [r["input_ids"] for r in rows], [0, 2, 3, 5])
    for i in range(24):
        engine = torch.load(root / "vllm-engine" / f"data_{i}.pt", weights_only=True)
        generator = torch.load(root / "speculators" / f"data_{i}.pt", weights_only=True)
        assert engine["input_ids"].tolist() == rows[i]["input_ids"]
        for a, b, ref in zip(engine["hidden_states"], generator["hidden_states"], reference[i], strict=True):
            assert a.shape == ref.shape
            assert float(relative_errors(a, b).max()) < harness.paths_agree()
            assert float(relative_errors(a, ref).max()) < harness.TOLERANCE


def test_engine_backend_places_prompts_split_over_steps(tmp_path):
    """Batches of long prompts, more tokens than one engine step takes: each prompt's chunks land
    in its own region at their positions (the states of a prompt run in pieces are still HF's).
    With the extractor's own capture (chosen by its variable: speculators 0.3.0 is on the path), so
    that it runs on every release this suite does; ``both`` runs speculators' capture."""
    model = harness.tiny_model("llama")
    rng = __import__("random").Random(19)
    rows = [[rng.randrange(4, 512) for _ in range(rng.randrange(900, 1024))] for _ in range(16)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps({"input_ids": ids}) + "\n" for ids in rows))
    proc = run_cli(*extract_args(model, tmp_path / "data.jsonl", tmp_path / "out", "--backend", "vllm-engine",
                                 "--batch-size", "16"), env_extra={"VLLM_COMPAT_ENGINE_CAPTURE": "own"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((tmp_path / "out" / "data_config.json").read_text())["capture"] == "own"
    from hidden_states.fixtures.reference import decoder_layer_outputs, load_model, relative_errors

    reference = decoder_layer_outputs(load_model(model), rows, [0, 2, 3, 5])
    for i, ids in enumerate(rows):
        saved = torch.load(tmp_path / "out" / f"data_{i}.pt", weights_only=True)
        assert saved["input_ids"].tolist() == ids
        for layer, ref in zip(saved["hidden_states"], reference[i], strict=True):
            assert float(relative_errors(layer, ref).max()) < harness.TOLERANCE


@pytest.mark.formats  # speculators 0.9.0 needs Python >= 3.11 and transformers >= 5: the matrix's 0.32.0 lane
def test_engine_backend_captures_with_its_own_beside_speculators_0_9(tmp_path):
    """A speculators 0.9 user (0.9 cannot be installed beside 0.4): no in-process speculators, so
    vllm-engine's own capture, chosen without being asked; every layer of every token is HF's, and
    the preflight audited the backend's own touch points (no generator to audit)."""
    from tests.conftest import ROOT
    from tests.e2e.trainers import speculators_09

    model = harness.tiny_model("llama")
    rows = write_jsonl(tmp_path / "data.jsonl", 24, seed=23)
    # the rest of the path stays (on the GPU machine vLLM comes from it), less any folder holding a
    # speculators package (0.3.0/0.4.0): a 0.9 user has none of them
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
            if p and not os.path.isdir(os.path.join(p, "speculators"))]
    env = {"PYTHONPATH": os.pathsep.join([str(speculators_09()), ROOT, *rest])}
    proc = run_cli(*extract_args(model, tmp_path / "data.jsonl", tmp_path / "out", "--backend", "vllm-engine",
                                 "--batch-size", "8"), env_extra=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "no generator: audit ok for --backend vllm-engine" in (tmp_path / "out" / "hidden-states.log").read_text()
    config = json.loads((tmp_path / "out" / "data_config.json").read_text())
    assert (config["capture"], config["capture_chosen_because"]) == (
        "own", "speculators 0.9.0 has no in-process capture")
    assert config["vllm_compat"]["speculators_version"] == "0.9.0"
    assert sorted(data_files(tmp_path / "out")) == list(range(24))
    from hidden_states.fixtures.reference import decoder_layer_outputs, load_model, relative_errors

    reference = decoder_layer_outputs(load_model(model), [r["input_ids"] for r in rows], [0, 2, 3, 5])
    for i in range(24):
        saved = torch.load(tmp_path / "out" / f"data_{i}.pt", weights_only=True)
        assert saved["input_ids"].tolist() == rows[i]["input_ids"]
        for layer, ref in zip(saved["hidden_states"], reference[i], strict=True):
            assert layer.shape == ref.shape
            assert float(relative_errors(layer, ref).max()) < harness.TOLERANCE


def test_native_on_this_host_needs_its_adapter(both, tmp_path):
    """Negative proof for native_connector_host_memory: without it, vLLM's connector asks for
    pinned memory on a host that has none, and the run fails (it must fail, not hang), as soon as
    the engine has: not when the wait for the file its dead engine never writes runs out."""
    model, root, _, runs = both
    if runs["vllm-native"].returncode != 0:
        pytest.skip(f"vllm-native cannot run on vLLM {VERSION} here (checked above)")
    from vllm_compat.registry import get

    if not get("native_connector_host_memory").host_probe()[0]:
        pytest.skip("this host has an accelerator: pinned memory works")
    proc = run_cli(*extract_args(model, root / "data.jsonl", tmp_path / "out", "--backend", "vllm-native"),
                   env_extra={"VLLM_COMPAT_DISABLE": "native_connector_host_memory"}, timeout=900)
    assert proc.returncode == 1
    assert "pin_memory" in proc.stderr or "EngineDeadError" in proc.stderr
    assert "did not finish writing" not in proc.stderr, proc.stderr[-3000:]  # vllm_native's 300 s timeout


# enough for the run to go on for seconds after its first files, or it ends before the kill lands
# (the feed's rate on CPU: docs/benchmarks.md, "CPU")
KILLED_ROWS = 640


@pytest.mark.faults
@pytest.mark.parametrize("backend", ["vllm-native", "vllm-engine"])
def test_a_killed_engine_core_ends_the_run_and_is_named(tmp_path, backend):
    """vLLM's engine core killed mid-run (the OOM killer's way): without the adapter
    sync_client_engine_dead, ``vllm.LLM`` waits for its outputs forever; with it the run ends, the
    error names the engine core and its signal, and the finished files stay whole."""
    import os
    import signal
    import subprocess
    import time

    from tests.conftest import ROOT
    from tests.e2e.extract_runs import cli
    from tests.e2e.process_tree import cmdline, descendants

    if backend == "vllm-native" and VERSION < Version("0.18.0"):
        pytest.skip(f"vLLM {VERSION} refuses --backend vllm-native (test_native_refuses_clearly_where_it_cannot_run)")
    model = harness.tiny_model("llama")
    rows = write_jsonl(tmp_path / "data.jsonl", KILLED_ROWS, seed=5)
    out = tmp_path / "out"
    command, env = cli(*extract_args(model, tmp_path / "data.jsonl", out, "--backend", backend,
                                     "--batch-size", "4"))
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while len(data_files(out)) < 4 if out.exists() else True:
            if proc.poll() is not None:
                err = proc.communicate()[1]
                if "CPU backend does not run speculative methods" in err:
                    pytest.skip(f"vllm-native cannot run on vLLM {VERSION} here")
                pytest.fail(err[-3000:])
            assert time.monotonic() < deadline, "no progress"
            time.sleep(0.2)
        # vLLM titles the engine core's process "VLLM::EngineCore" (setproctitle)
        cores = [pid for pid in descendants(proc.pid) if cmdline(pid).startswith(b"VLLM::EngineCore")]
        assert len(cores) == 1, {pid: cmdline(pid)[:80] for pid in descendants(proc.pid)}
        os.kill(cores[0], signal.SIGKILL)
        _, err = proc.communicate(timeout=120)  # without the adapter: TimeoutExpired, the run waits on
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 1, err[-3000:]
    failed = failure_line(err)
    assert re.search(rf"vLLM's process EngineCore\S* \(pid {cores[0]}\) was killed by SIGKILL", failed), failed
    survived = data_files(out)
    assert len(survived) >= 4
    for index in survived:  # every file kept is whole and holds its sample
        saved = torch.load(out / f"data_{index}.pt", weights_only=True)
        assert saved["input_ids"].tolist() == rows[index]["input_ids"]
    assert not list(out.glob(".tmp-*"))
