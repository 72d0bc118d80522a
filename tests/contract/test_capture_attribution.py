from types import SimpleNamespace

import torch

from tests.contract.base import AdapterContract

from vllm_compat.adapters import capture_attribution as ca


class FakeWorker:
    def __init__(self):
        self.model_runner = SimpleNamespace(input_batch=SimpleNamespace(req_ids=[]))
        self.stored = []

    def store(self, aux):
        self.stored.append(aux)

    def get(self):
        return [torch.cat([a[j] for a in self.stored]) for j in range(len(self.stored[0]))]


def forward(worker, req_ids, tokens, rows_by_request):
    worker.model_runner.input_batch.req_ids = req_ids
    ca._step["tokens"] = tokens
    rows = torch.cat([rows_by_request[r] for r in req_ids if r in tokens] +
                     [torch.full((sum(1 for _ in range(0)), 1), -1.0)])
    padding = torch.full((2, 1), -1.0)  # padding rows the worker captured too
    ca.record_rows(lambda aux: worker.store(aux), worker, ([torch.cat([rows, padding])],), {})
    ca._step["tokens"] = None


class TestCaptureAttribution(AdapterContract):
    adapter_id = "capture_attribution"
    negative = 'wrong'

    def test_patched_call(self):
        worker = FakeWorker()
        # a warm-up forward no request owns
        ca.record_rows(lambda aux: worker.store(aux), worker, ([torch.full((3, 1), -9.0)],), {})
        # step 1: batch order req_0_1, req_0_0 (first chunk of req_0_0), step 2: rest of req_0_0
        forward(worker, ["req_0_1", "req_0_0"], {"req_0_1": 2, "req_0_0": 3},
                {"req_0_1": torch.tensor([[10.0], [11.0]]), "req_0_0": torch.tensor([[0.0], [1.0], [2.0]])})
        forward(worker, ["req_0_0"], {"req_0_0": 2}, {"req_0_0": torch.tensor([[3.0], [4.0]])})
        (layer,) = ca.regroup_rows(lambda: worker.get(), worker, (), {})
        assert layer.flatten().tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 10.0, 11.0]
