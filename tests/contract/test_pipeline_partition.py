"""``plan/pipeline.py`` against the installed vLLM: the stages' layers the plan foresees are those
vLLM's ``get_pp_indices`` gives each pipeline rank, with and without ``VLLM_PP_LAYER_PARTITION`` (a
value vLLM refuses, refused by both); and, on vLLM's CPU backend, the verdict the plan gives
``--backend vllm-native --pp-size 2`` for the tiny families."""
import json

import pytest

from hidden_states.errors import UsageError
from hidden_states.plan.pipeline import PARTITION_ENV, pp_partition

pytestmark = [pytest.mark.vllm, pytest.mark.per_vllm]

LAYERS = (6, 61, 62, 94)
STAGES = (1, 2, 3, 4)


def vllm_stages(num_layers: int, pp_size: int) -> list[tuple[int, int]]:
    from vllm.distributed.utils import get_pp_indices

    return [tuple(get_pp_indices(num_layers, rank, pp_size)) for rank in range(pp_size)]


def chosen(num_layers: int, pp_size: int) -> str:
    """A partition unlike the default: one layer on every stage but the first."""
    return ",".join(str(n) for n in [num_layers - (pp_size - 1)] + [1] * (pp_size - 1))


@pytest.mark.parametrize("num_layers", LAYERS)
@pytest.mark.parametrize("pp_size", STAGES)
def test_the_plans_stages_are_vllms(num_layers, pp_size, monkeypatch):
    monkeypatch.delenv(PARTITION_ENV, raising=False)
    assert pp_partition(num_layers, pp_size, {}) == vllm_stages(num_layers, pp_size)
    monkeypatch.setenv(PARTITION_ENV, chosen(num_layers, pp_size))
    assert pp_partition(num_layers, pp_size, {PARTITION_ENV: chosen(num_layers, pp_size)}) == vllm_stages(
        num_layers, pp_size)


@pytest.mark.parametrize("value", ["3,x", "2,2,2", "4,4", ""])
def test_a_partition_vllm_refuses_is_refused_by_the_plan(value, monkeypatch):
    monkeypatch.setenv(PARTITION_ENV, value)
    with pytest.raises(ValueError):
        vllm_stages(6, 2)
    with pytest.raises(UsageError, match=PARTITION_ENV):
        pp_partition(6, 2, {PARTITION_ENV: value})


@pytest.mark.parametrize("family, architecture, declared", [("llama", "LlamaForCausalLM", True),
                                                             ("qwen3", "Qwen3ForCausalLM", True),
                                                             ("deepseek", "DeepseekV3ForCausalLM", False)])
def test_vllm_native_with_stages_is_judged_without_loading_the_model(family, architecture, declared, tmp_path):
    from packaging.version import Version

    from vllm_compat.extractor_api import base, vllm_device_type, vllm_version

    from hidden_states.backends import vllm_native

    if base(vllm_version()) < Version("0.32.0"):
        pytest.skip("vLLM's aux_hidden_states_over_pp declaration is 0.32's and later's")
    assert vllm_native.decoder_supports_aux_over_pp(architecture) is declared
    model = tmp_path / family
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": [architecture]}))
    device = vllm_device_type()
    if device != "cpu" and declared:
        vllm_native.refuse_pipeline(str(model), 2, vllm_version(), device)
        return
    with pytest.raises(UsageError) as raised:
        vllm_native.refuse_pipeline(str(model), 2, vllm_version(), device)
    assert ("V1 model runner (its CPU backend)" if device == "cpu" else "does not support") in str(raised.value)
