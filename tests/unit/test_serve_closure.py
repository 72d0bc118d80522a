"""``hidden-states serve``'s import closure stays small: its wing (``hidden_states.serve``, what
``cli/`` calls) imports at most ``MOST_MODULES`` of the extractor's modules, and the command, its
command line included, nothing of the input's side (tokenization, conversations, their identity,
the input stream, regeneration): a server of token ids needs no tokenizer and no dataset reader.

Measured in a fresh interpreter (``sys.modules`` after the import), so a module pulled in through
any chain of imports counts, not only the wing's own; a folder's ``__init__.py`` holding nothing but
its docstring brings no code and is not counted.
"""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

MOST_MODULES = 26  # 20, the four of certify/ (each served row is certified before its file is written), and
# plan/pipeline.py and plan/stage_memory.py (--pp-size: the stages, and the memory each holds)
NOT_SERVED = ("tokenization", "conversations", "identity", "inputs", "regeneration")


def imported_by(*modules: str) -> list[str]:
    """The extractor's modules (``hidden_states.x``, the package itself aside) a fresh interpreter
    holds after importing ``modules``."""
    code = (f"import sys\nfor name in {list(modules)!r}:\n    __import__(name)\n"
            "import json\nprint(json.dumps(sorted(n for n in sys.modules if n.startswith('hidden_states.'))))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def not_served(modules: list[str]) -> list[str]:
    """Those of ``modules`` on the input's side (``NOT_SERVED``, or anything inside one of them)."""
    return [m for m in modules if m.split(".")[1] in NOT_SERVED]


def holds_code(module: str) -> bool:
    """False for a folder's ``__init__.py`` that holds nothing but its docstring (what the folder
    holds, said): it brings no code with it, so the count leaves it out."""
    path = Path(ROOT, *module.split("."), "__init__.py")
    if not path.is_file():
        return True
    body = ast.parse(path.read_text(encoding="utf-8")).body
    return not (len(body) == 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant))


def test_the_served_wing_imports_at_most_twenty_six_modules_and_nothing_of_the_inputs():
    modules = imported_by("hidden_states.serve")
    assert not_served(modules) == [], modules
    counted = [m for m in modules if holds_code(m)]
    assert len(counted) <= MOST_MODULES, f"{len(counted)} modules: {counted}"


def test_only_a_folder_with_nothing_but_its_docstring_goes_uncounted():
    assert not holds_code("hidden_states.plan")
    assert holds_code("hidden_states.serve") and holds_code("hidden_states.backends")
    assert holds_code("hidden_states.plan.planner")


def test_the_serve_command_line_imports_nothing_of_the_inputs():
    """What ``hidden-states serve`` loads before the model: the command line, its log, the wing."""
    modules = imported_by("hidden_states.cli", "hidden_states.run_log", "hidden_states.progress",
                          "hidden_states.serve")
    assert not_served(modules) == [], modules


@pytest.mark.parametrize("planted, caught", [
    (["hidden_states.serve", "hidden_states.inputs.tokenization"], ["hidden_states.inputs.tokenization"]),
    (["hidden_states.inputs.conversations"], ["hidden_states.inputs.conversations"]),
    (["hidden_states.output.formats.speculators_05", "hidden_states.inputs.streams"], ["hidden_states.inputs.streams"]),
    (["hidden_states.serve.model", "hidden_states.plan.planner"], []),
])
def test_the_check_catches_what_it_looks_for(planted, caught):
    assert not_served(planted) == caught
