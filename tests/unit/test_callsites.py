"""The call-site rules on a small synthetic vLLM and consumer (the real sources: tests/contract/
test_callsite_audit.py): what is checked, where it stays silent, and what bridges a break."""
import textwrap
import zipfile

import pytest
from packaging.specifiers import SpecifierSet

from vllm_compat import callsites
from vllm_compat.adapter import Adapter, Expect, Patch, Scope
from vllm_compat.probes.shapes import ABSENT, MISSING, OPTIONAL, PRESENT, Exists, Param
from vllm_compat.probes.static import DirTree, StaticSource

VLLM = {
    "vllm/__init__.py": "",
    "vllm/mod.py": """
        import torch
        from dataclasses import dataclass


        class Outside(torch.nn.Module):
            pass


        class Engine:
            def __init__(self, config, *, block_size):
                self.ready = True

            def step(self, n, limit=4) -> "Output":
                pass

            def run(self, *args, **kwargs):
                pass


        @dataclass
        class Output:
            tokens: int
            done: bool = False


        def build(a, b=1) -> Engine:
            pass
    """,
}
CONSUMER = """
    from vllm.mod import Engine, Outside, build, gone


    class Generator:
        def __init__(self):
            self.engine = Engine(1, block_size=2)

        def go(self, args, kwargs):
            self.engine.step(1, 2, 3)
            self.engine.step(*args)
            self.engine.step(**kwargs)
            self.engine.run(1, x=2)
            self.engine.stepp()
            engine = build(1)
            engine.step(1, limit=2, extra=3)
            Outside(1, 2, foo=3)
            self.engine.ready
            out = self.engine.step(1)
            out.tokens
            out.missing_field
            Engine(1)
"""


def write(root, files):
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


@pytest.fixture
def trees(tmp_path):
    write(tmp_path / "v", VLLM)
    write(tmp_path / "c", {"speculators/__init__.py": "", "speculators/data_generation/__init__.py": "",
                           "speculators/data_generation/vllm_hidden_states_generator.py": CONSUMER})
    return StaticSource(DirTree(tmp_path / "v")), tmp_path / "c"


def adapter(adapter_id, expect=None, patches=()):
    return Adapter(id=adapter_id, summary="", drift="", scope=Scope.GLOBAL, vllm=SpecifierSet(">=0"),
                   verified_through="0.32.0", patches=tuple(patches), expect=expect)


def by_line(sites):
    lines = CONSUMER.splitlines()
    out = {}
    for site in sites:
        line = int(site.site.rsplit(":", 1)[1])
        out.setdefault(lines[line - 1].strip(), []).append((site.status, site.problem, site.by))
    return out


def test_what_is_checked_and_where_it_stays_silent(trees):
    source, consumer = trees
    found = by_line(callsites.check(source, [], consumer))
    assert found["self.engine.step(1, 2, 3)"] == [("PROBLEM", "3 positional arguments, at most 2 accepted", "")]
    assert found["self.engine.stepp()"] == [("PROBLEM", "no attribute 'stepp' on vllm.mod:Engine", "")]
    assert found["engine.step(1, limit=2, extra=3)"] == [("PROBLEM", "no parameter 'extra'", "")]
    assert found["out.missing_field"] == [("PROBLEM", "no attribute 'missing_field' on vllm.mod:Output", "")]
    assert found["Engine(1)"] == [("PROBLEM", "required parameter 'block_size' not passed", "")]
    assert ("PROBLEM", "name not found", "") in found["from vllm.mod import Engine, Outside, build, gone"]
    # spread arguments, **kwargs in the definition, a base class outside vLLM, attributes set on self
    # and dataclass fields: checked where they can be, never a false alarm
    for line in ("self.engine.step(*args)", "self.engine.step(**kwargs)", "self.engine.run(1, x=2)",
                 "Outside(1, 2, foo=3)", "self.engine.ready", "out.tokens", "out = self.engine.step(1)"):
        assert all(status == "ok" for status, _, _ in found.get(line, [("ok", "", "")])), (line, found.get(line))


def test_an_adapter_bridges_exactly_the_parameter_its_expect_check_names(trees):
    source, consumer = trees
    extra = adapter("drop_extra", Expect(Param("vllm.mod:Engine.step", "extra"), old={OPTIONAL}, new={ABSENT}))
    other = adapter("drop_other", Expect(Param("vllm.mod:Engine.step", "other"), old={OPTIONAL}, new={ABSENT}))
    found = by_line(callsites.check(source, [other, extra], consumer))
    assert found["engine.step(1, limit=2, extra=3)"] == [("bridged", "no parameter 'extra'", "drop_extra")]
    assert found["self.engine.step(1, 2, 3)"][0][0] == "PROBLEM"  # no adapter declares a positional change


def test_a_missing_name_is_bridged_by_a_patch_that_creates_it(trees):
    source, consumer = trees
    alias = adapter("alias_gone", Expect(Exists("vllm.mod:gone"), old={PRESENT}, new={MISSING}),
                    [Patch("vllm.mod:gone", lambda _: None, create=True)])
    replaces = adapter("wraps_engine", None, [Patch("vllm.mod:Engine", lambda original: original)])
    found = by_line(callsites.check(source, [replaces, alias], consumer))
    assert ("bridged", "name not found", "alias_gone") in found["from vllm.mod import Engine, Outside, build, gone"]
    # a patch on a class (no create) says nothing about which parameter it fixes
    assert found["Engine(1)"] == [("PROBLEM", "required parameter 'block_size' not passed", "")]


def test_the_consumer_read_from_a_wheel_gives_the_same_findings(trees, tmp_path):
    source, consumer = trees
    wheel = tmp_path / "speculators-0.0.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for path in consumer.rglob("*.py"):
            zf.write(path, path.relative_to(consumer).as_posix())
    assert callsites.check(source, [], wheel) == callsites.check(source, [], consumer)
    assert any(site.status == "PROBLEM" for site in callsites.check(source, [], wheel))
