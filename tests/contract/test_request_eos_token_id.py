from tests.contract.base import AdapterContract

import vllm_compat


class TestRequestEosTokenId(AdapterContract):
    adapter_id = "request_eos_token_id"
    first_new = "0.17.0"
    negative = 'eos_token_id'

    def test_patched_call(self):
        vllm_compat.apply()
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        request = Request(request_id="r0", prompt_token_ids=[5, 6, 7], sampling_params=SamplingParams(max_tokens=1),
                          pooling_params=None, eos_token_id=2)
        assert request.num_prompt_tokens == 3
