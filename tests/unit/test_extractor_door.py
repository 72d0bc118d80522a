"""The extractor's one door into the shim: ``hidden_states`` imports ``vllm_compat`` only through
``vllm_compat.extractor_api``, and only the names listed here (read with ``ast``: imports anywhere in
a module, lazy ones included, and the attributes read off the imported module)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import ROOT
from vllm_compat import extractor_api

DOOR = "vllm_compat.extractor_api"
# Exactly what the extractor uses of the shim today; a new name is added here and to the door's
# docstring (and docs/usage.md) together.
ALLOWED = frozenset({
    "apply", "audit", "audit_backend", "AuditError", "BAD",
    "BackendTouchpoints", "Attr", "Param", "Exists", "FieldDefault", "LiteralMember", "Dispatched", "Registered", "Branch",
    "PRESENT", "REQUIRED", "OPTIONAL",
    "vllm_device_type", "device_total_memory", "device_name", "host_memory", "vllm_version", "base", "package_dir",
    "speculators_version", "IN_PROCESS_SPECULATORS", "TRAINER_LAYOUTS", "pin_host_memory", "scheduled_in_row_order", "wrap_method",
    "environment_conflicts", "install_command", "__version__",
})


def shim_uses(tree: ast.Module) -> list[tuple[int, str, str]]:
    """(line, module, name) for every use of vllm_compat in ``tree``: ``from M import n`` gives
    (M, n); ``import M`` and ``from vllm_compat import extractor_api`` give (M, "") and then one
    entry per attribute read off that name (``extractor_api.apply`` -> (door, "apply"))."""
    uses, aliases = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "vllm_compat":
                    uses.append((node.lineno, alias.name, ""))
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "vllm_compat":
            for alias in node.names:
                if node.module == "vllm_compat" and alias.name == "extractor_api":
                    aliases[alias.asname or alias.name] = DOOR
                    uses.append((node.lineno, DOOR, ""))
                else:
                    uses.append((node.lineno, node.module, alias.name))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            uses.append((node.lineno, aliases[node.value.id], node.attr))
    return uses


def extractor_modules() -> list[Path]:
    return sorted((Path(ROOT) / "hidden_states").rglob("*.py"))


def test_the_extractor_uses_the_shim_through_its_door_alone():
    wrong = []
    for path in extractor_modules():
        for line, module, name in shim_uses(ast.parse(path.read_text())):
            if module != DOOR or (name and name not in ALLOWED):
                wrong.append(f"{path.relative_to(ROOT)}:{line}: {module}{'.' + name if name else ''}")
    assert not wrong, "the extractor reaches past vllm_compat.extractor_api:\n" + "\n".join(wrong)


def test_the_list_is_what_the_extractor_uses_and_what_the_door_offers():
    used = {name for path in extractor_modules() for _, module, name in shim_uses(ast.parse(path.read_text()))
            if module == DOOR and name}
    assert used == ALLOWED, f"listed, unused: {sorted(ALLOWED - used)}; used, unlisted: {sorted(used - ALLOWED)}"
    assert set(extractor_api.__all__) == ALLOWED
    for name in ALLOWED:
        assert getattr(extractor_api, name) is not None


@pytest.mark.parametrize("source, found", [
    ("from vllm_compat.host import host_memory", [(1, "vllm_compat.host", "host_memory")]),
    ("import vllm_compat.wrapping", [(1, "vllm_compat.wrapping", "")]),
    ("def f():\n    from vllm_compat import extractor_api\n    return extractor_api.revert()",
     [(2, DOOR, ""), (3, DOOR, "revert")]),
    ("from .wrapping import x\nimport os", []),
])
def test_the_reader_sees_every_kind_of_import(source, found):
    """Negative proof for the check above: what it must flag is seen (a lazy import, a module
    import, an attribute off the door); relative imports inside the extractor are not the shim."""
    assert sorted(shim_uses(ast.parse(source))) == found
