"""``--pp-size N --ray-address ADDR``: one engine in this process on vLLM's Ray executor, not the
replicas; refused before the load where vLLM's Ray executor cannot run (the CPU platform) or where
the cluster has too few GPUs."""
from types import SimpleNamespace

import pytest

from hidden_states.backends import BackendSettings
from hidden_states.backends.stage_layers import executor_keywords, ray_stages
from hidden_states.errors import UsageError
from hidden_states.plan.ray_stages import RAY_ON_CPU, check_ray_gpus, refuse_ray_stages
from hidden_states.replicas.driver import on_ray


class FakeRay:
    def __init__(self, initialized=False):
        self.initialized, self.joined = initialized, []

    def is_initialized(self):
        return self.initialized

    def init(self, address, runtime_env=None, **_):
        self.joined.append(address)
        self.env = runtime_env["env_vars"]
        self.initialized = True


def test_stages_on_ray_are_one_engine_on_vllms_ray_executor_not_replicas():
    settings = BackendSettings("m", [0], 16, 1, 0.5, pp_size=2, ray_address="head:6379")
    ray = FakeRay()
    assert ray_stages(settings)
    assert executor_keywords(settings, ray) == {"distributed_executor_backend": "ray"}
    assert ray.joined == ["head:6379"]  # joined before vLLM's executor looks for an initialized Ray
    assert all(name.startswith(("VLLM_", "HF_", "TRANSFORMERS_", "OMP_NUM_THREADS")) for name in ray.env)
    joined = FakeRay(initialized=True)
    assert executor_keywords(settings, joined) == {"distributed_executor_backend": "ray"} and joined.joined == []
    run = SimpleNamespace(data_parallel_size=1, ray_address="head:6379", pp_size=2)
    assert not on_ray(run)
    assert on_ray(SimpleNamespace(data_parallel_size=1, ray_address="head:6379", pp_size=1))  # replicas, as before


def test_stages_on_one_host_keep_vllms_multiprocessing_executor():
    settings = BackendSettings("m", [0], 16, 1, 0.5, pp_size=2)
    assert not ray_stages(settings) and executor_keywords(settings, FakeRay()) == {}
    assert executor_keywords(BackendSettings("m", [0], 16, 1, 0.5, ray_address="auto"), FakeRay()) == {}


def test_ray_stages_are_refused_on_a_cpu_host_in_vllms_words():
    with pytest.raises(UsageError) as raised:
        refuse_ray_stages(2, 1, "cpu")
    assert str(raised.value).startswith("--ray-address: not with --pp-size 2 on vLLM's CPU backend")
    assert RAY_ON_CPU in str(raised.value)
    with pytest.raises(UsageError, match=r"^--data-parallel-size 2: not with --pp-size 2 and --ray-address"):
        refuse_ray_stages(2, 2, "cuda")
    refuse_ray_stages(2, 1, "cuda")
    refuse_ray_stages(1, 1, "cpu")  # replicas: not this path


def test_the_gpus_are_counted_over_the_ray_cluster():
    assert check_ray_gpus(8, 2, 16.0) == "GPUs: 16 of the Ray cluster's 16 (--tp-size 8 x --pp-size 2)"
    with pytest.raises(UsageError, match=r"needs 16 GPUs, the Ray cluster has 8$"):
        check_ray_gpus(8, 2, 8.0)
    assert check_ray_gpus(8, 2, None).endswith("not checked (the cluster could not be asked)")
