"""The call-site audit on the installed vLLM's real sources: no false alarm as released, and each
kind of drift, planted into a copy of those sources, comes out as a PROBLEM naming the call site.

The copy is a tree of symlinks to the installed files (fast); a planted file is a real, edited copy.
"""
import os
import re
from pathlib import Path

import pytest

from tests.e2e.harness import speculators_path
from vllm_compat import callsites, versions
from vllm_compat.audit import audit
from vllm_compat.consumer import GENERATOR_RELEASES
from vllm_compat.probes.shapes import Moved
from vllm_compat.probes.static import DirTree, StaticSource
from vllm_compat.registry import get

# every test reads the speculators releases it audits from their folders: the one on the path changes nothing
pytestmark = pytest.mark.per_vllm

GENERATOR = "speculators/data_generation/vllm_hidden_states_generator.py"


def installed_vllm() -> Path:
    return versions.package_dir("vllm")


def linked_copy(tmp_path: Path) -> Path:
    """``tmp_path/vllm``: every .py file of the installed vLLM, as a symlink."""
    source = installed_vllm()
    for path in source.rglob("*.py"):
        target = tmp_path / "vllm" / path.relative_to(source)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(path, target)
    return tmp_path


def plant(root: Path, relpath: str, pattern: str, replacement: str, every: bool = False) -> None:
    """Edit one file of the copy (the first match, or ``every`` one); fails if the pattern is not
    in this release's file."""
    path = root / relpath
    text = path.read_text()
    edited, count = re.subn(pattern, replacement, text, count=0 if every else 1, flags=re.S | re.M)
    assert count >= 1, f"{pattern!r} not found in {relpath}"
    path.unlink()
    path.write_text(edited)


def line_of(spec: str, needle: str) -> int:
    """The line of the first occurrence of ``needle`` in the consumer's generator module."""
    lines = (speculators_path(spec) / GENERATOR).read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if needle in line)


def run(root: Path, spec: str):
    return audit(root, consumer=f"speculators=={spec}", consumer_source=speculators_path(spec))


def problems(result) -> list[tuple[str, str, str]]:
    return [(c.site, c.target, c.problem) for c in result.call_site_problems]


@pytest.mark.parametrize("spec", GENERATOR_RELEASES)
def test_the_installed_release_has_no_call_site_problem(spec):
    if versions.base(versions.vllm_version()) < versions.parse("0.12.0") and spec == "0.4.0":
        pytest.skip("speculators 0.4.0 requires vLLM >= 0.12.0")
    result = run(installed_vllm().parent, spec)
    assert result.call_site_problems == [], problems(result)
    assert sum(c.status == callsites.OK for c in result.call_sites) > 50


@pytest.mark.parametrize("spec", GENERATOR_RELEASES)
def test_new_required_constructor_parameter(tmp_path, spec):
    root = linked_copy(tmp_path)
    plant(root, "vllm/v1/core/sched/scheduler.py", r"(class Scheduler\(.*?def __init__\(\s*self,)",
          r"\1 planted_required: int,")
    result = run(root, spec)
    site = f"{GENERATOR}:{line_of(spec, 'self.scheduler = Scheduler(')}"
    assert (site, "vllm.v1.core.sched.scheduler:Scheduler.__init__",
            "required parameter 'planted_required' not passed") in problems(result)
    assert result.exit_code == 1


@pytest.mark.parametrize("relpath, field, needle", [
    ("vllm/sampling_params.py", "max_tokens", "sampling_params=SamplingParams("),
    ("vllm/config/parallel.py", "worker_extension_cls", "parallel_config=ParallelConfig("),
], ids=["SamplingParams", "ParallelConfig"])
def test_keyword_removed(tmp_path, relpath, field, needle):
    root = linked_copy(tmp_path)
    plant(root, relpath, rf"^(    ){field}:", rf"\1renamed_{field}:")
    result = run(root, "0.4.0")
    found = [p for p in problems(result) if p[2] == f"no parameter {field!r}"]
    assert [site for site, _, _ in found] == [f"{GENERATOR}:{line_of('0.4.0', needle)}"], problems(result)


def test_function_moved_to_another_module(tmp_path):
    """The generator imports get_kv_cache_config_from_groups from kv_cache_utils, which defines it up
    to 0.32.0; from 0.33.0 kv_cache_planning does and kv_cache_planning_names puts it back. Moved
    away from where this release defines it, the import finds no name."""
    home = get("kv_cache_planning_names").expect.check.observe(StaticSource(DirTree(installed_vllm().parent)))
    assert home.value in (Moved.NOT_MOVED, Moved.MOVED), home
    root = linked_copy(tmp_path)
    plant(root, home.where.split(":")[0], r"^def get_kv_cache_config_from_groups\(", "def _moved_away(")
    result = run(root, "0.4.0")
    target = "vllm.v1.core.kv_cache_utils:get_kv_cache_config_from_groups"
    site = f"{GENERATOR}:{line_of('0.4.0', 'from vllm.v1.core.kv_cache_utils import')}"
    assert (site, target, "name not found") in problems(result)


