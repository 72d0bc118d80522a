from pathlib import Path

from vllm_compat.cli import adapters_markdown

ROOT = Path(__file__).resolve().parents[2]


def test_adapter_docs_are_current():
    assert (ROOT / "docs" / "adapters.md").read_text() == adapters_markdown(), (
        "docs/adapters.md is stale: python -m vllm_compat adapters --markdown > docs/adapters.md")
