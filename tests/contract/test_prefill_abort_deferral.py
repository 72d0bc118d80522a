from types import SimpleNamespace

from tests.contract.base import AdapterContract

from vllm_compat.adapters.prefill_abort_deferral import ADAPTER


class FakeScheduler:
    def __init__(self):
        self.requests = {
            "req_0_0": SimpleNamespace(num_computed_tokens=8192, num_prompt_tokens=9000),  # mid-prefill
            "req_0_1": SimpleNamespace(num_computed_tokens=40, num_prompt_tokens=40),
        }
        self.finished = []

    def finish_requests(self, request_ids, finished_status):
        self.finished.append((list(request_ids), finished_status))


class TestPrefillAbortDeferral(AdapterContract):
    adapter_id = "prefill_abort_deferral"
    negative = 'wrong'

    def test_patched_call(self):
        from vllm.v1.request import RequestStatus

        scheduler = ADAPTER.patches[0].factory(FakeScheduler)()
        scheduler.finish_requests(["req_0_0"], RequestStatus.FINISHED_ABORTED)
        scheduler.finish_requests(["req_0_1"], RequestStatus.FINISHED_ABORTED)
        assert scheduler.finished == [([], RequestStatus.FINISHED_ABORTED), (["req_0_1"], RequestStatus.FINISHED_ABORTED)]
