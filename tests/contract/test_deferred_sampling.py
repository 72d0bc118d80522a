from tests.contract.base import AdapterContract

from vllm_compat.adapters.deferred_sampling import flush_pending_samples


class FakeExecutor:
    def __init__(self):
        self.calls = []

    def execute_model(self, scheduler_output):
        self.calls.append(("execute", scheduler_output))
        return None

    def sample_tokens(self, grammar_output):
        self.calls.append(("sample", grammar_output))
        return "sampled"


class TestDeferredSampling(AdapterContract):
    adapter_id = "deferred_sampling"
    first_new = "0.11.1"
    negative = 'sample_tokens() must be called'

    def test_patched_call(self):
        legacy = flush_pending_samples(FakeExecutor, None, (), {})
        legacy.execute_model("s1")
        legacy.execute_model("s2")  # a 0.3-style loop: the pending sample is flushed first
        assert legacy.calls == [("execute", "s1"), ("sample", None), ("execute", "s2")]
        modern = flush_pending_samples(FakeExecutor, None, (), {})
        modern.execute_model("s1")
        modern.sample_tokens("g")  # a 0.4-style loop samples itself: nothing extra
        modern.execute_model("s2")
        assert modern.calls == [("execute", "s1"), ("sample", "g"), ("execute", "s2")]
