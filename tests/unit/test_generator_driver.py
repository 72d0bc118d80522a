"""The e2e generator driver's own logic (tests/e2e/generator_driver.py), without vLLM."""
import pytest

import vllm_compat.host as host
from tests.e2e import generator_driver, harness

FRACTION = 0.2  # speculators 0.3/0.4's CACHE_MEMORY_FRACTION


def test_the_generators_kv_cache_is_the_same_size_whatever_the_host_has_free(monkeypatch):
    """On a host without CUDA the generator sizes its KV cache from the host's free memory: under about
    3.2 GB free its share was under one step's token budget, and two negative proofs came out right."""
    monkeypatch.setattr(host, "vllm_device_type", lambda: "cpu")
    given = {"max_model_len": 1024, "gpu_memory_utilization": 0.02}
    for free in (2 * 2**30, 3 * 2**30, 64 * 2**30):
        monkeypatch.setattr(host, "host_memory", lambda: (free, 128 * 2**30))
        kwargs = generator_driver.sized_kv_cache(given, harness.KV_CACHE_BYTES, FRACTION)
        # the generator's own arithmetic (vllm_hidden_states_generator.py: free x utilization x fraction)
        assert int(free * kwargs["gpu_memory_utilization"] * FRACTION) == pytest.approx(harness.KV_CACHE_BYTES, abs=1)
        assert kwargs["max_model_len"] == 1024 and given["gpu_memory_utilization"] == 0.02
    # above one step's token budget of the tiny Llama (8192 tokens at 1.5 KiB, a block per prompt)
    assert harness.KV_CACHE_BYTES // (16 * 1536) > 8192 // 16 + 32


def test_on_a_cuda_device_or_unasked_the_generators_kwargs_stay(monkeypatch):
    monkeypatch.setattr(host, "host_memory", lambda: pytest.fail("host memory asked"))
    monkeypatch.setattr(host, "vllm_device_type", lambda: "cuda")
    assert generator_driver.sized_kv_cache({"gpu_memory_utilization": 0.02}, harness.KV_CACHE_BYTES, FRACTION) \
        == {"gpu_memory_utilization": 0.02}
    monkeypatch.setattr(host, "vllm_device_type", lambda: pytest.fail("device asked"))
    assert generator_driver.sized_kv_cache({"gpu_memory_utilization": 0.02}, None, FRACTION) \
        == {"gpu_memory_utilization": 0.02}
