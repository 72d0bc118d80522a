"""``DeepseekV2DecoderLayer.forward`` takes ``llama_4_scaling`` (vLLM 0.12.0).

Drift: the layer's forward grew ``llama_4_scaling=None`` in 0.12.0
(``vllm/model_executor/models/deepseek_v2.py:1188-1194``); vLLM's base forward computes it from
``config.llama_4_scaling`` once per forward and passes it to every layer (``:1310-1323``). The
speculators generators replace that base forward and call layers without it: for checkpoints whose
config has ``llama_4_scaling`` (Mistral-Large-3 style) the attention queries go unscaled and every
captured state is wrong, silently. DeepSeek-V3 / Kimi-K2 configs have none: nothing changes there.

What it does: each DeepseekV2 decoder layer remembers its config's ``llama_4_scaling`` when it is
built; a call that omits the argument gets the value vLLM's own base forward would pass (through
vLLM's ``_get_llama_4_scaling``). Calls that pass it, and configs without it, are untouched.

Scope: worker (model code runs in vLLM's workers). Disable:
``VLLM_COMPAT_DISABLE=llama_4_scaling_arg``.
"""
from packaging.specifiers import SpecifierSet

from ..adapter import Adapter, Expect, Patch, Scope
from ..probes.shapes import ABSENT, OPTIONAL, Param
from ..wrapping import function_wrapper

LAYER = "vllm.model_executor.models.deepseek_v2:DeepseekV2DecoderLayer"
CONFIG = "_vllm_compat_llama_4_scaling"  # on each layer object: the config's llama_4_scaling dict
ARGUMENT_POSITION = 3  # forward(positions, hidden_states, residual, llama_4_scaling)


def remember_config(wrapped, layer, args, kwargs):
    result = wrapped(*args, **kwargs)
    config = kwargs.get("config")
    if config is None:
        vllm_config = kwargs["vllm_config"] if "vllm_config" in kwargs else args[0]
        config = vllm_config.model_config.hf_config
    layer.__dict__[CONFIG] = getattr(config, "llama_4_scaling", None)
    return result


def fill_llama_4_scaling(wrapped, layer, args, kwargs):
    scaling = layer.__dict__.get(CONFIG)
    if scaling is None or len(args) > ARGUMENT_POSITION or kwargs.get("llama_4_scaling") is not None:
        return wrapped(*args, **kwargs)
    from vllm.model_executor.models import deepseek_v2

    positions = kwargs["positions"] if "positions" in kwargs else args[0]
    kwargs["llama_4_scaling"] = deepseek_v2._get_llama_4_scaling(
        original_max_position_embeddings=scaling["original_max_position_embeddings"],
        scaling_beta=scaling["beta"],
        positions=positions,
    )
    return wrapped(*args, **kwargs)


ADAPTER = Adapter(
    id="llama_4_scaling_arg",
    summary="pass DeepseekV2 layers the llama_4_scaling a replaced base forward leaves out",
    drift="DeepseekV2DecoderLayer.forward gained llama_4_scaling in 0.12.0",
    scope=Scope.WORKER,
    vllm=SpecifierSet(">=0.12.0"),
    expect=Expect(Param(f"{LAYER}.forward", "llama_4_scaling"), old={ABSENT}, new={OPTIONAL}),
    deferred=True,
    patches=(
        Patch(f"{LAYER}.__init__", function_wrapper(remember_config)),
        Patch(f"{LAYER}.forward", function_wrapper(fill_llama_4_scaling)),
    ),
    verified_through="0.32.0",
    evidence="docs/drift-atlas.md, \"`llama_4_scaling` for DeepseekV2 layers (0.12.0)\": "
             "vllm/model_executor/models/deepseek_v2.py:1188-1194,1310-1323 (0.12.0)",
)