@pytest.mark.parametrize("relpaths, cls, method, needle", [
    (("vllm/v1/core/sched/scheduler.py", "vllm/v1/core/sched/interface.py"), "Scheduler", "schedule",
     "self.scheduler.schedule()"),
    (("vllm/v1/executor/multiproc_executor.py", "vllm/v1/executor/abstract.py"), "MultiprocExecutor",
     "collective_rpc", 'self.executor.collective_rpc("_reset_capture")'),
], ids=["Scheduler.schedule", "MultiprocExecutor.collective_rpc"])
def test_method_renamed(tmp_path, relpaths, cls, method, needle):
    root = linked_copy(tmp_path)
    for relpath in relpaths:  # the class and the base class that declares it
        plant(root, relpath, rf"^(    def ){method}\(", rf"\1{method}_renamed(", every=True)
    result = run(root, "0.4.0")
    holder = {"Scheduler": "vllm.v1.core.sched.scheduler:Scheduler",
              "MultiprocExecutor": "vllm.v1.executor.multiproc_executor:MultiprocExecutor"}[cls]
    site = f"{GENERATOR}:{line_of('0.4.0', needle)}"
    assert (site, f"{holder}.{method}", f"no attribute {method!r} on {holder}") in problems(result)


def test_changed_signature_of_a_function_an_adapter_calls(tmp_path):
    """deferred_sampling (speculators 0.3, vLLM >= 0.11.1) calls executor.sample_tokens(None)."""
    root = linked_copy(tmp_path)
    plant(root, "vllm/v1/executor/multiproc_executor.py", r"(    def sample_tokens\(\s*(?:#[^\n]*)?\s*self,)",
          r"\1 planted_required: int, also_required: int,")
    result = run(root, "0.3.0")
    adapter = Path(callsites.HERE / "adapters" / "deferred_sampling.py").read_text().splitlines()
    line = next(i for i, text in enumerate(adapter, 1) if text.strip().startswith("executor.sample_tokens(None)"))
    sites = [(site, target) for site, target, _ in problems(result)]
    assert (f"vllm_compat/adapters/deferred_sampling.py:{line}",
            "vllm.v1.executor.multiproc_executor:MultiprocExecutor.sample_tokens") in sites
    assert result.exit_code == 1


# set_kv_cache_layout's parameters, up to the closing parenthesis (one line or several, a trailing comma or not)
SET_KV_CACHE_LAYOUT = r"(def set_kv_cache_layout\(\s*self,[^)]*?),?\s*\)"


@pytest.mark.parametrize("parameter", ["planted_required", "cp_kv_cache_interleave_size"])
def test_new_required_parameter_of_set_kv_cache_layout(tmp_path, parameter):
    """The kv_cache_layout adapter (vLLM >= 0.29) asks set_kv_cache_layout's signature for 0.33.0's
    cp_kv_cache_interleave_size and calls it with two arguments then, else with one: the audit
    judges the call the release takes. A required parameter the adapter does not know, added last,
    is a PROBLEM at that call; 0.33.0's own parameter takes the two-argument call, which fits (from
    0.33.0 the release as released is that case)."""
    if versions.base(versions.vllm_version()) < versions.parse("0.29.0"):
        pytest.skip("set_kv_cache_layout exists from vLLM 0.29.0")
    relpath = "vllm/v1/executor/abstract.py"
    released = re.search(SET_KV_CACHE_LAYOUT, (installed_vllm().parent / relpath).read_text(), flags=re.S)
    assert released, f"no set_kv_cache_layout in {relpath}"
    if parameter in released.group(1):
        root = installed_vllm().parent
    else:
        root = linked_copy(tmp_path)
        plant(root, relpath, SET_KV_CACHE_LAYOUT, rf"\1, {parameter}: int)")
    ours = [p for p in problems(run(root, "0.4.0")) if p[0].startswith("vllm_compat/adapters/kv_cache_layout.py")]
    if parameter == "cp_kv_cache_interleave_size":
        assert ours == []
        return
    takes_interleave = "cp_kv_cache_interleave_size" in released.group(1)
    call = f"executor.set_kv_cache_layout(layout.name{', interleave' if takes_interleave else ''})"
    adapter = Path(callsites.HERE / "adapters" / "kv_cache_layout.py").read_text().splitlines()
    line = next(i for i, text in enumerate(adapter, 1) if text.strip() == call)
    assert ours == [(f"vllm_compat/adapters/kv_cache_layout.py:{line}",
                     "vllm.v1.executor.multiproc_executor:MultiprocExecutor.set_kv_cache_layout",
                     "required parameter 'planted_required' not passed")]
