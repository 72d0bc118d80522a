"""Any consumer is audited alike: the same code under another name gets the same call-site verdicts and
the same engine facts, once its definition carries the same data (scan, shim, generator); what differs
between speculators and a generic consumer is that data, nothing else. And the audit holds one
generator's engine facts, so a second consumer with a generator is refused (exit 2)."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from tests.unit.synthetic_wheels import ENGINE_VLLM_FILES
from vllm_compat import callsites, consumer
from vllm_compat.audit import audit
from vllm_compat.cli import main
from vllm_compat.consumer import SPECULATORS_AUDIT, BuiltIn, Generator
from vllm_compat.consumer_tree import builtin, resolve
from vllm_compat.probes.static import DirTree, StaticSource
from vllm_compat.registry import adapters

VLLM = ENGINE_VLLM_FILES

# one module of each kind of verdict: fits, missing, too many arguments, bridged by an adapted adapter
# (request_eos_token_id: Request's eos_token_id), a break only type checkers run
GENERATOR_TEXT = ("from typing import TYPE_CHECKING\n"
                  "from vllm.v1.executor.abstract import Executor\n"
                  "from vllm.v1.core.sched.scheduler import Scheduler\n"
                  "from vllm.v1.request import Request, Gone\n"
                  "if TYPE_CHECKING:\n"
                  "    from vllm.v1.request import Typed\n"
                  "class VllmHiddenStatesGenerator:\n"
                  "    def __init__(self, config):\n"
                  "        self.executor = Executor(config)\n"
                  "        self.scheduler = Scheduler(config)\n"
                  "    def generate(self, ids):\n"
                  "        Request(1, ids, None, None, 5)\n"
                  "        Request(1, ids, None, None, eos_token_id=2)\n"
                  "        return self.scheduler.schedule()\n")
WORKER_TEXT = "from vllm.v1.request import Request\nclass Mixed(Request):\n    pass\n"


def package(name: str) -> dict[str, str]:
    """The same code as the package ``name`` (its data_generation modules, and one deeper module)."""
    return {f"{name}/__init__.py": "",
            f"{name}/data_generation/__init__.py": "",
            f"{name}/data_generation/vllm_hidden_states_generator.py": GENERATOR_TEXT,
            f"{name}/data_generation/custom_worker.py": WORKER_TEXT,
            f"{name}/data_generation/deep/__init__.py": "",
            f"{name}/data_generation/deep/probe.py": "from vllm.v1.request import Deep\n"}


def write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def verdicts(sites, prefix: str) -> list[tuple]:
    """Each site's verdict, its file named from the package root (``prefix`` dropped)."""
    return [(s.site.removeprefix(prefix), s.kind, s.target, s.where, s.status, s.problem, s.by) for s in sites]


@pytest.fixture
def trees(tmp_path):
    return (StaticSource(DirTree(write(tmp_path / "vllm-src", VLLM))),
            write(tmp_path / "spec", package("speculators")), write(tmp_path / "acme-src", package("acme")))


def eos_adapter():
    return [a for a in adapters() if a.id == "request_eos_token_id"]


def test_the_same_code_under_two_names_gets_the_same_call_site_verdicts(trees):
    source, spec, acme_root = trees
    speculators = builtin(SPECULATORS_AUDIT, "0.4.0", spec)
    acme = resolve(str(acme_root / "acme"))
    as_speculators = replace(acme, scan=replace(SPECULATORS_AUDIT.scan, under="acme.data_generation"), shim=True)
    adapted = eos_adapter()
    theirs = callsites.check_consumers(source, adapted, [speculators])
    theirs = [s for s in theirs if s.consumer == "speculators==0.4.0"]
    ours = [s for s in callsites.check_consumers(source, adapted, [as_speculators]) if s.consumer == "acme"]
    assert verdicts(ours, "acme/") == verdicts(theirs, "speculators/")
    statuses = {s.status for s in theirs}
    assert {callsites.OK, callsites.BRIDGED, callsites.PROBLEM} <= statuses  # each kind of verdict is compared
    # the generic defaults read more, by their data alone: the deeper module, and the import under
    # TYPE_CHECKING as a warning
    default = [(s.site, s.status) for s in callsites.check_consumers(source, adapted, [replace(acme, shim=True)])
               if s.consumer == "acme" and s.status != callsites.OK]
    assert ("acme/data_generation/deep/probe.py:1", callsites.PROBLEM) in default
    assert ("acme/data_generation/vllm_hidden_states_generator.py:6", callsites.WARNING) in default
    assert ("speculators/data_generation/vllm_hidden_states_generator.py:6", callsites.PROBLEM) in [
        (s.site, s.status) for s in theirs]


def acme_builtin(generator: bool = True) -> BuiltIn:
    """acme as a built-in consumer with speculators' data, its generator in its own package."""
    found = Generator("acme.data_generation.vllm_hidden_states_generator", SPECULATORS_AUDIT.generator.klass,
                      SPECULATORS_AUDIT.generator.phases, SPECULATORS_AUDIT.generator.not_needed)
    return BuiltIn(package="acme", releases=">=1.0", refusals=(("", "acme {version}: not audited ({releases})"),),
                   scan=replace(SPECULATORS_AUDIT.scan, under="acme.data_generation"),
                   generator=found if generator else None)


def test_a_generator_read_through_another_consumer_gives_the_same_engine_facts(trees, monkeypatch):
    source, spec, acme_root = trees
    vllm = source.tree.root
    monkeypatch.setitem(consumer.BUILTIN_CONSUMERS, "acme", acme_builtin())
    theirs = audit(vllm, consumer="speculators==0.4.0", consumer_source=spec)
    ours = audit(vllm, consumer="acme==1.0", consumer_source=acme_root)
    assert ours.engine_steps == theirs.engine_steps
    assert [(s.step, s.status) for s in theirs.engine_steps] == [
        ("executor.warm_up", "PROBLEM"), ("scheduler.has_requests", "not needed"), ("executor.execute_model", "PROBLEM")]
    assert (ours.config_fields, ours.config_baseline, ours.behaviour_notes) == (
        theirs.config_fields, theirs.config_baseline, theirs.behaviour_notes)
    assert [c["engine"] for c in ours.consumers] == [True] and ours.consumer == "acme==1.0"
    mine = [s for s in ours.call_sites if s.consumer == "acme==1.0"]
    assert mine and verdicts(mine, "acme/") == verdicts(
        [s for s in theirs.call_sites if s.consumer == "speculators==0.4.0"], "speculators/")


def test_two_consumers_with_a_generator_are_refused(trees, monkeypatch, capsys):
    source, spec, acme_root = trees
    vllm = str(source.tree.root)
    monkeypatch.setitem(consumer.BUILTIN_CONSUMERS, "acme", acme_builtin())
    assert main(["audit", "--vllm", vllm, "--consumer", "speculators==0.4.0", "--consumer", "acme==1.0"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.strip() == ("vllm-compat: error: --consumer: 2 consumers with a generator "
                                    "(speculators==0.4.0, acme==1.0); the audit compares one")
    # one generator beside a built-in without one is audited
    monkeypatch.setitem(consumer.BUILTIN_CONSUMERS, "acme", acme_builtin(generator=False))
    assert main(["audit", "--vllm", vllm, "--consumer", "speculators==0.4.0", "--consumer", "acme==1.0",
                 "--consumer-source", str(spec)]) == 1
    assert "consumer acme==1.0 (acme; runs vllm_compat.apply()" in capsys.readouterr().out
