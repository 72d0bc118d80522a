"""Every adapter has its contract test, and that test states the adapter's negative proof.

Read with ``ast`` (the contract tests import vLLM, which the unit tests do without)."""
import ast
from pathlib import Path

import pytest

from vllm_compat.registry import adapters

CONTRACTS = Path(__file__).resolve().parents[1] / "contract"


def class_facts(adapter_id: str) -> dict[str, object]:
    path = CONTRACTS / f"test_{adapter_id}.py"
    assert path.is_file(), f"{adapter_id} has no contract test: write {path.relative_to(CONTRACTS.parent.parent)}"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef) and any(getattr(b, "id", "") == "AdapterContract" for b in node.bases):
            facts = {t.id: stmt.value for stmt in node.body if isinstance(stmt, ast.Assign)
                     for t in stmt.targets if isinstance(t, ast.Name)}
            if isinstance(facts.get("adapter_id"), ast.Constant) and facts["adapter_id"].value == adapter_id:
                return {name: value.value if isinstance(value, ast.Constant) else value for name, value in facts.items()}
    pytest.fail(f"{path.name} has no AdapterContract subclass with adapter_id = {adapter_id!r}")


@pytest.mark.parametrize("adapter_id", [a.id for a in adapters()])
def test_every_adapter_has_a_contract_test_stating_its_negative_proof(adapter_id):
    facts = class_facts(adapter_id)
    assert bool(facts.get("negative")) != bool(facts.get("not_observable_on_cpu")), (
        f"{adapter_id}: state either negative (what breaks without it) or not_observable_on_cpu (why a CPU "
        f"run cannot show it), exactly one")
