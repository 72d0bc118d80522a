"""Negative proof: every adapter exists for a failure. Without apply() the generator fails; with one
adapter disabled at a time, the failure it bridges (an error, or wrong numbers) comes back.

Which adapters are active for the installed vLLM and the speculators release under test is read
from the static audit (no import), so each (vLLM, speculators) pair tests exactly its own set.
"""
import pytest

from tests.e2e import harness
from vllm_compat.audit import audit

pytestmark = [pytest.mark.vllm, pytest.mark.e2e]

# Enough to trip every adapter: more tokens than one step admits (chunked prompts, several steps,
# 12 sequences), and more sequences than max_num_seqs.
CALLS = [harness.scenario()[1], harness.scenario()[3]]

# What comes back when the adapter is disabled: an error mentioning the text, or "wrong" numbers.
EXPECTED = {
    "kv_cache_specs_kwarg": "kv_cache_specs",
    "scheduler_block_size": "block_size",
    "scheduler_config_is_encoder_decoder": "is_encoder_decoder",
    "prefix_caching_default": "error",
    "deferred_sampling": "sample_tokens() must be called",
    "rpc_single_reply": "wrong",
    "embed_input_ids_alias": "get_input_embeddings",
    "host_memory_info": "error",
    "prefill_abort_deferral": "wrong",
    "capture_attribution": "wrong",
    "result_order": "wrong",
    "prefill_slot_release": "not found in captured states",
    "request_eos_token_id": "eos_token_id",
    "transformers_config_annotations": "name 'torch' is not defined",
    "transformers_attn_mask_utils": "No module named 'transformers.modeling_attn_mask_utils'",
    "cache_block_size": "No common block size",
    "kv_cache_layout": "KV cache layout has not been resolved",
    "v2_batch_order": "batch order",
    "input_batch_view": "input_batch",
    "cpu_rotary_head_layout": "wrong",
    "cpu_rms_norm_strided_input": "wrong",
}
# Adapters whose failure only another model family shows (llama attention passes 2-D tensors and
# has no q/k-norm).
FAMILY_FOR = {"cpu_rotary_head_layout": "deepseek", "cpu_rms_norm_strided_input": "qwen3"}
# Adapters that matter only under Model Runner V2: their negative runs force it (where vLLM's CPU
# backend has a V2 runner).
RUNNER_V2 = {"VLLM_USE_V2_MODEL_RUNNER": "1"}
ENV_FOR = {"v2_batch_order": RUNNER_V2, "input_batch_view": RUNNER_V2}
# Adapters whose failure a CPU run cannot show, and why (each is proved elsewhere).
NOT_OBSERVABLE_ON_CPU = {
    "worker_spawn": "vLLM's CPU platform always spawns workers; the GPU run is its test",
    "llama_4_scaling_arg": "needs a DeepseekV2 checkpoint with llama_4_scaling; contract test covers the call",
    "warm_up_after_init": "skipping warm-up is not fatal in eager mode (DRIFT.md); the contract test covers the call",
    "capture_transport": "a transport, not a fix: without it the same states arrive, slower (bench/)",
    "finished_ids_delivery": "only Model Runner V2 runs out of slots (GPU); V1 grows a dict. Contract test",
    "native_connector_host_memory": "vLLM's native path, not the generator: tests/e2e/test_backends.py",
}
# Global adapters serve any caller; these consumers never make the call they bridge:
NOT_CALLED_BY = {("0.4.0", "kv_cache_specs_kwarg")}  # 0.4 never passes kv_cache_specs
# speculators 0.4 passes block_size=16, which equals the config's block size on CPU.
SAME_VALUE_ON_CPU = {("0.4.0", "scheduler_block_size")}


def observable(adapter_id: str) -> bool:
    """Host-dependent adapters count only where this host needs them; V2-only ones only where
    vLLM's CPU backend has a V2 runner to force; family-specific ones where that family runs."""
    from vllm_compat.registry import get

    adapter = get(adapter_id)
    if adapter.host_probe is not None and not adapter.host_probe()[0]:
        return False
    if adapter_id in FAMILY_FOR and not harness.family_runs_here(FAMILY_FOR[adapter_id]):
        return False
    return adapter_id not in ENV_FOR or harness.runner_v2_available()


def active_adapters(speculators: str) -> list[str]:
    result = audit(consumer=f"speculators=={speculators}")
    return [f.id for f in result.findings if f.kind == "adapter" and f.verdict == "adapted"
            and f.id not in NOT_OBSERVABLE_ON_CPU and (speculators, f.id) not in SAME_VALUE_ON_CPU | NOT_CALLED_BY
            and observable(f.id)]


def expect_broken(verdict: str, expected: str) -> None:
    if expected == "wrong":
        assert verdict != "ok", "disabling the adapter changed nothing"
    elif expected == "error":
        assert verdict.startswith("error"), verdict
    else:
        assert verdict.startswith("error") and expected in verdict, verdict


@pytest.fixture(scope="module")
def model():
    return harness.tiny_model("llama")


@pytest.fixture(scope="module")
def refs(model):
    return harness.reference(model, CALLS)


CASES = [(spec, adapter) for spec in ("0.3.0", "0.4.0") for adapter in active_adapters(spec)]


@pytest.mark.parametrize("speculators", ["0.3.0", "0.4.0"])
def test_with_every_adapter_it_is_right(model, refs, speculators):
    run = harness.run_generator(model, speculators, CALLS)
    assert harness.judge(run, CALLS, refs) == "ok"


def test_without_apply_the_03_generator_fails(model, refs):
    run = harness.run_generator(model, "0.3.0", CALLS, apply=False)
    assert harness.judge(run, CALLS, refs) != "ok"


@pytest.mark.parametrize("speculators, adapter", CASES, ids=[f"{s}-{a}" for s, a in CASES])
def test_disabling_one_adapter_brings_its_failure_back(model, refs, speculators, adapter):
    routed = frozenset()
    if adapter in FAMILY_FOR:
        model = harness.tiny_model(FAMILY_FOR[adapter])
        refs = harness.reference(model, CALLS)
        routed = harness.ROUTED_LAYERS.get(FAMILY_FOR[adapter], frozenset())
        # the same judge passes this family with every adapter on (test_generator's MLA case)
    run = harness.run_generator(model, speculators, CALLS, disable=adapter, extra_env=ENV_FOR.get(adapter))
    expect_broken(harness.judge(run, CALLS, refs, routed), EXPECTED[adapter])


def test_every_adapter_is_covered():
    from vllm_compat.registry import adapters

    assert {a.id for a in adapters()} == set(EXPECTED) | set(NOT_OBSERVABLE_ON_CPU)
