"""Every relative link of README.md and the docs pages lands: its file exists and, where it names an
anchor of a Markdown page, that page has the heading (GitHub's slug of it). Pages move (the docs are
organised by task: docs/README.md); a link left behind fails here, not in a reader's browser."""
from __future__ import annotations

import re
from pathlib import Path

from tests.docs_blocks import ROOT, pages

LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*```")
# pages linked before they land: the benchmarks page and the GPU workflow's README are rewritten apart
# from the docs; a link to either is checked as any other once the file is here
COMING = {"docs/benchmarks.md", "bench/README.md"}


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def prose(path: Path) -> list[str]:
    """The page's lines outside fenced blocks."""
    lines, inside = [], False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            inside = not inside
        elif not inside:
            lines.append(line)
    return lines


def anchors(path: Path) -> set[str]:
    found, seen = set(), {}
    for line in prose(path):
        if line.startswith("#"):
            base = slug(line.lstrip("#"))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
        found.update(re.findall(r'<a (?:name|id)="([^"]+)"', line))
    return found


def broken(path: Path, root: Path = ROOT) -> list[str]:
    wrong = []
    for number, line in enumerate(prose(path), 1):
        for target in LINK.findall(line):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            where = (path.parent / file).resolve() if file else path
            page = path.relative_to(root)
            if not where.exists():
                if where.is_relative_to(root) and str(where.relative_to(root)) in COMING:
                    continue
                wrong.append(f"{page}: {target} (no such file)")
            elif anchor and where.suffix == ".md" and anchor not in anchors(where):
                wrong.append(f"{page}: {target} (no such heading)")
    return wrong


def test_every_relative_link_lands():
    wrong = [w for page in pages() for w in broken(page)]
    assert wrong == [], "\n".join(wrong)


def test_a_broken_link_is_caught(tmp_path):
    """Negative proof: a missing file and a missing heading are both named."""
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Other\n\n## A section\n")
    page.write_text("[ok](other.md#a-section) [gone](gone.md) [moved](other.md#old-section) [self](#page)\n# Page\n")
    assert broken(page, tmp_path) == ["page.md: gone.md (no such file)",
                                      "page.md: other.md#old-section (no such heading)"]
