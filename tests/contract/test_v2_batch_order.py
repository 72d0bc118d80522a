from types import SimpleNamespace

import pytest

from tests.contract.base import AdapterContract
from tests.contract.negative_proofs import RUNNER_V2

from vllm_compat import batch_order


class TestV2BatchOrder(AdapterContract):
    adapter_id = "v2_batch_order"
    first_new = "0.12.0"
    negative = 'wrong'  # its dependents (capture_attribution, input_batch_view) are disabled with it
    negative_env = RUNNER_V2  # matters only under Model Runner V2

    def test_patched_call(self, monkeypatch):
        monkeypatch.setitem(batch_order._v2, "req_ids", None)
        batch = SimpleNamespace(req_ids=["req_0_3", "req_0_1"])  # V2 sorts: not submission order
        assert batch_order.remember_v2_batch(lambda: batch, None, (), {}) is batch
        v2_runner = SimpleNamespace()  # no input_batch attribute
        assert batch_order.batch_order(v2_runner) == ["req_0_3", "req_0_1"]
        v1_runner = SimpleNamespace(input_batch=SimpleNamespace(req_ids=["a", "b"]))
        assert batch_order.batch_order(v1_runner) == ["a", "b"]  # V1's persistent batch wins

    def test_no_order_raises(self, monkeypatch):
        monkeypatch.setitem(batch_order._v2, "req_ids", None)
        with pytest.raises(RuntimeError, match="cannot read the batch order"):
            batch_order.batch_order(SimpleNamespace())
