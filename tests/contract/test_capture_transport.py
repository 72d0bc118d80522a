import pickle

import torch

from tests.contract.base import AdapterContract

from vllm_compat.adapters.capture_transport import states_to_host


def through_vllm_pickling(obj):
    """What vLLM's MessageQueue does with a reply: protocol 5, buffers of 1 MiB+ out of band."""
    frames = []
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL,
                        buffer_callback=lambda b: len(b.raw()) < 1024 * 1024 or frames.append(b.raw()))
    return pickle.loads(data, buffers=frames), len(data), len(frames)


class TestCaptureTransport(AdapterContract):
    adapter_id = "capture_transport"

    def test_patched_call(self):
        layers = [torch.randn(2048, 1024).to(torch.bfloat16) for _ in range(4)]
        by_request = {"req_0_0": [layers[0][:5]], "req_0_1": [layers[1][5:9]]}
        for reply in (layers, by_request):  # the 0.3 and the 0.4 reply shapes
            back, inline, frames = through_vllm_pickling(states_to_host(lambda: reply, None, (), {}))
            flat = back if isinstance(back, list) else [t for v in back.values() for t in v]
            want = reply if isinstance(reply, list) else [t for v in reply.values() for t in v]
            assert all(type(t) is torch.Tensor and t.dtype == torch.bfloat16 and torch.equal(t, w)
                       for t, w in zip(flat, want))
        _, inline, frames = through_vllm_pickling(states_to_host(lambda: layers, None, (), {}))
        assert frames == 4 and inline < 4096  # 16 MiB of states, none of it in the pickle stream
