from types import SimpleNamespace

from tests.contract.base import AdapterContract

from vllm_compat.adapters.prefill_slot_release import ADAPTER


def request(computed, prompt):
    return SimpleNamespace(num_computed_tokens=computed, num_prompt_tokens=prompt, is_finished=lambda: False)


class FakeScheduler:
    def __init__(self, waiting):
        self.waiting = waiting
        self.requests = {"done": request(50, 50), "busy": request(10, 50)}
        self.finished = []

    def finish_requests(self, request_ids, finished_status):
        self.finished.extend(request_ids)

    def schedule(self):
        return "output"


class TestPrefillSlotRelease(AdapterContract):
    adapter_id = "prefill_slot_release"
    negative = 'not found in captured states'

    def test_patched_call(self):
        waiting = ADAPTER.patches[0].factory(FakeScheduler)(["queued"])
        assert waiting.schedule() == "output" and waiting.finished == ["done"]
        idle = ADAPTER.patches[0].factory(FakeScheduler)([])
        assert idle.schedule() == "output" and idle.finished == []  # nothing waits: nothing aborted
