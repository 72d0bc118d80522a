"""Subclass contracts on a small synthetic vLLM and consumer package (the real hs_connectors against
vLLM 0.34.0: tests/contract/test_contracts.py)."""
import ast
import textwrap

from vllm_compat import callsites
from vllm_compat.callsites.analyzer import CLASS, ModuleAnalysis
from vllm_compat.callsites.contracts import OK, PROBLEM, WARNING, subclass_contracts
from vllm_compat.callsites.signatures import VllmIndex
from vllm_compat.probes.static import DirTree, StaticSource

BASE = """
    from abc import ABC, abstractmethod


    class Base(ABC):
        @abstractmethod
        def load(self, request, n: int):
            ...

        def save(self, layer, *, force=False):
            ...

        def helper(self):
            ...


    class Example(Base):
        def load(self, request, n: int):
            ...

        @staticmethod
        def _write(tensors, name):
            ...
"""
CONSUMER = """
    from vllm.connector import base as _base_mod
    from vllm.connector.base import Base


    class Mine(Base):
        def load(self, request, n):
            self.stamp()

        def save(self, layer, **kwargs):
            ...

        def stamp(self):
            ...


    class Middle(_base_mod.Example):
        pass


    class Fp8(Middle):
        @staticmethod
        def _write(tensors, name):
            ...
"""


def build(tmp_path, base=BASE, consumer=CONSUMER):
    files = {"vllm/__init__.py": "", "vllm/connector/__init__.py": "", "vllm/connector/base.py": base,
             "pkg/__init__.py": "", "pkg/conn.py": consumer}
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    index = VllmIndex(StaticSource(DirTree(tmp_path)))
    tree = ast.parse((tmp_path / "pkg/conn.py").read_text())
    return subclass_contracts(index, tree, "pkg/conn.py", "pkg")


def lines(text: str, needle: str) -> int:
    return next(i for i, line in enumerate(textwrap.dedent(text).splitlines(), 1) if needle in line)


def not_ok(findings):
    return [(f.status, f.site, f.target, f.problem) for f in findings if f.status != OK]


def test_unchanged_tree_has_no_problem_and_checks_every_override(tmp_path):
    found = build(tmp_path)
    assert not_ok(found) == []
    assert {(f.site, f.target.rsplit(":", 1)[1]) for f in found} == {
        (f"pkg/conn.py:{lines(CONSUMER, 'def load')}", "Base.load"),
        (f"pkg/conn.py:{lines(CONSUMER, 'def save')}", "Base.save"),
        (f"pkg/conn.py:{lines(CONSUMER, 'def _write')}", "Example._write"),
    }


def test_new_abstract_method_is_a_problem_at_the_class_line(tmp_path):
    base = BASE.replace("        def helper(self):", "        @abstractmethod\n        def flush(self):\n"
                        "            ...\n\n        def helper(self):")
    found = not_ok(build(tmp_path, base=base))
    # Mine does not implement it; Example (vLLM's) does not either, so Middle and Fp8 inherit the gap
    assert [(s, site) for s, site, target, _ in found if target.endswith("Base.flush")] == [
        (PROBLEM, f"pkg/conn.py:{lines(CONSUMER, 'class Mine')}"),
        (PROBLEM, f"pkg/conn.py:{lines(CONSUMER, 'class Middle')}"),
        (PROBLEM, f"pkg/conn.py:{lines(CONSUMER, 'class Fp8')}"),
    ]
    assert len(found) == 3
    where = next(f.where for f in build(tmp_path, base=base) if f.target.endswith("Base.flush"))
    assert where == f"vllm/connector/base.py:{lines(base, 'def flush') - 1}"  # its decorator, as inspect reports


def test_base_method_gaining_a_required_parameter_is_a_problem_at_the_override(tmp_path):
    base = BASE.replace("def load(self, request, n: int):\n            ...\n\n        def save",
                        "def load(self, request, n: int, blocks):\n            ...\n\n        def save")
    assert not_ok(build(tmp_path, base=base)) == [
        (PROBLEM, f"pkg/conn.py:{lines(CONSUMER, 'def load')}", "vllm.connector.base:Base.load",
         "base requires 'blocks' (argument 3), the override does not accept it")]
    # a renamed parameter (same arity): whether vLLM passes it by keyword is not read, so not reported
    assert not_ok(build(tmp_path, base=BASE.replace("request, n: int):\n            ...\n\n        def save",
                                                    "request, count: int):\n            ...\n\n        def save"))) == []
    # a new required keyword-only parameter: the override's **kwargs takes it, so nothing is wrong
    base = BASE.replace("*, force=False", "*, force=False, layer_id")
    assert not_ok(build(tmp_path, base=base)) == []
    # a private static method gaining one (the override is reached through the consumer's Middle)
    base = BASE.replace("def _write(tensors, name)", "def _write(tensors, name, lock)")
    assert not_ok(build(tmp_path, base=base)) == [
        (PROBLEM, f"pkg/conn.py:{lines(CONSUMER, 'def _write')}", "vllm.connector.base:Example._write",
         "base requires 'lock' (argument 3), the override does not accept it")]


