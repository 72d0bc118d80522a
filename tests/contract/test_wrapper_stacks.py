"""The wrapper chains apply() leaves on the real vLLM and speculators are the declared stacks
(registry.wrapper_stacks, docs/adapters.md "Shared patch targets"): on every name several adapters
replace, the adapters this release and consumer need sit there once each, outermost first, in the
declared order, and revert() takes them all off."""
import importlib.util
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
    """The shared targets whose module is imported here (the conftest imported the consumer's)."""
    return {t: ids for t, ids in registry.wrapper_stacks().items() if t.split(":")[0] in sys.modules}


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
