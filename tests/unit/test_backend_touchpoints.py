"""The extractor backends' declared vLLM touch points (``TOUCHPOINTS`` beside each backend, hidden_states/backends/):
declared names are used, used vLLM imports are declared, the audit gates them by release, and the
extractor's preflight stops on the chosen backend's alone. Without vLLM: synthetic trees and results."""
import ast
import dataclasses
import re
from pathlib import Path

import pytest
from packaging.version import Version

from hidden_states.plan import preflight
from hidden_states.errors import PreflightError
from tests.conftest import ROOT
from vllm_compat import audit as audit_module
from vllm_compat.audit import AuditResult, Finding, audit
from vllm_compat.probes.shapes import Exists
from hidden_states.backends import touchpoints, touchpoints_of

BACKEND_TOUCHPOINTS = touchpoints()  # each backend's own declaration (hidden_states/backends)

MODULES = {"vllm-engine": ["vllm_engine.py", "worker/engine_capture.py", "worker/speculators_capture.py",
                           "worker/own_capture.py", "worker/graph_capture.py", "shared/graph_store.py", "engine_feed.py",
                           "engine_base.py", "engine_replies.py", "stage_layers.py"],
           "vllm-native": ["vllm_native.py", "engine_feed.py", "engine_base.py"]}


def source_of(backend: str) -> str:
    return "".join((Path(ROOT) / "hidden_states" / "backends" / name).read_text() for name in MODULES[backend])


def used_name(check) -> str:
    """The name the backend's code uses: the parameter or attribute, or the symbol (module) that exists."""
    if isinstance(check, Exists):
        return re.split(r"[:.]", check.target)[-1]
    return check.name


@pytest.mark.parametrize("backend", sorted(BACKEND_TOUCHPOINTS))
def test_every_declared_touch_point_is_used_by_its_backend(backend):
    text = source_of(backend)
    unused = [used_name(c) for c, _ in BACKEND_TOUCHPOINTS[backend].checks
              if not re.search(rf"\b{used_name(c)}\b", text)]
    assert not unused, f"{backend} declares touch points its code does not use: {unused}"


@pytest.mark.parametrize("backend", sorted(BACKEND_TOUCHPOINTS))
def test_every_vllm_name_the_backend_imports_is_declared(backend):
    imported = {alias.asname or alias.name for node in ast.walk(ast.parse(source_of(backend)))
                if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vllm"
                for alias in node.names}
    declared = {part for c, _ in BACKEND_TOUCHPOINTS[backend].checks for part in re.split(r"[:.]", c.target)}
    assert imported and imported <= declared, f"{backend} imports from vLLM without a touch point: {imported - declared}"


def tree(tmp_path, version: str, files: dict[str, str]) -> Path:
    for name, text in {"vllm/__init__.py": "", "vllm/_version.py": f"__version__ = version = '{version}'\n",
                       **files}.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def backend_findings(result, backend):
    return {f.id: (f.verdict, f.found) for f in result.findings if f.kind == "backend" and f.scope == backend}


NATIVE_FIRST = BACKEND_TOUCHPOINTS["vllm-native"].first


def test_a_backend_is_checked_from_its_first_release_and_its_breaks_are_named(tmp_path):
    outputs = {"vllm/outputs.py": "class RequestOutput:\n    def __init__(self, request_id, prompt_token_ids, finished,"
                                  " kv_transfer_params=None):\n        pass\n"}
    before = audit(tree(tmp_path / "old", "0.16.0", outputs), consumer="speculators==0.3.0")
    assert backend_findings(before, "vllm-native") == {"vllm-native": ("n/a", "")}
    assert f"vllm-native n/a (needs vLLM >= {NATIVE_FIRST})" in before.render()

    after = audit(tree(tmp_path / "new", NATIVE_FIRST, outputs), consumer="speculators==0.3.0")
    native = backend_findings(after, "vllm-native")
    assert native["vllm.outputs:RequestOutput.__init__(kv_transfer_params)"] == ("ok", "optional")
    assert native["vllm.inputs:TokensPrompt"] == ("missing", "<missing>")
    assert {f.scope for f in after.backend_problems()} == {"vllm-engine", "vllm-native"}
    assert after.backend_problems("vllm-native") == [f for f in after.backend_problems() if f.scope == "vllm-native"]
    assert after.exit_code == 1
    assert "PROBLEMS: " in after.render() and "in the extractor's --backend vllm-engine, vllm-native" in after.render()


