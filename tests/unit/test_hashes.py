"""The audit's "unchanged since verified" line: files read recorded, compared with a stored release."""
import importlib.util
import json
import sys
from pathlib import Path

from packaging.version import Version

from vllm_compat import hashes
from vllm_compat.probes.static import DirTree
from vllm_compat.registry import adapters

ROOT = Path(__file__).resolve().parents[2]


def tree_of(tmp_path, files: dict[str, str]) -> DirTree:
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return DirTree(tmp_path)


FILES = {"vllm/__init__.py": "", "vllm/config.py": "class C: pass\n", "vllm/v1/base.py": "def f(a): pass\n",
         "vllm/_version.py": "__version__ = '0.32.0+cpu'\n", "torch/__init__.py": "x = 1\n"}
READS = ["vllm/__init__.py", "vllm/config.py", "vllm/v1/base.py", "vllm/_version.py", "torch/__init__.py",
         "vllm/v1/new.py"]


class Overlay:
    def __init__(self, tree, replaced):
        self.tree, self.replaced, self.label = tree, replaced, "overlay"

    def read(self, relpath):
        return self.replaced[relpath] if relpath in self.replaced else self.tree.read(relpath)


def recorded(tree) -> hashes.RecordingTree:
    recording = hashes.RecordingTree(tree)
    for rel in READS:
        recording.read(rel)
    return recording


def store_of(tree) -> dict:
    with hashes.capture() as made:
        recorded(tree)
    return {"0.32.0": hashes.entry(made, ["hs-connectors==0.9.0"])}


def test_only_vllm_files_are_recorded_and_per_build_ones_are_not(tmp_path):
    entry = store_of(tree_of(tmp_path, FILES))["0.32.0"]
    assert sorted(entry["files"]) == ["vllm/__init__.py", "vllm/config.py", "vllm/v1/base.py"]
    assert entry["absent"] == ["vllm/v1/new.py"]
    assert entry["files"]["vllm/config.py"] == hashes.digest("class C: pass\n")


def test_identical_tree_has_nothing_to_review(tmp_path):
    tree = tree_of(tmp_path, FILES)
    unchanged = hashes.compare(recorded(tree), "0.33.0", store_of(tree))
    assert unchanged == {"baseline": "0.32.0", "identical": 3, "read": 3, "changed": [], "new": [], "gone": []}
    assert hashes.render(unchanged) == ("unchanged since verified vllm 0.32.0: 3 of 3 files the audit read are "
                                        "byte-identical; nothing to review")


def test_one_changed_file_is_exactly_the_one_listed(tmp_path):
    tree = tree_of(tmp_path, FILES)
    store = store_of(tree)
    unchanged = hashes.compare(recorded(Overlay(tree, {"vllm/v1/base.py": "def f(a, b): pass\n"})), "0.33.0", store)
    assert (unchanged["changed"], unchanged["new"], unchanged["gone"]) == (["vllm/v1/base.py"], [], [])
    assert hashes.render(unchanged).endswith("2 of 3 files the audit read are byte-identical; review: vllm/v1/base.py")


def test_a_file_absent_in_the_baseline_and_present_now_is_new(tmp_path):
    tree = tree_of(tmp_path, FILES)
    store = store_of(tree)
    unchanged = hashes.compare(recorded(Overlay(tree, {"vllm/v1/new.py": "y = 2\n"})), "0.34.0", store)
    assert (unchanged["identical"], unchanged["read"], unchanged["changed"], unchanged["new"]) == (
        3, 4, [], ["vllm/v1/new.py"])
    assert hashes.render(unchanged).endswith("review: vllm/v1/new.py (new)")


def test_a_file_gone_is_listed_and_the_per_build_file_never_is(tmp_path):
    tree = tree_of(tmp_path, FILES)
    store = store_of(tree)
    now = Overlay(tree, {"vllm/config.py": None, "vllm/_version.py": "__version__ = '0.33.0'\n"})
    unchanged = hashes.compare(recorded(now), "0.33.0", store)
    assert (unchanged["identical"], unchanged["read"], unchanged["changed"], unchanged["gone"]) == (
        2, 2, [], ["vllm/config.py"])


def test_the_baseline_is_the_newest_recorded_release_not_after_the_audited_one():
    store = {"0.17.0": {}, "0.32.0": {}, "0.26.0": {}}
    assert hashes.baseline("0.30.1", store) == "0.26.0"
    assert hashes.baseline("0.32.0+cpu", store) == "0.32.0"
    assert hashes.baseline("0.32.1rc1", store) == "0.32.0"
    assert hashes.baseline("0.11.0", store) == "0.32.0"  # older than every record: the newest
    assert hashes.baseline(None, store) == "0.32.0"
    assert hashes.baseline("0.33.0", {}) is None and hashes.compare(hashes.RecordingTree(None), "0.33.0", {}) is None
    assert hashes.render(None) == ""


def test_the_shipped_store_holds_only_releases_verified_here():
    """Each recorded release is one the test matrix runs and no newer than the adapters were verified on."""
    sys.path.insert(0, str(ROOT / "scripts"))  # the matrix script imports its neighbour vllm_venv
    script = sys.modules.get("matrix_script")  # loaded once, as test_matrix_selection loads it
    if script is None:
        spec = importlib.util.spec_from_file_location("matrix_script", ROOT / "scripts" / "test_matrix.py")
        script = sys.modules["matrix_script"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(script)
    MATRIX = script.MATRIX

    store = json.loads(hashes.STORE.read_text())
    newest = max(Version(str(a.verified_through)) for a in adapters())
    assert store and set(store) <= set(MATRIX)
    for release, entry in store.items():
        assert Version(release) <= newest
        assert entry["files"] and all(p.startswith("vllm/") and h.startswith("sha256:")
                                      for p, h in entry["files"].items())
        assert "vllm/_version.py" not in entry["files"]
        assert {"speculators==0.4.0", "hs-connectors==0.9.0"} <= set(entry["consumers"])


def test_the_store_ships_with_the_package():
    text = (ROOT / "pyproject.toml").read_text()
    assert '[tool.setuptools.package-data]\nvllm_compat = ["data/*.json"]' in text
