"""Every adapter has its contract test, and that test states the adapter's negative proof.

Read with ``ast`` (tests/contract/negative_proofs.py: the contract tests import vLLM, which the unit
tests do without)."""
import pytest

from tests.contract.negative_proofs import CONTRACTS, contract_path, declared_facts
from vllm_compat.registry import adapters


@pytest.mark.parametrize("adapter_id", [a.id for a in adapters()])
def test_every_adapter_has_a_contract_test_stating_its_negative_proof(adapter_id):
    path = contract_path(adapter_id)
    assert path.is_file(), f"{adapter_id} has no contract test: write {path.relative_to(CONTRACTS.parent.parent)}"
    facts = declared_facts(adapter_id)
    if facts is None:
        pytest.fail(f"{path.name} has no AdapterContract subclass with adapter_id = {adapter_id!r}")
    assert bool(facts.get("negative")) != bool(facts.get("not_observable_on_cpu")), (
        f"{adapter_id}: state either negative (what breaks without it) or not_observable_on_cpu (why a CPU "
        f"run cannot show it), exactly one")


@pytest.mark.parametrize("adapter", adapters(), ids=lambda a: a.id)
def test_verified_through_is_the_other_side_of_the_range(adapter):
    """The newest verified release lies at or above where the new shape begins (nothing can be
    verified on a release before the drift it bridges) and inside the range's upper bound."""
    from packaging.version import Version

    lower = [Version(s.version) for s in adapter.vllm if s.operator in (">=", "==", "~=")]
    assert lower and adapter.verified_through >= max(lower)
    assert adapter.verified_through in adapter.vllm