LOAD_MODEL = "vllm.v1.worker.gpu_worker:Worker.load_model"


def test_a_worker_without_load_model_is_named_for_vllm_engine(tmp_path):
    """``--cuda-graphs`` puts its copies on the model as ``Worker.load_model`` returns (graph_capture.py
    wraps it): a vLLM whose Worker has no ``load_model`` is a vllm-engine problem; with it, that touch
    point is ok."""
    worker = "class Worker:\n    def execute_model(self, scheduler_output):\n        pass\n"
    without = audit(tree(tmp_path / "without", "0.32.0", {"vllm/v1/worker/gpu_worker.py": worker}),
                    consumer="speculators==0.3.0")
    assert [(f.id, f.found) for f in without.backend_problems("vllm-engine") if "gpu_worker:Worker" in f.id] == \
        [(LOAD_MODEL, "absent")]
    loading = worker + "\n    def load_model(self):\n        pass\n"
    with_it = audit(tree(tmp_path / "with", "0.32.0", {"vllm/v1/worker/gpu_worker.py": loading}),
                    consumer="speculators==0.3.0")
    assert backend_findings(with_it, "vllm-engine")[LOAD_MODEL] == ("ok", "present")
    assert LOAD_MODEL not in {f.id for f in with_it.backend_problems("vllm-engine")}


def result_with(*findings) -> AuditResult:
    return AuditResult("installed", "static", "0.33.0", "speculators==0.3.0", findings)


BROKEN_ENGINE = Finding("vllm.v1.core.sched.output:NewRequestData.num_computed_tokens", "backend", "missing",
                        "attribute 'num_computed_tokens' of vllm.v1.core.sched.output:NewRequestData",
                        ("present",), (), "absent", "vllm/v1/core/sched/output.py:40", scope="vllm-engine")


def test_preflight_stops_on_the_chosen_backends_touch_points_alone(monkeypatch):
    monkeypatch.setattr(audit_module, "audit", lambda: result_with(BROKEN_ENGINE))
    assert preflight.check_vllm("speculators") == "vLLM 0.33.0, speculators==0.3.0: audit ok for --backend speculators"
    with pytest.raises(PreflightError, match=r"problems for --backend vllm-engine:\n  vllm.v1.core.sched.output:"
                                             r"NewRequestData.num_computed_tokens: missing: attribute 'num_computed_tokens'"):
        preflight.check_vllm("vllm-engine", touchpoints_of("vllm-engine"))


def test_preflight_of_vllm_native_needs_no_speculators(monkeypatch):
    monkeypatch.setattr(audit_module, "audit", lambda: pytest.fail("vllm-native has no generator to audit"))
    monkeypatch.setattr("vllm_compat.extractor_api.vllm_version", lambda: "0.33.0")
    monkeypatch.setattr(audit_module, "audit_backend", lambda backend, touched: [])
    assert preflight.check_vllm("vllm-native", touchpoints_of("vllm-native"), speculators=False) == "vLLM 0.33.0, no generator: audit ok for --backend vllm-native"
    broken = dataclasses.replace(BROKEN_ENGINE, id="vllm.inputs:TokensPrompt", scope="vllm-native")
    monkeypatch.setattr(audit_module, "audit_backend", lambda backend, touched: [broken])
    with pytest.raises(PreflightError, match="problems for --backend vllm-native:\n  vllm.inputs:TokensPrompt: missing"):
        preflight.check_vllm("vllm-native", touchpoints_of("vllm-native"), speculators=False)


