"""``--consumer`` on a real consumer of vLLM internals: hs_connectors (speculators 0.9.0's folder, read
as a directory consumer, never imported) against vLLM 0.16.0's source (the 0.16.0 venv's folder), which
lacks the modules it imports, and against the installed vLLM when it is 0.32.0, where it all fits."""
import json
from pathlib import Path

import pytest

from tests.conftest import CACHE
from tests.e2e.harness import speculators_path
from vllm_compat import versions
from vllm_compat.cli import main

HS = "hs_connectors"
VLLM_016 = Path(CACHE) / "venvs" / "vllm-0.16.0" / "lib" / "python3.11" / "site-packages"
CONNECTOR = "vllm.distributed.kv_transfer.kv_connector.v1"
# what 0.16.0 lacks: the example hidden-states connector module, HiddenStateCacheSpec, extract_hidden_states
MISSING_ON_016 = [
    ("hs_connectors/fp8_hidden_states_connector.py:23", f"{CONNECTOR}:example_hidden_states_connector"),
    ("hs_connectors/mooncake_hidden_states_connector.py:25",
     f"{CONNECTOR}.example_hidden_states_connector:ExampleHiddenStatesConnector"),
    ("hs_connectors/mooncake_hidden_states_connector.py:25",
     f"{CONNECTOR}.example_hidden_states_connector:extract_from_kv_cache"),
    ("hs_connectors/mooncake_hidden_states_connector.py:88", "vllm.v1.kv_cache_interface:HiddenStateCacheSpec"),
    ("hs_connectors/mooncake_hidden_states_connector.py:231",
     "vllm.model_executor.models.extract_hidden_states:CacheOnlyAttentionLayer"),
]


def _consumer() -> str:
    return str(speculators_path("0.9.0") / HS)


def _audit(capsys, *args) -> tuple[int, dict]:
    code = main(["audit", "--consumer", _consumer(), "--json", *args])
    return code, json.loads(capsys.readouterr().out)


def _sites(out: dict) -> list[dict]:
    return [c for c in out["call_sites"] if c["consumer"] == "hs-connectors==0.9.0"]


@pytest.mark.released_wheels
def test_hs_connectors_on_016_names_each_missing_import(capsys):
    assert main(["audit", "--consumer", _consumer(), "--vllm", str(VLLM_016)]) == 1
    text = capsys.readouterr().out
    assert "consumer hs-connectors==0.9.0 (hs_connectors; does not run vllm_compat.apply()" in text
    assert "PROBLEMS: 5 in hs-connectors==0.9.0 (it would break)" in text
    code, out = _audit(capsys, "--vllm", str(VLLM_016))
    assert code == 1 and out["consumers"][0]["name"] == "hs-connectors" and not out["consumers"][0]["applies_shim"]
    problems = [(c["site"], c["target"]) for c in _sites(out) if c["status"] == "PROBLEM"]
    assert problems == MISSING_ON_016
    assert not any(c["status"] == "bridged" for c in _sites(out))  # it does not apply the shim


@pytest.mark.per_vllm
@pytest.mark.skipif(str(versions.vllm_version()) != "0.32.0", reason="pinned for the installed vLLM 0.32.0")
def test_hs_connectors_fits_032(capsys):
    code, out = _audit(capsys)
    sites = _sites(out)
    # the one row that is not ok is real: vLLM 0.32.0's connector bases no longer have
    # prefer_cross_layer_blocks (0.26.0's worker still read it), so hs-connectors' override replaces
    # nothing; a warning, which fails no run
    assert [(c["status"], c["site"]) for c in sites if c["status"] != "ok"] == [
        ("warning", "hs_connectors/mooncake_hidden_states_connector.py:75")]
    assert code == 0


@pytest.mark.per_vllm
@pytest.mark.skipif(str(versions.vllm_version()) != "0.32.0", reason="pinned for the installed vLLM 0.32.0")
def test_speculators_and_hs_connectors_in_one_audit_032(capsys):
    """Two real consumers at once, as the golden snapshots hold two synthetic ones: speculators 0.3.0's
    generator (bridged by the shim) and hs-connectors (no shim: its one warning stays its own)."""
    source = str(speculators_path("0.3.0"))
    code, out = _audit(capsys, "--consumer", "speculators==0.3.0", "--consumer-source", source)
    assert code == 0
    assert [(c["name"], c["applies_shim"]) for c in out["consumers"]] == [("speculators", True),
                                                                        ("hs-connectors", False)]
    speculators = [c for c in out["call_sites"] if c["consumer"] == "speculators==0.3.0"]
    assert speculators and {c["status"] for c in speculators} <= {"ok", "bridged"}
    assert sum(c["status"] == "bridged" for c in speculators) == 4  # the four the CLI names on 0.32.0
    assert [(c["status"], c["site"]) for c in _sites(out) if c["status"] != "ok"] == [
        ("warning", "hs_connectors/mooncake_hidden_states_connector.py:75")]


@pytest.mark.released_wheels
def test_speculators_and_hs_connectors_in_one_audit_on_016_fail_on_hs_connectors_alone(capsys):
    source = str(speculators_path("0.3.0"))
    code, out = _audit(capsys, "--consumer", "speculators==0.3.0", "--consumer-source", source,
                       "--vllm", str(VLLM_016))
    assert code == 1
    assert [(c["site"], c["target"]) for c in _sites(out) if c["status"] == "PROBLEM"] == MISSING_ON_016
    speculators = [c for c in out["call_sites"] if c["consumer"] == "speculators==0.3.0"]
    assert speculators and not [c for c in speculators if c["status"] == "PROBLEM"]
