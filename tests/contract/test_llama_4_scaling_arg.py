import torch

from tests.contract.base import AdapterContract

from vllm_compat.adapters.llama_4_scaling_arg import CONFIG, fill_llama_4_scaling


class Layer:
    pass


class TestLlama4ScalingArg(AdapterContract):
    adapter_id = "llama_4_scaling_arg"
    first_new = "0.12.0"
    not_observable_on_cpu = 'needs a DeepseekV2 checkpoint with llama_4_scaling; contract test covers the call'

    def test_patched_call(self):
        from vllm.model_executor.models.deepseek_v2 import _get_llama_4_scaling

        layer = Layer()
        layer.__dict__[CONFIG] = {"original_max_position_embeddings": 8, "beta": 0.5}
        positions = torch.arange(20)
        seen = fill_llama_4_scaling(lambda **kw: kw["llama_4_scaling"], layer, (),
                                    {"positions": positions, "hidden_states": None, "residual": None})
        expected = _get_llama_4_scaling(original_max_position_embeddings=8, scaling_beta=0.5, positions=positions)
        assert torch.equal(seen, expected) and seen.flatten()[16].item() > 1
        plain = Layer()
        plain.__dict__[CONFIG] = None  # configs without llama_4_scaling pass nothing
        assert fill_llama_4_scaling(lambda **kw: "llama_4_scaling" in kw, plain, (), {"positions": positions}) is False
