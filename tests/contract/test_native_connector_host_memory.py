import importlib

import pytest

import vllm_compat
from tests.contract.base import AdapterContract
from vllm_compat.adapters.native_connector_host_memory import MODULE
from vllm_compat.probes.verdicts import ADAPTED


class TestNativeConnectorHostMemory(AdapterContract):
    adapter_id = "native_connector_host_memory"
    first_new = "0.17.0"
    not_observable_on_cpu = "vLLM's native path, not the generator: tests/e2e/test_backends.py"

    def test_patched_call(self):
        """Inside the connector module, pinned allocations become plain ones and copy events are
        done at once; the real torch is untouched."""
        if self.expected_verdict() != ADAPTED:
            pytest.skip("no hidden-states connector before 0.17.0")
        if vllm_compat.apply()[self.adapter_id].status not in ("applied", "armed"):
            pytest.skip("the host probe found an accelerator, or no vLLM platform (a CUDA wheel without a GPU)")
        connector = importlib.import_module(MODULE)
        import torch

        staged = connector.torch.empty_like(torch.ones(3), pin_memory=True)
        assert staged.shape == (3,) and not staged.is_pinned()
        event = connector.torch.cuda.Event()
        event.record()
        assert event.query() and connector.torch.cuda.Event is not torch.cuda.Event
