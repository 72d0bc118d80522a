"""Touch points declared through the entry-point group ``vllm_compat.touchpoints`` (vllm_compat/consumer.py):
any installed distribution's entry points are found without reinstalling anything (a fake
Distribution on sys.meta_path), a broken one is named, a source checkout's pyproject stands for its
stale dist-info, a consumer read from source has its declaration read, not loaded, and the shim names
no extractor module by string."""
from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.unit.synthetic_wheels import declaring_wheel
from vllm_compat import consumer
from vllm_compat.audit import audit
from vllm_compat.consumer import TOUCHPOINTS_GROUP, DeclarationError, Touchpoints
from vllm_compat.consumer_tree import from_path
from vllm_compat.probes.shapes import PRESENT, Attr

DECLARED = Touchpoints("0.20.0", ((Attr("vllm.v1.worker.gpu_worker:Worker", "load_model"), frozenset({PRESENT})),))


class FakeDistribution(importlib.metadata.Distribution):
    def __init__(self, name: str, entry_points: str):
        self._files = {"METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n",
                       "entry_points.txt": entry_points}

    def read_text(self, filename):
        return self._files.get(filename)

    def locate_file(self, path):
        return Path("/nonexistent") / path


class FakeFinder(importlib.metadata.DistributionFinder):
    def __init__(self, *dists):
        self.dists = dists

    def find_spec(self, *args, **kwargs):
        return None

    def find_distributions(self, context=importlib.metadata.DistributionFinder.Context()):
        return [d for d in self.dists if context.name is None or context.name == d.metadata["Name"]]


@pytest.fixture
def installed(monkeypatch):
    """Install fake distributions holding entry points (``installed(name, entry_points_txt)``), and a
    module ``fake_declarer`` whose ``TOUCHPOINTS`` they may name."""
    module = type(sys)("fake_declarer")
    module.TOUCHPOINTS = DECLARED
    module.make = lambda: DECLARED
    module.NOT_ONE = ("0.1.0", ())
    monkeypatch.setitem(sys.modules, "fake_declarer", module)
    finder = FakeFinder()
    monkeypatch.setattr(sys, "meta_path", [finder, *sys.meta_path])

    def install(name: str, entry_points: str):
        finder.dists = (*finder.dists, FakeDistribution(name, entry_points))

    return install


def test_an_installed_declarer_is_discovered_without_reinstalling(installed, tmp_path):
    installed("fake-consumer", f"[{TOUCHPOINTS_GROUP}]\nfake:loader = fake_declarer:TOUCHPOINTS\n"
                               "fake:made = fake_declarer:make\n\n[console_scripts]\nx = fake_declarer:make\n")
    assert consumer.declared("fake-consumer") == {"fake:loader": DECLARED, "fake:made": DECLARED}
    everyone = consumer.declared()
    assert everyone["fake:loader"] == DECLARED and {"vllm-engine", "vllm-native"} <= set(everyone)
    assert consumer.declared("other") == {}
    # the audit checks it as it checks the extractor's backends: its scope is the entry point's name
    vllm = tmp_path / "vllm"
    vllm.mkdir()
    (vllm / "__init__.py").write_text("")
    (vllm / "_version.py").write_text("__version__ = version = '0.32.0'\n")
    result = audit(tmp_path, consumer="speculators==0.3.0")
    assert [(f.id, f.verdict) for f in result.findings if f.scope == "fake:loader"] == \
        [("vllm.v1.worker.gpu_worker:Worker.load_model", "missing")]
    assert result.exit_code == 1


@pytest.mark.parametrize("value, message", [
    ("fake_missing_module:TOUCHPOINTS", r"does not load: ModuleNotFoundError: No module named 'fake_missing_module'"),
    ("fake_declarer:ABSENT", "does not load: AttributeError"),
    ("fake_declarer:NOT_ONE", "is a tuple, not vllm_compat Touchpoints"),
])
def test_a_declarer_that_does_not_load_is_named(installed, value, message):
    installed("fake-consumer", f"[{TOUCHPOINTS_GROUP}]\nbroken = {value}\n")
    with pytest.raises(DeclarationError, match=rf"entry point 'broken' \({TOUCHPOINTS_GROUP} = {value}, "
                                               rf"from fake-consumer\) {message}"):
        consumer.declared()


def test_a_checkout_pyproject_stands_for_its_stale_dist_info(installed, monkeypatch):
    """An editable install keeps the entry points it was installed with: the shim's own are read from
    the checkout it runs from (none here: the fake dist-info's stale entry is not used)."""
    installed("vllm-compat", f"[{TOUCHPOINTS_GROUP}]\nstale = fake_declarer:NOT_ONE\n")
    assert set(consumer.declared("vllm-compat")) == {"vllm-engine", "vllm-native"}
    monkeypatch.setattr(consumer, "checkout_entry_points", lambda: {})  # running from an installed wheel
    with pytest.raises(DeclarationError, match="'stale'"):
        consumer.declared("vllm-compat")


