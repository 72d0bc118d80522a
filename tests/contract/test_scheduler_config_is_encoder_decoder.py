import pytest

from tests.contract.base import AdapterContract

import vllm_compat


class TestSchedulerConfigIsEncoderDecoder(AdapterContract):
    adapter_id = "scheduler_config_is_encoder_decoder"
    first_new = "0.12.0"
    negative = 'is_encoder_decoder'

    def test_patched_call(self, generator_module):
        if vllm_compat.apply()[self.adapter_id].status != "applied":
            pytest.skip("not applied for this vLLM / speculators pair")
        config = generator_module.SchedulerConfig(max_num_seqs=4, max_model_len=64, max_num_batched_tokens=64)
        assert config.max_num_seqs == 4
        from vllm.config import SchedulerConfig

        with pytest.raises(Exception, match="is_encoder_decoder"):  # vLLM's own name is untouched (TypeError or pydantic's ValidationError)
            SchedulerConfig(max_num_seqs=4, max_model_len=64, max_num_batched_tokens=64)
