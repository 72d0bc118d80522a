"""docs/architecture.md's two layer tables say what the code is: the modules each row names are the
modules of that layer in ``tests/unit/layer_map.py`` (``test_layers.py`` checks the imports against it), every file a row
names exists, and the extractor's backends and formats are each named."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.unit.layer_map import EXTRACTOR_LAYERS, LAYERS

DOC = Path(ROOT) / "docs" / "architecture.md"
FILE = re.compile(r"`([\w/<>]+?(?:\.py|/))`")  # `name.py`, `sub/name.py`, `sub/`, `sub/<id>.py`


def table(section: str) -> dict[str, str]:
    """{layer: its row's modules cell} of the first layer table after the heading ``section``."""
    text = DOC.read_text()
    start = text.index(section)
    rows = {}
    for line in text[start:].splitlines()[1:]:
        if line.startswith("## "):
            break
        cells = [cell.strip() for cell in line.split("|")[1:-1]]
        if len(cells) == 3 and cells[0] not in ("layer", "---"):
            rows[cells[0]] = cells[1]
        elif rows and not line.startswith("|"):
            break
    return rows


def heads(cell: str, package: Path) -> tuple[set[str], list[str]]:
    """The package's top-level modules named in ``cell``, and the named files that do not exist."""
    named, missing = set(), []
    files = FILE.findall(cell)
    subpackages = {name.rstrip("/") for name in files if name.endswith("/")}
    for name in files:
        head = name.split("/")[0].removesuffix(".py")
        if (package / f"{head}.py").is_file() or (package / head).is_dir() and "/" in name:
            named.add(head)
            if "<" not in name and not (package / name).exists():  # `adapters/<id>.py`: any file there
                missing.append(name)
        elif not any((package / sub / name).is_file() for sub in subpackages):
            missing.append(name)
    return named, missing


CASES = [("## vllm_compat: the layers", "vllm_compat", LAYERS),
         ("## hidden_states: the extractor", "hidden_states", EXTRACTOR_LAYERS)]


@pytest.mark.parametrize("section, package, layers", CASES, ids=["vllm_compat", "hidden_states"])
def test_each_rows_modules_are_its_layers(section, package, layers):
    rows = table(section)
    # the shim's table reads top-down, the extractor's lowest first: either order, nothing else
    assert list(rows) in ([name for name, _ in layers], [name for name, _ in reversed(layers)]), list(rows)
    for name, modules in layers:
        named, missing = heads(rows[name], Path(ROOT) / package)
        assert not missing, f"docs/architecture.md, {package} {name!r}: no such file {missing}"
        listed = {m for m in modules if (Path(ROOT) / package / f"{m}.py").is_file()
                  or (Path(ROOT) / package / m).is_dir()} - {"__init__"}  # a package's own, named or not
        named -= {"__init__"}
        assert named == listed, (f"docs/architecture.md, {package} {name!r}: names {sorted(named)}, "
                                 f"the layer holds {sorted(listed)}")


@pytest.mark.parametrize("subpackage, row", [("backends", "backends"), ("inputs", "inputs"), ("output", "output"),
                                             ("output/formats", "output"), ("plan", "plan")])
def test_every_backend_and_format_module_is_named(subpackage, row):
    cell = table("## hidden_states: the extractor")[row]
    named = {Path(name).name for name in FILE.findall(cell)}
    present = {p.name for p in (Path(ROOT) / "hidden_states" / subpackage).glob("*.py") if p.name != "__init__.py"}
    assert present <= named, f"docs/architecture.md's {row} row leaves out {sorted(present - named)}"


def test_a_stale_name_is_caught(tmp_path):
    """Negative proof: a row naming a module that is gone, or leaving one out, fails."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "here.py").write_text("")
    assert heads("`here.py`, `gone.py`", package) == ({"here"}, ["gone.py"])
    (package / "other.py").write_text("")
    assert heads("`here.py`", package)[0] != {"here", "other"}  # the layer holds both, the row names one
