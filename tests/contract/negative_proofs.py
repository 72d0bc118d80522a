"""Each adapter's negative proof as its contract test states it (tests/contract/base.py,
``AdapterContract``), read from the contract test's source with ``ast``, not imported: what
tests/e2e/test_negative.py runs and tests/unit/test_contracts_exist.py checks, without importing a
test module (nor vLLM, which the contract tests import)."""
from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

CONTRACTS = Path(__file__).resolve().parent
# Model Runner V2 forced, where vLLM's CPU backend has one (negative_env of the V2-only adapters)
RUNNER_V2 = {"VLLM_USE_V2_MODEL_RUNNER": "1"}
NAMES = {"RUNNER_V2": RUNNER_V2}  # the names a contract class's facts may use, besides literals


@dataclass(frozen=True)
class NegativeProof:
    """The facts of ``AdapterContract`` that say how the adapter's absence shows (their meaning: there)."""

    negative: str = ""
    not_observable_on_cpu: str = ""
    family: str = ""
    negative_env: dict[str, str] = field(default_factory=dict)
    not_called_by: frozenset[str] = frozenset()
    same_value_on_cpu: frozenset[str] = frozenset()


def contract_path(adapter_id: str) -> Path:
    """An adapter's contract test: ``tests/contract/test_<id>.py``."""
    return CONTRACTS / f"test_{adapter_id}.py"


def value_of(node: ast.expr, where: str):
    """A fact's value: a literal, ``frozenset({...})`` of literals, or one of ``NAMES``."""
    if isinstance(node, ast.Name) and node.id in NAMES:
        return NAMES[node.id]
    if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "frozenset" and len(node.args) <= 1:
        return frozenset(ast.literal_eval(node.args[0]) if node.args else ())
    try:
        return ast.literal_eval(node)
    except ValueError:
        raise ValueError(f"{where}: a contract's fact must be a literal, frozenset({{...}}) or one of "
                         f"{sorted(NAMES)}") from None


def declared_facts(adapter_id: str) -> dict[str, object] | None:
    """The class-level facts of the ``AdapterContract`` subclass whose ``adapter_id`` is ``adapter_id``
    in its contract test (None where the file or the class is missing)."""
    path = contract_path(adapter_id)
    if not path.is_file():
        return None
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ClassDef) and any(getattr(b, "id", "") == "AdapterContract" for b in node.bases):
            assigned = {stmt.targets[0].id: stmt.value for stmt in node.body
                        if isinstance(stmt, ast.Assign) and isinstance(stmt.targets[0], ast.Name)}
            named = assigned.get("adapter_id")
            if isinstance(named, ast.Constant) and named.value == adapter_id:
                return {name: value_of(value, f"{path.name}:{value.lineno}") for name, value in assigned.items()
                        if name in NegativeProof.__dataclass_fields__ or name == "adapter_id"}
    return None


def negative_proof(adapter_id: str) -> NegativeProof:
    facts = declared_facts(adapter_id)
    if facts is None:
        raise LookupError(f"{contract_path(adapter_id).name} has no AdapterContract for {adapter_id}")
    return NegativeProof(**{name: value for name, value in facts.items() if name != "adapter_id"})
