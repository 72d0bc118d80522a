"""``python -m hidden_states.train``'s choices before any trainer runs: the releases it refuses, the
flags it takes from the extraction it trains on (tests/e2e/test_formats.py and test_serve.py train
through it with speculators 0.9.0 and 0.3.0)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hidden_states import train
from tests.conftest import ROOT


def fake_speculators(root, version: str) -> str:
    """A folder holding an empty ``speculators`` package of ``version`` (its dist-info says it)."""
    (root / "speculators").mkdir()
    (root / "speculators" / "__init__.py").write_text("")
    info = root / f"speculators-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: speculators\nVersion: {version}\n")
    return str(root)


@pytest.mark.parametrize("version", ["0.5.0", "0.7.1", "1.0.0"])
def test_a_release_it_does_not_know_is_refused_in_one_line(tmp_path, version):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([fake_speculators(tmp_path, version), ROOT])}
    proc = subprocess.run([sys.executable, "-m", "hidden_states.train", "--data-path", "x"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and f"speculators {version} is not supported: 0.8/0.9" in lines[0], lines


def test_0_3s_trainer_refuses_a_missing_data_path_before_loading_anything(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([fake_speculators(tmp_path, "0.3.0"), ROOT])}
    proc = subprocess.run([sys.executable, "-m", "hidden_states.train", "--data-path", str(tmp_path / "none"),
                           "--verifier-name-or-path", "m"], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip() == (
        f"python -m hidden_states.train: --data-path {tmp_path / 'none'}: no such directory"), proc.stderr


def write_extraction(root, state_dtype="bf16", name="speculators-0.5"):
    root.mkdir()
    (root / "data_config.json").write_text(json.dumps(
        {"format": {"name": name, "layer_ids": [3, 4, 6], "state_dtype": state_dtype}}))
    return str(root)


def test_the_target_layers_come_from_the_extraction_when_not_given(tmp_path, capsys):
    data = write_extraction(tmp_path / "out")
    assert train.flags_from_extraction(["--data-path", data]) == ["--target-layer-ids", "3", "4"]
    assert "--target-layer-ids 3 4" in capsys.readouterr().err
    assert train.flags_from_extraction([f"--data-path={data}", "--target-layer-ids", "1", "2"]) == []


def test_fp8_states_add_their_backend_unless_given(tmp_path):
    data = write_extraction(tmp_path / "out", state_dtype="fp8")
    assert train.flags_from_extraction(["--data-path", data, "--target-layer-ids", "3"]) == [
        "--hidden-states-backend", "fp8"]
    assert train.flags_from_extraction(["--data-path", data, "--target-layer-ids", "3",
                                        "--hidden-states-backend", "file"]) == []


def test_other_directories_add_nothing(tmp_path):
    assert train.flags_from_extraction(["--data-path", str(tmp_path)]) == []  # no data_config.json
    assert train.flags_from_extraction(["--data-path", write_extraction(tmp_path / "o3", name="speculators-0.3")]) == []
    assert train.flags_from_extraction(["--epochs", "1"]) == []


def test_0_3s_trainer_reads_the_sample_files_alone_by_index(tmp_path):
    """speculators 0.3/0.4's dataset, given the directory, loads every .pt under it: the token_freq.pt an
    older version wrote beside an extraction of conversations stopped their training (KeyError:
    'hidden_states'). It gets the samples."""
    for name in ("data_10.pt", "data_2.pt", "token_freq.pt", "data_0.pt", "notes.pt", "done.jsonl"):
        (tmp_path / name).write_bytes(b"")
    assert train.sample_files(str(tmp_path)) == [str(tmp_path / f"data_{i}.pt") for i in (0, 2, 10)]


def test_0_3s_trainer_refuses_a_directory_without_samples_in_one_line(tmp_path):
    (tmp_path / "token_freq.pt").write_bytes(b"")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([fake_speculators(tmp_path, "0.3.0"), ROOT])}
    proc = subprocess.run([sys.executable, "-m", "hidden_states.train", "--data-path", str(tmp_path),
                           "--verifier-name-or-path", "m"], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip() == (
        f"python -m hidden_states.train: --data-path {tmp_path}: no sample files (data_<i>.pt) in it: an "
        f"extraction with --format speculators-0.3 writes them"), proc.stderr


def test_0_9s_command_where_0_3_is_installed_says_which_speculators_it_needs(tmp_path):
    """speculators 0.9's documented command run in the demo's environment (speculators 0.3.0): one line
    naming the flags 0.3's trainer does not know and where an environment with 0.9 comes from."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([fake_speculators(tmp_path, "0.3.0"), ROOT])}
    proc = subprocess.run([sys.executable, "-m", "hidden_states.train", "--speculator-type", "eagle3",
                           "--verifier-name-or-path", "m", "--data-path", str(tmp_path), "--on-missing", "raise",
                           "--epochs", "2"], env=env, capture_output=True, text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("python -m hidden_states.train: --speculator-type --on-missing: not a flag of "
                               "speculators 0.3.0's trainer"), lines
    assert "environment with speculators 0.9 (docs/getting-started.md" in lines[0], lines
