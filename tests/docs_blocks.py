"""The shell blocks of README.md and the docs pages (``pages``) and what each one's tag says it needs (support module of
tests/unit/test_docs_blocks.py and tests/e2e/test_docs_commands.py; the tags: docs/architecture.md,
"Shell blocks in the docs").

A block's info string is its language (what GitHub colours it as) and then its tag, e.g.
```` ```console runnable ````: CommonMark takes the first word as the language and GitHub ignores the
rest, so the tag does not show on the page.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHELL = ("console", "bash", "sh", "shell")
# what a shell block may be: the first word after the language
TAGS = {
    "runnable": "runs on CPU with the tiny models, given the page's variables; tests/e2e/test_docs_commands.py runs it",
    "repeated": "the commands of a runnable block on the page named after the tag, which the docs test runs there",
    "gpu": "needs a GPU, several, or a full-size model",
    "network": "needs the network (pip fetches a wheel or a package)",
    "slow": "runs on CPU with the tiny models but takes minutes (a demo, a benchmark, the test matrix): not run by the docs test",
    "server": "starts a server that runs until it is stopped (tests/e2e/test_serve.py runs the same)",
    "illustrative": "not a command to paste: a synopsis, a transcript, a fragment or a placeholder",
}
# the speculators release a runnable block needs, where not the extractor's (the second word)
NEEDS = ("speculators-0.9", "speculators-0.3")
FENCE = re.compile(r"^(\s*)```(\S*)(.*)$")


@dataclass
class Block:
    page: str  # README.md or docs/x.md
    line: int  # the opening fence's line, 1-based
    language: str
    words: list[str]  # the info string after the language
    text: str

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def tag(self) -> str | None:
        return self.words[0] if self.words and self.words[0] in TAGS else None

    @property
    def needs(self) -> str | None:
        return next((w for w in self.words[1:] if w in NEEDS), None)

    @property
    def repeats(self) -> str | None:
        """The page (``docs/...``) whose runnable block a ``repeated`` block repeats."""
        return self.words[1] if self.tag == "repeated" and len(self.words) > 1 else None

    def commands(self) -> str:
        """The block as bash runs it: a ``$ `` prompt taken off each line."""
        return "\n".join(re.sub(r"^(\s*)\$ ", r"\1", line) for line in self.text.splitlines())


def pages() -> list[Path]:
    """README.md and every page of docs/, its folders (guides/, reference/, explanation/) included; not
    docs/reports/, dated records of runs whose blocks are transcripts of what ran then."""
    docs = ROOT / "docs"
    return [ROOT / "README.md", *sorted(p for p in docs.rglob("*.md") if p.relative_to(docs).parts[0] != "reports")]


def blocks(path: Path) -> list[Block]:
    """Every fenced block of ``path`` in a shell language, in page order."""
    found, lines, i = [], path.read_text().splitlines(), 0
    page = str(path.relative_to(ROOT))
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        end = i + 1
        while end < len(lines) and not lines[end].strip().startswith("```"):
            end += 1
        indent = len(opening.group(1))
        if opening.group(2) in SHELL:
            text = "\n".join(line[indent:] for line in lines[i + 1:end])
            found.append(Block(page, i + 1, opening.group(2), opening.group(3).split(), text))
        i = end + 1
    return found


def shell_blocks() -> list[Block]:
    return [block for path in pages() for block in blocks(path)]
