"""Subclass contracts on a real consumer of vLLM internals: hs_connectors 0.9.0 (its KV connectors
derive from vLLM's ``KVConnectorBase_V1`` and ``ExampleHiddenStatesConnector``) against vLLM 0.34.0's
source, as released and with one planted drift served by an overlay of that source."""
import ast

import pytest

from vllm_compat.callsites.contracts import PROBLEM, WARNING, subclass_contracts
from vllm_compat.callsites.signatures import VllmIndex
from vllm_compat.probes.static import DirTree, StaticSource

from .planted import HS, SITE_0340 as SITE, VENVS, OverlayTree, line_of

BASE = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"
MOONCAKE = "mooncake_hidden_states_connector.py"

pytestmark = [pytest.mark.released_wheels,
              pytest.mark.skipif(not (SITE / BASE).is_file() or not HS.is_dir(),
                                 reason="vLLM 0.34.0's venv or hs_connectors 0.9.0 not in the cache")]


def contracts(tree):
    index = VllmIndex(StaticSource(tree))
    found = []
    for path in sorted(HS.glob("*.py")):
        found += subclass_contracts(index, ast.parse(path.read_text()), f"hs_connectors/{path.name}", "hs_connectors")
    return found


def test_hs_connectors_keep_their_contracts_on_0340():
    found = contracts(DirTree(SITE))
    assert [f for f in found if f.status == PROBLEM] == []
    # every override of the base was checked, the FP8 connector's private one through a module alias
    checked = {f.target.rsplit(".", 1)[1] for f in found if f.status == "ok"}
    assert {"get_num_new_matched_tokens", "build_connector_meta", "request_finished_all_groups",
            "_write_tensors"} <= checked
    # 0.34.0's connector base no longer has prefer_cross_layer_blocks (0.26.0's workers read it)
    assert [(f.status, f.site) for f in found if f.status == WARNING] == [
        (WARNING, f"hs_connectors/{MOONCAKE}:{line_of((HS / MOONCAKE).read_text(), 'def prefer_cross_layer_blocks')}")]


def test_a_base_method_gaining_a_required_parameter_is_one_problem_at_the_override():
    text = (SITE / BASE).read_text()
    head, sep, tail = text.partition("    def get_num_new_matched_tokens(\n        self,\n")
    assert sep, "0.34.0's base.py changed shape: the planted drift needs a new anchor"
    planted = OverlayTree(DirTree(SITE), {BASE: f"{head}{sep}        planted_blocks: int,\n{tail}"})
    problems = [(f.site, f.target, f.problem) for f in contracts(planted) if f.status == PROBLEM]
    line = line_of((HS / MOONCAKE).read_text(), "def get_num_new_matched_tokens")
    assert problems == [(f"hs_connectors/{MOONCAKE}:{line}",
                         "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1.get_num_new_matched_tokens",
                         "base requires 'planted_blocks' (argument 1), the override does not accept it")]


SITE_0170 = VENVS / "vllm-0.17.0" / "lib" / "python3.11" / "site-packages"


@pytest.mark.skipif(not SITE_0170.is_dir(), reason="vLLM 0.17.0's venv not in the cache")
def test_fp8_write_tensors_overrides_nothing_on_0170():
    """0.17.0's example connector writes inline: the FP8 connector's _write_tensors is never called
    there (it would write unquantized states), the one finding on that release."""
    found = [(f.status, f.site) for f in contracts(DirTree(SITE_0170)) if f.status != "ok"]
    fp8 = "fp8_hidden_states_connector.py"
    assert found == [(WARNING, f"hs_connectors/{fp8}:{line_of((HS / fp8).read_text(), 'def _write_tensors')}")]
