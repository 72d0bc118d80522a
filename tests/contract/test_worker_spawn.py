import os

from tests.contract.base import AdapterContract

from vllm_compat.adapters.worker_spawn import METHOD, spawn_workers


class TestWorkerSpawn(AdapterContract):
    adapter_id = "worker_spawn"
    not_observable_on_cpu = "vLLM's CPU platform always spawns workers; the GPU run is its test"

    def test_patched_call(self, monkeypatch):
        monkeypatch.delenv(METHOD, raising=False)
        seen = spawn_workers(lambda: os.environ.get(METHOD), None, (), {})
        assert seen == "spawn" and METHOD not in os.environ
        monkeypatch.setenv(METHOD, "fork")  # the user's explicit choice is kept
        assert spawn_workers(lambda: os.environ.get(METHOD), None, (), {}) == "fork"
