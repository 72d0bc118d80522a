from types import SimpleNamespace

from tests.contract.base import AdapterContract
from tests.contract.negative_proofs import RUNNER_V2

from vllm_compat import batch_order
from vllm_compat.adapters.input_batch_view import with_input_batch_view


class TestInputBatchView(AdapterContract):
    adapter_id = "input_batch_view"
    first_new = "0.12.0"
    negative = 'input_batch'
    negative_env = RUNNER_V2  # matters only under Model Runner V2

    def test_patched_call(self, monkeypatch):
        monkeypatch.setitem(batch_order._v2, "req_ids", ["req_0_2", "req_0_0"])
        worker = SimpleNamespace(model_runner=SimpleNamespace(), _current_request_metadata={"req_0_0": 3})

        def store(aux):  # what speculators 0.4's _store_captured_states reads
            return dict(worker.model_runner.input_batch.req_id_to_index)

        assert with_input_batch_view(store, worker, ([],), {}) == {"req_0_2": 0, "req_0_0": 1}
        assert not hasattr(worker.model_runner, "input_batch")  # the view is gone afterwards