def test_pyproject_and_dist_info_entry_points_read_alike(tmp_path):
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project]\nname = "thing"\n\n[project.scripts]\nthing = "thing.cli:main"\n\n'
                         f'[project.entry-points."{TOUCHPOINTS_GROUP}"]\n# a comment\n'
                         '"thing:a" = "thing.a:TOUCHPOINTS"\nb = "thing.b:make"\n\n[tool.x]\ny = "z"\n')
    expected = {TOUCHPOINTS_GROUP: {"thing:a": "thing.a:TOUCHPOINTS", "b": "thing.b:make"},
                "console_scripts": {"thing": "thing.cli:main"}}
    assert consumer.checkout_entry_points(pyproject) == expected
    assert consumer._small_toml(pyproject.read_text())["project"]["entry-points"] == {TOUCHPOINTS_GROUP: expected[TOUCHPOINTS_GROUP]}
    installed = f"[console_scripts]\nthing = thing.cli:main\n\n[{TOUCHPOINTS_GROUP}]\nthing:a = thing.a:TOUCHPOINTS\nb = thing.b:make\n"
    assert consumer.installed_entry_points(installed) == expected
    # this repository's own declaration: the extractor's two backends
    assert consumer.checkout_entry_points(Path(ROOT) / "pyproject.toml")[TOUCHPOINTS_GROUP] == {
        "vllm-engine": "hidden_states.backends.vllm_engine:TOUCHPOINTS",
        "vllm-native": "hidden_states.backends.vllm_native:TOUCHPOINTS"}


def test_a_consumer_read_from_source_has_its_declaration_read_not_loaded(tmp_path):
    wheel = declaring_wheel(tmp_path)
    read = from_path(wheel, str(wheel))
    assert consumer.source_declarations(read.tree, read.names) == {"declaring:x": "declaring_never_imported:TOUCHPOINTS"}
    assert consumer.declaration_note(read.label, read.tree, read.names) == (
        f"declaring==1.0: touch points declared ({TOUCHPOINTS_GROUP}: declaring:x), read from source only "
        "(not installed: its declaration is not loaded or checked)")
    assert "declaring_never_imported" not in sys.modules
    # a directory holding the package beside its dist-info; and one declaring nothing
    (tmp_path / "site" / "declaring").mkdir(parents=True)
    (tmp_path / "site" / "declaring" / "__init__.py").write_text("import vllm\n")
    info = tmp_path / "site" / "declaring-1.0.dist-info"
    info.mkdir()
    (info / "entry_points.txt").write_text(f"[{TOUCHPOINTS_GROUP}]\ndeclaring:y = declaring.t:TOUCHPOINTS\n")
    folder = from_path(tmp_path / "site", str(tmp_path / "site"))
    assert consumer.source_declarations(folder.tree, folder.names) == {"declaring:y": "declaring.t:TOUCHPOINTS"}
    (info / "entry_points.txt").write_text("[console_scripts]\nd = declaring:main\n")
    assert consumer.declaration_note(folder.label, folder.tree, folder.names) is None


# A string naming the extractor's modules (``hidden_states.x[:attr]``, ``hidden_states:attr``; a bare
# "hidden_states" is also vLLM's name for a forward's argument, so only imports count for that).
EXTRACTOR_MODULE = re.compile(r"hidden_states((\.[A-Za-z_]\w*)+(:\w+)?|:\w+)")


def extractor_names(text: str) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and EXTRACTOR_MODULE.fullmatch(node.value):
            found.append((node.lineno, node.value))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "hidden_states"]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "hidden_states":
            found.append((node.lineno, node.module))
    return sorted(found)


def test_the_shim_names_no_extractor_module_by_string():
    named = [(path.relative_to(ROOT).as_posix(), line, name)
             for path in sorted((Path(ROOT) / "vllm_compat").rglob("*.py"))
             for line, name in extractor_names(path.read_text())]
    assert named == [], f"the shim names the extractor (declare through {TOUCHPOINTS_GROUP} instead): {named}"
    assert not hasattr(consumer, "EXTRACTOR_BACKENDS")
    # the check itself finds what it looks for
    planted = ('import importlib\nEXTRACTOR = "hidden_states.backends"\nfrom hidden_states import cli\n'
               'kwargs["hidden_states"] = f(entry="hidden_states.cli:main")\nimport hidden_states.x\n')
    assert extractor_names(planted) == [(2, "hidden_states.backends"), (3, "hidden_states"),
                                        (4, "hidden_states.cli:main"), (5, "hidden_states.x")]
