"""Negative proof: every adapter exists for a failure. Without apply() the generator fails; with one
adapter disabled at a time, the failure it bridges (an error, or wrong numbers) comes back.

Which adapters are active for the installed vLLM and the speculators release under test is read
from the static audit (no import), so each (vLLM, speculators) pair tests exactly its own set.
"""
import pytest

from tests.contract.negative_proofs import RUNNER_V2, negative_proof
from tests.e2e import harness
from vllm_compat.audit import audit
from vllm_compat.consumer import GENERATOR_RELEASES

pytestmark = [pytest.mark.vllm, pytest.mark.e2e]

# Enough to trip every adapter: more tokens than one step admits (chunked prompts, several steps,
# 12 sequences), and more sequences than max_num_seqs.
CALLS = [harness.scenario()[1], harness.scenario()[3]]

# What each adapter's absence looks like is stated on its contract test (tests/contract/base.py).


def observable(adapter_id: str) -> bool:
    """Host-dependent adapters count only where this host needs them; V2-only ones only where
    vLLM's CPU backend has a V2 runner to force; family-specific ones where that family runs."""
    from vllm_compat.registry import get

    adapter, facts = get(adapter_id), negative_proof(adapter_id)
    if adapter.host_probe is not None and not adapter.host_probe()[0]:
        return False
    if facts.family and not harness.family_runs_here(facts.family):
        return False
    return facts.negative_env != RUNNER_V2 or harness.runner_v2_available()


def active_adapters(speculators: str) -> list[str]:
    result = audit(consumer=f"speculators=={speculators}")
    found = [f.id for f in result.findings if f.kind == "adapter" and f.verdict == "adapted"]
    return [a for a in found if not negative_proof(a).not_observable_on_cpu
            and speculators not in negative_proof(a).same_value_on_cpu | negative_proof(a).not_called_by and observable(a)]


def expect_broken(verdict: str, expected: str, run: harness.Run) -> None:
    if expected == "wrong":
        # what goes wrong depends on the steps the scheduler makes, which the KV cache's size decides
        # (harness.KV_CACHE_BYTES): the failure says what the cache was, and the log how the run went
        assert verdict != "ok", (f"disabling the adapter changed nothing (the generator's KV cache: "
                                 f"{run.kv_cache_blocks} blocks); the run's log ends:\n{run.log[-6000:]}")
    elif expected == "error":
        assert verdict.startswith("error"), verdict
    else:
        assert verdict.startswith("error") and expected in verdict, verdict


@pytest.fixture(scope="module")
def refs(model):
    return harness.reference(model, CALLS)


CASES = [(spec, adapter) for spec in GENERATOR_RELEASES for adapter in active_adapters(spec)]


@pytest.mark.parametrize("speculators", GENERATOR_RELEASES)
def test_with_every_adapter_it_is_right(model, refs, speculators):
    run = harness.run_generator(model, speculators, CALLS)
    assert harness.judge(run, CALLS, refs) == "ok"


def test_without_apply_the_03_generator_fails(model, refs):
    run = harness.run_generator(model, "0.3.0", CALLS, apply=False)
    assert harness.judge(run, CALLS, refs) != "ok"


@pytest.mark.parametrize("speculators, adapter", CASES, ids=[f"{s}-{a}" for s, a in CASES])
def test_disabling_one_adapter_brings_its_failure_back(model, refs, speculators, adapter):
    routed, facts = frozenset(), negative_proof(adapter)
    if facts.family:
        model = harness.tiny_model(facts.family)
        refs = harness.reference(model, CALLS)
        routed = harness.ROUTED_LAYERS.get(facts.family, frozenset())
        # the same judge passes this family with every adapter on (test_generator's MLA case)
    run = harness.run_generator(model, speculators, CALLS, disable=adapter, extra_env=facts.negative_env or None)
    expect_broken(harness.judge(run, CALLS, refs, routed), facts.negative, run)