def test_preflight_of_vllm_engine_with_its_own_capture_needs_no_speculators(monkeypatch):
    """Without speculators 0.3/0.4, vllm-engine's own capture is audited as vllm-native is: its own touch
    points, no generator (the full audit would refuse: speculators 0.9 has no in-process generator)."""
    from hidden_states import backends

    monkeypatch.delenv("VLLM_COMPAT_ENGINE_CAPTURE", raising=False)
    monkeypatch.setattr(audit_module, "audit", lambda: pytest.fail("the own capture has no generator to audit"))
    monkeypatch.setattr("vllm_compat.extractor_api.vllm_version", lambda: "0.33.0")
    monkeypatch.setattr("vllm_compat.extractor_api.speculators_version", lambda: Version("0.9.0"))
    monkeypatch.setattr(audit_module, "audit_backend", lambda backend, touched: [BROKEN_ENGINE])
    assert backends.needs_speculators("vllm-engine") is False
    with pytest.raises(PreflightError, match="problems for --backend vllm-engine:\n  vllm.v1.core.sched.output:"):
        preflight.check_vllm("vllm-engine", touchpoints_of("vllm-engine"), backends.needs_speculators("vllm-engine"))
    monkeypatch.setattr(audit_module, "audit_backend", lambda backend, touched: [])
    assert preflight.check_vllm("vllm-engine", touchpoints_of("vllm-engine"), speculators=False) == \
        "vLLM 0.33.0, no generator: audit ok for --backend vllm-engine"


def test_a_backend_refuses_to_start_without_an_adapter_it_requires():
    """vllm-engine declares requires=("v2_batch_order",) beside its code: with that adapter disabled or failed
    its start stops before vLLM loads, naming it (negative: with it applied or not needed, no refusal)."""
    from hidden_states.backends import BackendSettings
    from hidden_states.backends.vllm_engine import VllmEngineBackend
    from hidden_states.errors import ExtractError
    from vllm_compat.report import AdapterResult, Report

    assert touchpoints_of("vllm-engine").requires == ("v2_batch_order",)
    backend = VllmEngineBackend(BackendSettings("m", [0], 8, 1, 0.1))
    disabled = Report("0.32.0", "0.3.0", (AdapterResult("v2_batch_order", "disabled", "disabled by VLLM_COMPAT_DISABLE"),))
    with pytest.raises(ExtractError, match="--backend vllm-engine needs the adapter.s. v2_batch_order: "
                                           "v2_batch_order disabled by VLLM_COMPAT_DISABLE"):
        backend._check_required(disabled)
    failed = Report("0.32.0", "0.3.0", (AdapterResult("v2_batch_order", "failed", "its patch raised"),))
    with pytest.raises(ExtractError, match="needs the adapter.s. v2_batch_order: v2_batch_order its patch raised"):
        backend._check_required(failed)
    for status in ("applied", "not_needed"):
        backend._check_required(Report("0.32.0", "0.3.0", (AdapterResult("v2_batch_order", status, ""),)))


def test_the_audit_finds_the_backends_through_the_entry_point_group():
    """The audit's backends are the group's entry points (pyproject.toml), each the backend's own declaration."""
    from vllm_compat import consumer

    assert consumer.declared("vllm-compat") == BACKEND_TOUCHPOINTS


def test_no_extractor_installed_means_no_backends(monkeypatch):
    from vllm_compat import consumer

    monkeypatch.setattr(consumer, "checkout_entry_points", lambda: {})
    monkeypatch.setattr(consumer.importlib.metadata, "entry_points", lambda group: [])
    assert consumer.declared() == {}


def test_a_broken_extractor_install_is_not_hidden_as_no_backends(monkeypatch, capsys, tmp_path):
    """A module the extractor imports that is missing is a broken install: the audit says so (exit 2,
    naming the entry point) rather than checking no backend."""
    from vllm_compat import cli, consumer

    def broken(self):
        raise ModuleNotFoundError("No module named 'wrapt'", name="wrapt")

    monkeypatch.setattr(consumer.importlib.metadata.EntryPoint, "load", broken)
    with pytest.raises(consumer.DeclarationError, match="entry point 'vllm-engine' .*does not load: "
                                                         "ModuleNotFoundError: No module named 'wrapt'"):
        consumer.declared()
    capsys.readouterr()
    assert cli.main(["audit", "--vllm", str(tree(tmp_path, "0.32.0", {})), "--consumer", "speculators==0.3.0"]) == 2
    assert "entry point 'vllm-engine'" in capsys.readouterr().err
