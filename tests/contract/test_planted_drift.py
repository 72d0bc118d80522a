"""hs-connectors 0.9.0 audited as a ``--consumer`` against vLLM 0.34.0's source: as released it passes;
with a symbol it imports renamed (planted in an overlay of that source, or in a folder of symlinks for
the command line) the audit exits 1 naming hs_connectors' file and line. And the "unchanged since
verified" line on the releases recorded in vllm_compat/data/verified_files.json."""
import os
import subprocess
import sys

import pytest

from vllm_compat import audit as audit_module, hashes, versions
from vllm_compat.callsites import PROBLEM
from vllm_compat.probes.static import DirTree

from .planted import HS, SITE_0340, VENVS, OverlayTree, line_of, plant, symlinked

SPEC = "vllm/v1/kv_cache_interface.py"
EXAMPLE = "vllm/distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py"
MOONCAKE = HS / "mooncake_hidden_states_connector.py"

pytestmark = [pytest.mark.released_wheels,
              pytest.mark.skipif(not (SITE_0340 / SPEC).is_file() or not HS.is_dir(),
                                 reason="vLLM 0.34.0's venv or hs_connectors 0.9.0 not in the cache")]


def renamed_spec():
    return plant(SITE_0340, SPEC, "class HiddenStateCacheSpec(", "class HiddenStatesCacheSpec(")


def renamed_extract():
    return plant(SITE_0340, EXAMPLE, "def extract_from_kv_cache(", "def extract_hidden_states_from_kv_cache(")


def audited(monkeypatch, replaced: dict[str, str]):
    """The audit of hs_connectors on 0.34.0's source served through an overlay with ``replaced``."""
    overlay = OverlayTree(DirTree(SITE_0340, str(SITE_0340)), replaced)
    monkeypatch.setattr(audit_module, "_tree_for",
                        lambda path: (overlay, versions.version_from_source(SITE_0340 / "vllm")))
    return audit_module.audit(SITE_0340, consumer=[str(HS)])


def unchanged_line(text: str) -> str:
    """The audit's line comparing the files read with the verified release's (just above its verdict)."""
    (line,) = [line for line in text.splitlines() if line.startswith("unchanged since verified vllm ")]
    return line


def problems(result):
    return [(c.site, c.target) for c in result.call_sites if c.status == PROBLEM]


def test_unplanted_source_passes_and_is_unchanged_since_verified():
    result = audit_module.audit(SITE_0340, consumer=[str(HS)])
    assert result.exit_code == 0 and problems(result) == []
    assert any(c.consumer.startswith("hs") for c in result.call_sites)
    unchanged = result.unchanged
    assert unchanged["baseline"] == "0.34.0" and unchanged["identical"] == unchanged["read"] > 0
    assert (unchanged["changed"], unchanged["new"], unchanged["gone"]) == ([], [], [])
    assert unchanged_line(result.render()).endswith("are byte-identical; nothing to review")
    assert result.to_dict()["unchanged"] == unchanged


def test_a_renamed_class_it_imports_is_a_problem_at_the_import_and_the_file_to_review(monkeypatch):
    result = audited(monkeypatch, renamed_spec())
    line = line_of(MOONCAKE.read_text(), "from vllm.v1.kv_cache_interface import HiddenStateCacheSpec")
    assert result.exit_code == 1
    assert problems(result) == [(f"hs_connectors/{MOONCAKE.name}:{line}", "vllm.v1.kv_cache_interface:HiddenStateCacheSpec")]
    assert result.unchanged["changed"] == [SPEC] and result.unchanged["new"] == []


def test_a_renamed_function_it_imports_is_a_problem_at_its_import_line(monkeypatch):
    result = audited(monkeypatch, renamed_extract())
    text = MOONCAKE.read_text()
    assert result.exit_code == 1
    [(site, target)] = problems(result)
    assert target.endswith("example_hidden_states_connector:extract_from_kv_cache")
    # the import statement's first line (the name sits two lines below, in its parentheses)
    assert site == f"hs_connectors/{MOONCAKE.name}:{line_of(text, 'example_hidden_states_connector import (')}"
    assert result.unchanged["changed"] == [EXAMPLE]


def test_a_required_parameter_added_to_an_overridden_method_fails_the_audit_at_the_override(monkeypatch):
    base = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"
    anchor = "    def get_num_new_matched_tokens(\n        self,\n"
    result = audited(monkeypatch, plant(SITE_0340, base, anchor, anchor + "        planted_blocks: int,\n"))
    line = line_of(MOONCAKE.read_text(), "def get_num_new_matched_tokens")
    assert result.exit_code == 1
    assert problems(result) == [(f"hs_connectors/{MOONCAKE.name}:{line}",
                                 "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1.get_num_new_matched_tokens")]
    assert result.unchanged["changed"] == [base]


def test_command_line_on_a_planted_folder_exits_1_naming_the_file_and_line(tmp_path):
    root = symlinked(SITE_0340, tmp_path, renamed_spec())
    assert (root / "vllm" / "v1" / "attention").is_symlink() and not (root / SPEC).is_symlink()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(p) for p in sys.path if p])}
    run = subprocess.run([sys.executable, "-m", "vllm_compat", "audit", "--consumer", str(HS), "--vllm", str(root)],
                         capture_output=True, text=True, env=env, timeout=300)
    line = line_of(MOONCAKE.read_text(), "from vllm.v1.kv_cache_interface import HiddenStateCacheSpec")
    assert run.returncode == 1, run.stdout + run.stderr
    assert f"hs_connectors/{MOONCAKE.name}:{line}" in run.stdout
    assert f"review: {SPEC}" in unchanged_line(run.stdout)
    assert run.stdout.splitlines()[-1].startswith("PROBLEMS: 1 in hs-connectors==0.9.0")  # the verdict comes last
    # the same folder unplanted: exit 0
    clean = symlinked(SITE_0340, tmp_path / "clean", {})
    run = subprocess.run([sys.executable, "-m", "vllm_compat", "audit", "--consumer", str(HS), "--vllm", str(clean)],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.mark.parametrize("release", sorted(hashes.load()))
def test_each_recorded_release_is_unchanged_against_its_own_source(release):
    flavor_dir = "vllm-0.34.0-cuda" if release == "0.34.0" else f"vllm-{release}"
    site = VENVS / flavor_dir / "lib" / "python3.11" / "site-packages"
    if not site.is_dir():
        pytest.skip(f"vLLM {release}'s venv not in the cache")
    result = audit_module.audit(site, consumer=[str(HS)])
    unchanged = result.unchanged
    assert unchanged["baseline"] == release
    assert (unchanged["changed"], unchanged["new"], unchanged["gone"]) == ([], [], [])
