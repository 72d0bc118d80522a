"""One version everywhere: the newest release heading of CHANGELOG.md, ``vllm_compat.__version__``,
the version pyproject.toml builds the package with, and what ``vllm-compat --version`` and
``hidden-states --version`` print. And the changelog keeps Keep a Changelog 1.1.0's shape."""
from __future__ import annotations

import datetime
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.version import Version

import vllm_compat

ROOT = Path(__file__).resolve().parents[2]
SECTIONS = ("Added", "Changed", "Deprecated", "Removed", "Fixed", "Security")
RELEASE = re.compile(r"## \[(\d+\.\d+\.\d+)\] - (\d{4}-\d{2}-\d{2})")


def releases(text: str) -> list[tuple[str, str]]:
    """(version, date) of every release heading, top down; ValueError naming the first heading or
    section out of shape."""
    lines = text.splitlines()
    headings = [line for line in lines if line.startswith("#")]
    if not headings or headings[0] != "# Changelog":
        raise ValueError("the file starts with '# Changelog'")
    if len(headings) < 2 or headings[1] != "## [Unreleased]":
        raise ValueError("'## [Unreleased]' comes first")
    found, seen, section, entries = [], set(), None, 0
    for line in lines[lines.index("## [Unreleased]") + 1:] + ["## end"]:
        if line.startswith("#") and section is not None and not entries:
            raise ValueError(f"{section!r} has no entry")
        if line == "## end":
            break
        if line.startswith("## "):
            match = RELEASE.fullmatch(line)
            if not match:
                raise ValueError(f"not '## [X.Y.Z] - YYYY-MM-DD': {line!r}")
            datetime.date.fromisoformat(match.group(2))  # a real date
            found.append((match.group(1), match.group(2)))
            seen, section = set(), None
        elif line.startswith("### "):
            name = line[4:]
            if name not in SECTIONS:
                raise ValueError(f"not a Keep a Changelog section ({', '.join(SECTIONS)}): {line!r}")
            if name in seen:
                raise ValueError(f"{line!r} twice under one release")
            seen.add(name)
            section, entries = line, 0
        elif line.startswith("#"):
            raise ValueError(f"a heading the changelog does not use: {line!r}")
        elif line.startswith("- "):
            if section is None:
                raise ValueError(f"an entry outside a section: {line[:60]!r}")
            entries += 1
    for (newer, newer_date), (older, older_date) in zip(found, found[1:]):
        if not Version(newer) > Version(older):
            raise ValueError(f"versions must decrease downwards: {newer} above {older}")
        if newer_date < older_date:
            raise ValueError(f"dates must not increase downwards: {newer} ({newer_date}) above {older} ({older_date})")
    return found


def newest_release(text: str) -> str:
    found = releases(text)
    if not found:
        raise ValueError("no release heading")
    return found[0][0]


def pyproject_version() -> str:
    """The version pyproject.toml gives the package: a literal, or the attribute it names."""
    text = (ROOT / "pyproject.toml").read_text()
    literal = re.search(r'^version\s*=\s*"([^"]+)"', text, flags=re.M)
    if literal:
        return literal.group(1)
    assert re.search(r'^dynamic\s*=\s*\[[^\]]*"version"', text, flags=re.M), "pyproject.toml gives no version"
    attr = re.search(r'^version\s*=\s*\{\s*attr\s*=\s*"([\w.]+)"\s*\}', text, flags=re.M)
    assert attr, "a dynamic version without [tool.setuptools.dynamic] version = {attr = ...}"
    module, _, name = attr.group(1).rpartition(".")
    source = ROOT / Path(*module.split(".")) / "__init__.py"
    # setuptools reads a literal assignment without importing the package; so does this
    assigned = re.search(rf'^{re.escape(name)}\s*=\s*"([^"]+)"', source.read_text(), flags=re.M)
    assert assigned, f"{source.relative_to(ROOT)} assigns no literal {name}"
    return assigned.group(1)


def printed_version(module: str) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "-m", module, "--version"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_changelog_has_keep_a_changelog_shape():
    assert releases((ROOT / "CHANGELOG.md").read_text())


def test_package_version_is_the_newest_release():
    newest = newest_release((ROOT / "CHANGELOG.md").read_text())
    assert vllm_compat.__version__ == newest, (
        f"CHANGELOG.md's newest release is {newest}, vllm_compat.__version__ is {vllm_compat.__version__}")
    assert pyproject_version() == newest


@pytest.mark.parametrize("module, prog", [("vllm_compat", "vllm-compat"), ("hidden_states", "hidden-states")])
def test_cli_prints_the_newest_release(module, prog):
    newest = newest_release((ROOT / "CHANGELOG.md").read_text())
    assert printed_version(module) == f"{prog} {newest}"


GOOD = """# Changelog

## [Unreleased]

## [0.2.0] - 2026-12-02

### Added
- b

## [0.1.0] - 2026-12-01

### Fixed
- a
"""


@pytest.mark.parametrize("change, says", [
    (("## [0.2.0] - 2026-12-02", "## [0.2.0] - 2026-11-30"), "dates must not increase"),
    (("## [0.2.0] - 2026-12-02", "## [0.0.9] - 2026-12-02"), "versions must decrease"),
    (("## [0.2.0] - 2026-12-02", "## [0.2.0]"), "not '## [X.Y.Z] - YYYY-MM-DD'"),
    (("## [0.2.0] - 2026-12-02", "## 0.2.0 - 2026-12-02"), "not '## [X.Y.Z] - YYYY-MM-DD'"),
    (("### Added", "### Tests"), "not a Keep a Changelog section"),
    (("### Fixed\n- a", "### Fixed\n- a\n\n### Fixed\n- c"), "twice under one release"),
    (("### Added\n- b\n", "### Added\n"), "has no entry"),
    (("## [Unreleased]\n\n", ""), "'## [Unreleased]' comes first"),
    (("2026-12-01", "2026-13-01"), "month must be in 1..12"),
])
def test_shape_check_catches(change, says):
    """Negative proofs for the checks above: each break of the shape is named."""
    assert releases(GOOD) == [("0.2.0", "2026-12-02"), ("0.1.0", "2026-12-01")]
    with pytest.raises(ValueError, match=re.escape(says)):
        releases(GOOD.replace(*change))