def test_override_of_a_removed_method_is_a_warning(tmp_path):
    base = BASE.replace("        @staticmethod\n        def _write(tensors, name):\n            ...\n", "")
    found = not_ok(build(tmp_path, base=base))
    assert [(s, site) for s, site, _, _ in found] == [(WARNING, f"pkg/conn.py:{lines(CONSUMER, 'def _write')}")]
    assert "Fp8._write overrides nothing" in found[0][3]
    # the consumer's own helper (it calls self.stamp()) is never reported
    assert not any("stamp" in problem for _, _, _, problem in found)


def test_override_requiring_a_parameter_vllm_never_passes(tmp_path):
    consumer = CONSUMER.replace("def save(self, layer, **kwargs)", "def save(self, layer, extra, *, force=False)")
    assert [p for _, _, _, p in not_ok(build(tmp_path, consumer=consumer))] == [
        "the override requires 'extra', which the base (so vLLM's calls) does not pass"]


def test_unknown_base_outside_vllm_silences_abstract_and_nothing_checks(tmp_path):
    base = BASE.replace("        def helper(self):", "        @abstractmethod\n        def flush(self):\n"
                        "            ...\n\n        def helper(self):")
    consumer = "from thirdparty import Mixin\nfrom vllm.connector.base import Base\n\n\n" \
               "class Mine(Mixin, Base):\n    def extra(self):\n        ...\n"
    assert not_ok(build(tmp_path, base=base, consumer=consumer)) == []


def test_analyzer_records_class_bases_and_contracts_are_call_sites(tmp_path):
    build(tmp_path)
    index = VllmIndex(StaticSource(DirTree(tmp_path)))
    analysis = ModuleAnalysis(index, ast.parse(textwrap.dedent(CONSUMER)), "pkg/conn.py", "pkg")
    assert [(v.kind, v.target) if v else None for v in analysis.class_bases["Mine"]] == [
        (CLASS, "vllm.connector.base:Base")]
    assert [(v.kind, v.target) if v else None for v in analysis.class_bases["Middle"]] == [
        (CLASS, "vllm.connector.base:Example")]
    assert analysis.class_bases["Fp8"] == (None,)
    # they are the call-site audit's own findings
    found = subclass_contracts(index, ast.parse(textwrap.dedent(CONSUMER)), "pkg/conn.py", "pkg")
    assert found and all(type(f) is callsites.CallSite and f.kind == "contract" for f in found)


def test_self_in_a_subclass_of_a_vllm_class_reaches_the_bases_members(tmp_path):
    build(tmp_path)
    consumer = textwrap.dedent("""
        from vllm.connector.base import Base


        class Own:
            extra = 1


        class Mine(Base):
            def load(self, request, n):
                self.helper(1)
                self.gone()
                self.stamp(2)
                meta = self.made()
                if isinstance(meta, Own):
                    meta.extra

            def stamp(self, x):
                super().__init__(1)
                super().save(1, force=True, hard=True)

            def made(self) -> Base:
                ...
    """)
    index = VllmIndex(StaticSource(DirTree(tmp_path)))
    analysis = ModuleAnalysis(index, ast.parse(consumer), "pkg/conn.py", "pkg")
    problems = sorted((r.site, r.target, r.problem) for r in analysis.references if r.problem)
    at = lines(consumer, "self.helper(1)")
    assert problems == [
        (f"pkg/conn.py:{at}", "vllm.connector.base:Base.helper", "1 positional arguments, at most 0 accepted"),
        (f"pkg/conn.py:{at + 1}", "vllm.connector.base:Base.gone", "no attribute 'gone' on vllm.connector.base:Base"),
        (f"pkg/conn.py:{at + 8}", "vllm.connector.base:Base.__init__", "1 positional arguments, at most 0 accepted"),
        (f"pkg/conn.py:{at + 9}", "vllm.connector.base:Base.save", "no parameter 'hard'"),
    ]  # the class's own stamp() is its own; meta narrowed to the consumer's class is not judged


def test_imports_under_type_checking_are_marked(tmp_path):
    build(tmp_path)
    consumer = textwrap.dedent("""
        from typing import TYPE_CHECKING
        from vllm.connector.base import Base

        if TYPE_CHECKING:
            from vllm.connector.base import Gone
    """)
    index = VllmIndex(StaticSource(DirTree(tmp_path)))
    refs = ModuleAnalysis(index, ast.parse(consumer), "pkg/conn.py", "pkg").references
    assert sorted((r.target, r.problem, r.typing_only) for r in refs) == [
        ("vllm.connector.base:Base", "", False), ("vllm.connector.base:Gone", "name not found", True)]
