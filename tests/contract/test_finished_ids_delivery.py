from types import SimpleNamespace

from tests.contract.base import AdapterContract

from vllm_compat.adapters.finished_ids_delivery import ADAPTER


class FakeScheduler:
    """Builds outputs as vLLM's scheduler does: finished ids move into the output, then reset."""

    def __init__(self):
        self.finished_req_ids = set()
        self.tokens = []

    def schedule(self):
        output = SimpleNamespace(total_num_scheduled_tokens=self.tokens.pop(0) if self.tokens else 0,
                                 finished_req_ids=self.finished_req_ids)
        self.finished_req_ids = set()
        return output


class TestFinishedIdsDelivery(AdapterContract):
    adapter_id = "finished_ids_delivery"
    not_observable_on_cpu = 'only Model Runner V2 runs out of slots (GPU); V1 grows a dict. Contract test'

    def test_patched_call(self):
        scheduler = ADAPTER.patches[0].factory(FakeScheduler)()
        scheduler.finished_req_ids.add("req_0_0")  # aborted after the call's last step
        assert scheduler.schedule().total_num_scheduled_tokens == 0  # the output the generator drops
        scheduler.tokens = [12]  # the next call
        output = scheduler.schedule()
        assert output.total_num_scheduled_tokens == 12 and output.finished_req_ids == {"req_0_0"}
        assert scheduler.schedule().finished_req_ids == set()  # delivered once
