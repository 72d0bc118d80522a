"""bench/provenance.py: what every bench record says about where it came from (commit, dirty tree,
the COMMIT file of an exported tree, versions), and that every bench script writing records asks it."""
import ast
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

import vllm_compat

from tests.conftest import ROOT as _ROOT

ROOT = Path(_ROOT)

_spec = importlib.util.spec_from_file_location("bench_provenance", ROOT / "bench" / "provenance.py")
provenance = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(provenance)

# functions that write JSON which is not a result record: inputs a run reads, and the raw event
# streams bench/steps.py and bench/timeline.py turn into records (which carry the provenance)
NOT_RECORDS = {
    ("bench/gpu.py", "write_jsonl"): "the rows a run reads (data.jsonl, rows.jsonl)",
    ("bench/gpu.py", "phase_generate"): "the prompts a generate run reads",
    ("bench/gpu.py", "note_timed_span"): "the timed span's event, read back by bench/steps.py",
    ("bench/fp8_training.py", "write_samples"): "the samples the extractor reads",
    ("bench/serve.py", "prepared"): "the rows speculators' client reads",
    ("bench/timeline_hook/step_events.py", "install"): "step events, read back by bench/steps.py",
    ("bench/timeline_hook/step_events.py", "_write"): "step events, read back by bench/steps.py",
    ("bench/timeline_hook/step_events.py", "note"): "step events, read back by bench/steps.py",
    ("bench/timeline_hook/timeline_spans.py", "close"): "worker spans, read back by bench/timeline.py",
}


def git(cwd, *args):
    subprocess.run(["git", "-c", "user.name=bench", "-c", "user.email=bench@example.com", *args], cwd=cwd,
                   check=True, capture_output=True)


@pytest.fixture
def outside_git(monkeypatch, tmp_path):
    # a folder git must not find a repository above (the test's tmp_path may lie inside one)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    return tmp_path


def test_a_clean_checkout_then_a_changed_file_is_reported_dirty(outside_git):
    repo = outside_git / "repo"
    repo.mkdir()
    (repo / "a.py").write_text("x = 1\n")
    git(repo, "init", "-q")
    git(repo, "add", "a.py")
    git(repo, "commit", "-q", "-m", "one")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()
    (repo / "results.jsonl").write_text("{}\n")  # an untracked result written by the run: still clean
    assert provenance.source(repo) == {"commit": head, "dirty": False, "commit_source": "git"}
    (repo / "a.py").write_text("x = 2\n")
    assert provenance.source(repo) == {"commit": head, "dirty": True, "commit_source": "git"}


def test_an_exported_tree_is_read_from_its_commit_file_else_unknown(outside_git):
    assert provenance.source(outside_git) == {"commit": "unknown", "dirty": None, "commit_source": "unknown"}
    (outside_git / "COMMIT").write_text("0123456789abcdef0123456789abcdef01234567\n")
    assert provenance.source(outside_git) == {"commit": "0123456789abcdef0123456789abcdef01234567", "dirty": False,
                                              "commit_source": "COMMIT file"}
    # as `git describe --always --dirty --abbrev=40` writes it for a tree with changes
    (outside_git / "COMMIT").write_text("0123456789abcdef0123456789abcdef01234567-dirty\n")
    assert provenance.source(outside_git) == {"commit": "0123456789abcdef0123456789abcdef01234567", "dirty": True,
                                              "commit_source": "COMMIT file"}


def test_a_package_not_installed_is_none_and_nothing_raises(monkeypatch):
    monkeypatch.setitem(provenance.PACKAGES, "speculators", ("no-such-distribution-xyz",))
    monkeypatch.setattr(provenance, "nvidia_smi", lambda: None)
    record = provenance.provenance({"backend": "vllm-engine", "batch": 8, "writer_threads": 4})
    assert record["versions"]["speculators"] is None
    assert record["versions"]["python"] == ".".join(map(str, sys.version_info[:3]))
    # the measured code's version, not the one an editable install recorded when it was installed
    assert record["versions"]["vllm-compat"] == vllm_compat.__version__
    assert record["settings"] == {"backend": "vllm-engine", "batch": 8, "writer_threads": 4}
    assert record["utc"].endswith("Z") and record["argv"] == sys.argv
    assert set(record["hardware"]) == {"cpu", "cpus", "gpu", "gpus", "driver"}
    json.dumps(record)  # a record is JSON


def test_nvidia_smi_gives_the_gpu_its_count_and_driver(monkeypatch):
    listed = subprocess.CompletedProcess([], 0, stdout="NVIDIA H100 80GB HBM3, 570.86\nNVIDIA H100 80GB HBM3, 570.86\n")
    monkeypatch.setattr(provenance.subprocess, "run", lambda *a, **k: listed)
    assert provenance.nvidia_smi() == {"gpu": "NVIDIA H100 80GB HBM3", "gpus": 2, "driver": "570.86"}

    def missing(*a, **k):
        raise FileNotFoundError("nvidia-smi")

    monkeypatch.setattr(provenance.subprocess, "run", missing)
    assert provenance.nvidia_smi() is None


def json_writers(path):
    """The functions of ``path`` that write json.dumps(...) into a file (``.write`` / ``.write_text``)."""
    for fn in ast.walk(ast.parse(path.read_text())):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(
                isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                and call.func.attr in ("write", "write_text")
                and any(isinstance(inner, ast.Call) and isinstance(inner.func, ast.Attribute)
                        and inner.func.attr == "dumps" for arg in call.args for inner in ast.walk(arg))
                for call in ast.walk(fn)):
            yield fn


def calls(fn) -> set[str]:
    return {c.func.id if isinstance(c.func, ast.Name) else getattr(c.func, "attr", None)
            for c in ast.walk(fn) if isinstance(c, ast.Call)}


def test_every_bench_function_that_writes_records_asks_for_their_provenance():
    found, missing = set(), []
    for path in sorted((ROOT / "bench").rglob("*.py")):
        name = path.relative_to(ROOT).as_posix()
        for fn in json_writers(path):
            found.add((name, fn.name))
            if (name, fn.name) not in NOT_RECORDS and "provenance" not in calls(fn):
                missing.append(f"{name}: {fn.name}")
    assert not missing, "these write records without provenance(...) (bench/provenance.py): " + ", ".join(missing)
    assert set(NOT_RECORDS) <= found, f"NOT_RECORDS names functions that no longer write JSON: {set(NOT_RECORDS) - found}"
    # the record writers this guards today, so that the scan itself cannot go blind
    assert {("bench/gpu.py", "emit"), ("bench/certificates.py", "main"), ("bench/host_copy.py", "main"),
            ("bench/fp8_training.py", "main")} <= found


def test_the_scripts_that_emit_through_gpu_py_hand_it_their_settings():
    # serve.py, steps.py and timeline.py write their records through bench/gpu.py's emit: its provenance
    # takes their settings from gpu.SETTINGS, which each fills
    for script in ("gpu.py", "serve.py", "steps.py", "timeline.py"):
        source = (ROOT / "bench" / script).read_text()
        assert "SETTINGS.update(vars(args))" in source or 'SETTINGS["runs"]' in source, script
