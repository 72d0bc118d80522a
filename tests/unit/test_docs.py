import re
from pathlib import Path

from tests.tracked_files import tracked_texts
from vllm_compat.cli import adapters_markdown

ROOT = Path(__file__).resolve().parents[2]


def test_adapter_docs_are_current():
    assert (ROOT / "docs" / "adapters.md").read_text() == adapters_markdown(), (
        "docs/adapters.md is stale: python -m vllm_compat adapters --markdown > docs/adapters.md")


# The notes the project was first built from live outside the repository; what the code and docs
# take from them is in docs/drift-atlas.md and docs/cpu-vllm.md. Written in two parts so that this
# file does not cite them itself.
OUTSIDE_NOTES = re.compile("DRIFT" + r"\.md|CPU-" + "VLLM")
# A citation of a docs page's section: docs/<page>.md or docs/<folder>/<page>.md, "<heading>" (quotes escaped inside a string too).
CITATION = re.compile(r'(docs/[a-z0-9/.-]+\.md), \\?"([^"\\]+)\\?"')


# files that record what was, not what is: the benchmarks' raw records
HISTORY = ("bench/results/",)

def test_no_tracked_file_cites_notes_outside_the_repository():
    citing = [f"{name}:{text.count(chr(10), 0, m.start()) + 1}" for name, text in tracked_texts()
              for m in OUTSIDE_NOTES.finditer(text)]
    assert citing == [], "cite docs/drift-atlas.md or docs/cpu-vllm.md (a section) instead: " + ", ".join(citing)


def headings(page: str) -> set[str]:
    path = ROOT / page
    return {line.lstrip("#").strip() for line in path.read_text().splitlines()
            if line.startswith("#")} if path.is_file() else set()


def test_cited_sections_of_docs_pages_exist():
    """Every 'docs/<page>.md, "<heading>"' in a tracked file names a heading that page has, the drift
    atlas and the CPU notes above all (every adapter's evidence cites one)."""
    # a citation may wrap: in Markdown, a docstring, a comment (whose next line starts with '#')
    cited = [(name, page, " ".join(re.sub(r"\n\s*#", " ", section).split()))
             for name, text in tracked_texts() for page, section in CITATION.findall(text)]
    assert sum(page in ("docs/drift-atlas.md", "docs/cpu-vllm.md") for _, page, _ in cited) > 20
    # Raw records are history: they cite docs/performance.md as it was, before its dated runs moved to
    # docs/reports/ (listed at the end of docs/benchmarks.md); every other file cites the pages as they are.
    cited = [(name, page, section) for name, page, section in cited
             if not (page == "docs/performance.md" and name.startswith(HISTORY))]
    known = {page: headings(page) for page in {page for _, page, _ in cited}}
    dangling = [f"{name}: {page}, {section!r}" for name, page, section in cited if section not in known[page]]
    assert dangling == []
