"""The generated reference pages say what the code says: docs/reference/cli.md is what the argparse
parsers of ``hidden-states`` and ``vllm-compat`` give (scripts/cli_reference.py), and
docs/compatibility.md is what scripts/compatibility.py renders from docs/compatibility.json, its
matrix before the notes."""
from __future__ import annotations

import importlib.util
import sys

from tests.conftest import ROOT


def script(name: str):
    spec = importlib.util.spec_from_file_location(name, f"{ROOT}/scripts/{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)
    spec.loader.exec_module(module)
    return module


def test_cli_reference_is_current():
    cli_reference = script("cli_reference")
    assert cli_reference.PAGE.read_text() == cli_reference.page(), (
        "docs/reference/cli.md is stale: python3 scripts/cli_reference.py")


def test_cli_reference_names_every_subcommand_and_flag():
    """Negative proof that the page is built from the parsers: each subcommand has its section, and a flag
    of each (one added later shows up in the diff of the test above)."""
    text = script("cli_reference").page()
    for heading in ("## `hidden-states extract`", "## `hidden-states serve`", "## `hidden-states generate`",
                    "## `hidden-states prepare`", "## `vllm-compat audit`"):
        assert heading in text
    for flag in ("`--data-parallel-size", "`--pp-size", "`--max-new-tokens", "`--consumer"):
        assert flag in text, flag


def test_compatibility_page_is_current_and_its_matrix_comes_first():
    compatibility = script("compatibility")
    text = compatibility.PAGE.read_text()
    assert text == compatibility.page(compatibility.load()), (
        "docs/compatibility.md is stale: python3 scripts/compatibility.py --render")
    table = text.index("| vLLM | audit")
    assert table < text.index("## What each column means") < text.index("## Found per family")
    assert "\n## " not in text[:table]  # nothing but the title and one paragraph above the matrix
