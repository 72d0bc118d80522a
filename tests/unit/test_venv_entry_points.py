"""scripts/vllm_venv.py: a reused venv whose installed entry points differ from pyproject.toml gets the
editable install again (--no-deps, no rebuild), so a new entry-point group (vllm_compat.touchpoints)
is visible in the cached CI venvs; one whose entry points match is left alone."""
import importlib.util
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

spec = importlib.util.spec_from_file_location("vllm_venv_script", f"{ROOT}/scripts/vllm_venv.py")
vllm_venv = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = vllm_venv
spec.loader.exec_module(vllm_venv)

PYPROJECT = ('[project]\nname = "vllm-compat"\n\n[project.scripts]\nvllm-compat = "vllm_compat.cli:main"\n\n'
             '[project.entry-points."vllm.general_plugins"]\nvllm_compat = "vllm_compat.plugin:register"\n\n'
             '[project.entry-points."vllm_compat.touchpoints"]\nvllm-engine = "hidden_states.backends.vllm_engine:TOUCHPOINTS"\n')
OLD = "[console_scripts]\nvllm-compat = vllm_compat.cli:main\n\n[vllm.general_plugins]\nvllm_compat = vllm_compat.plugin:register\n"
CURRENT = OLD + "\n[vllm_compat.touchpoints]\nvllm-engine = hidden_states.backends.vllm_engine:TOUCHPOINTS\n"


def venv_with(tmp_path: Path, entry_points: str | None) -> Path:
    venv = tmp_path / "venvs" / "vllm-0.32.0"
    info = venv / "lib" / "python3.11" / "site-packages" / "vllm_compat-0.1.0.dist-info"
    info.mkdir(parents=True)
    if entry_points is not None:
        (info / "entry_points.txt").write_text(entry_points)
    return venv


@pytest.fixture
def pyproject(tmp_path):
    path = tmp_path / "pyproject.toml"
    path.write_text(PYPROJECT)
    return path


def test_a_venv_installed_before_a_new_group_is_stale(tmp_path, pyproject):
    assert vllm_venv.stale_entry_points(venv_with(tmp_path / "a", OLD), pyproject) == "vllm_compat.touchpoints"
    assert vllm_venv.stale_entry_points(venv_with(tmp_path / "b", CURRENT), pyproject) == ""
    changed = CURRENT.replace("vllm_engine:TOUCHPOINTS", "vllm_engine:OTHER")
    assert vllm_venv.stale_entry_points(venv_with(tmp_path / "c", changed), pyproject) == "vllm_compat.touchpoints"
    assert vllm_venv.stale_entry_points(venv_with(tmp_path / "d", None), pyproject) != ""
    assert vllm_venv.stale_entry_points(tmp_path / "nothing", pyproject) == "no vllm_compat dist-info"


@pytest.mark.parametrize("installed, reinstalls", [(OLD, True), (CURRENT, False)])
def test_a_reused_venv_is_reinstalled_editable_only_when_its_entry_points_are_stale(tmp_path, pyproject, monkeypatch,
                                                                                   installed, reinstalls):
    venv = venv_with(tmp_path, installed)
    (venv / ".complete").write_text("KEY\n")
    ran = []
    monkeypatch.setattr(vllm_venv, "CACHE", tmp_path)
    monkeypatch.setattr(vllm_venv, "download_vllm_wheel", lambda *a: tmp_path / "vllm.whl")
    monkeypatch.setattr(vllm_venv, "wheel_requirements", lambda wheel: [])
    monkeypatch.setattr(vllm_venv, "torch_pin", lambda reqs: "2.9.0")
    monkeypatch.setattr(vllm_venv, "find_links", lambda: [])
    monkeypatch.setattr(vllm_venv, "available_locally", lambda *a: True)
    monkeypatch.setattr(vllm_venv, "recipe", lambda *a: "KEY")
    monkeypatch.setattr(vllm_venv, "compile_bytecode", lambda *a: None)
    monkeypatch.setattr(vllm_venv, "uv", lambda: "uv")
    monkeypatch.setattr(vllm_venv, "run", lambda *cmd, **kw: ran.append(cmd))
    monkeypatch.setattr(vllm_venv, "stale_entry_points", lambda v: STALE(v, pyproject))
    assert vllm_venv.build_venv("0.32.0", rebuild=False) == venv / "bin" / "python"
    assert ran == ([("uv", "pip", "install", "-q", "--python", str(venv / "bin" / "python"), "--no-deps", "-e",
                     str(vllm_venv.ROOT))] if reinstalls else [])


STALE = vllm_venv.stale_entry_points


def test_this_checkout_declares_what_the_cached_venvs_must_carry():
    """The comparison reads this repository's pyproject: the group is there, so a venv installed
    before it is stale (the dry run against a real cached venv, where one is)."""
    assert "vllm_compat.touchpoints" in vllm_venv.checkout_entry_points(Path(ROOT) / "pyproject.toml")
    cached = vllm_venv.CACHE / "venvs" / "vllm-0.32.0"
    if not cached.is_dir():
        pytest.skip("no cached vLLM 0.32.0 venv")
    infos = list(cached.glob("lib/python*/site-packages/vllm_compat-*.dist-info/entry_points.txt"))
    if not any("[vllm_compat.touchpoints]" in p.read_text() for p in infos):
        assert "vllm_compat.touchpoints" in vllm_venv.stale_entry_points(cached)
