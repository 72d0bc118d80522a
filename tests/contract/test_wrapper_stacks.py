"""The wrapper chains apply() leaves on the real vLLM and speculators are the declared stacks
(registry.wrapper_stacks, docs/adapters.md "Shared patch targets"): on every name several adapters
replace, the adapters this release and consumer need sit there once each, outermost first, in the
declared order, and revert() takes them all off."""
import importlib.util
import json
import subprocess
import sys

import pytest

import vllm_compat
from vllm_compat import registry
from vllm_compat.wrapping import stack


@pytest.fixture
def applied():
    report = vllm_compat.apply()
    yield report
    vllm_compat.revert()


def _live_targets():
    """The shared targets whose module is imported here (the conftest imported the consumer's); a
    skip, saying so, where none is (the checks below would hold over nothing)."""
    targets = {t: ids for t, ids in registry.wrapper_stacks().items() if t.split(":")[0] in sys.modules}
    if not targets:
        pytest.skip("no module holding a shared patch target is imported here")
    return targets


def test_live_chain_after_apply_is_the_declared_order(applied):
    targets = _live_targets()
    for target, declared in targets.items():
        expected = tuple(a for a in declared if applied[a].status == "applied")
        assert stack(target) == expected, (target, {a: applied[a].status for a in declared})
    if importlib.util.find_spec("speculators") is not None:
        assert any(len(stack(t)) > 1 for t in targets), \
            "with a speculators generator on the path, some name should carry two adapters"


def test_revert_takes_every_stack_off(applied):
    worn = [t for t in _live_targets() if stack(t)]
    vllm_compat.revert()
    assert [t for t in worn if stack(t)] == []
    if importlib.util.find_spec("speculators") is not None:
        assert worn, "apply() put no adapter on any shared name"


# How users run it: apply() first, then the generator and its worker extension import, so their
# names are wrapped by post-import hooks, in the order the hooks were registered. A fresh process.
HOOKED = """
import importlib, json, vllm_compat
from vllm_compat import registry
from vllm_compat.consumer import GENERATOR, WORKER_EXTENSION
from vllm_compat.wrapping import stack
report = vllm_compat.apply()
armed = sorted(r.id for r in report.results if r.status == "armed")
importlib.import_module(GENERATOR)
importlib.import_module(WORKER_EXTENSION.split(":")[0])
applied = {r.id for r in vllm_compat.status().results if r.status == "applied"}
print(json.dumps({"armed": armed, "stacks": {t: [list(stack(t)), [a for a in ids if a in applied]]
                                             for t, ids in registry.wrapper_stacks().items()}}))
"""


def test_chain_built_by_import_hooks_is_the_declared_order():
    if importlib.util.find_spec("speculators") is None:
        pytest.skip("no speculators on the path (the matrix runs this suite once per speculators release)")
    done = subprocess.run([sys.executable, "-c", HOOKED], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["armed"], "apply() before the import should have armed the consumer's adapters"
    for target, (live, declared) in seen["stacks"].items():
        assert live == declared, target
    assert any(len(live) > 1 for live, _ in seen["stacks"].values())
