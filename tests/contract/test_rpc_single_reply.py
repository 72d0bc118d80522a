from tests.contract.base import AdapterContract

from vllm_compat.adapters.rpc_single_reply import ADAPTER
from vllm_compat.consumer import GENERATOR


class FakeExecutor:
    def collective_rpc(self, method, unique_reply_rank=None):
        return f"reply:{method}"

    def execute_model(self, scheduler_output):  # vLLM's own method, calling through the same object
        return self.collective_rpc("execute_model", unique_reply_rank=0)


class TestRpcSingleReply(AdapterContract):
    adapter_id = "rpc_single_reply"
    first_new = "0.11.1"
    negative = 'wrong'

    def test_patched_call(self):
        executor = ADAPTER.patches[0].factory(FakeExecutor)()
        as_generator = {"__name__": GENERATOR, "executor": executor}
        assert eval("executor.collective_rpc('_get_captured_states', unique_reply_rank=0)", as_generator) == [
            "reply:_get_captured_states"]
        assert eval("executor.collective_rpc('get_kv_cache_spec')", as_generator) == "reply:get_kv_cache_spec"
        assert executor.execute_model(None) == "reply:execute_model"  # vLLM's call keeps the new shape
