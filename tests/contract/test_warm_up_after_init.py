from tests.contract.base import AdapterContract

from vllm_compat.adapters.warm_up_after_init import ADAPTER


class FakeExecutor:
    def __init__(self):
        self.calls = []

    def initialize_from_config(self, configs):
        self.calls.append("initialize")

    def compile_or_warm_up_model(self):
        self.calls.append("warm up")


class TestWarmUpAfterInit(AdapterContract):
    adapter_id = "warm_up_after_init"
    first_new = "0.27.0"
    not_observable_on_cpu = ('skipping warm-up is not fatal in eager mode; the contract test covers the call '
                             '(docs/drift-atlas.md, "Warm-up leaves `initialize_from_config` (0.27.0)")')

    def test_patched_call(self):
        executor = ADAPTER.patches[0].factory(FakeExecutor)()
        executor.initialize_from_config([])
        assert executor.calls == ["initialize", "warm up"]
