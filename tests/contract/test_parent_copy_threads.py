import ast
import inspect
import os
import textwrap

import pytest
import torch
from tests.contract.base import AdapterContract

from vllm_compat.adapters.parent_copy_threads import (ENV_THREADS, OMP, PARENT_COPY_THREADS, give_threads_back,
                                                      thread_cap)

# what vLLM's _init_executor and the functions it calls read or write in this process's environment
VLLM_ENV = (OMP, "VLLM_OMP_NUM_THREADS_SET_BY_VLLM", "VLLM_WORKER_MULTIPROC_METHOD", ENV_THREADS)
START_THREADS = 4  # torch's count before the executor is built (more than 1, whatever the host has)


def _executor_module():
    from vllm.v1.executor import multiproc_executor

    return multiproc_executor


def _names_called(function) -> set[str]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    return {node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
            for node in ast.walk(tree) if isinstance(node, ast.Call)}


def init_executor_threads_only():
    """What the real ``MultiprocExecutor._init_executor`` does to this process's threads, done by
    vLLM's own functions, in its order: size the workers' pools before they start, and from 0.32.0
    put this process on one thread once they are ready (the workers themselves need a device)."""
    module = _executor_module()
    module.set_multiprocessing_worker_envs()
    if hasattr(module, "set_torch_threads_for_runtime"):
        module.set_torch_threads_for_runtime()
    return "executor"


@pytest.fixture
def clean_threads(monkeypatch):
    """No OMP_NUM_THREADS from outside, torch on START_THREADS, and vLLM's platform answering as a
    GPU host's does (from 0.26.0 set_multiprocessing_worker_envs lowers the threads only where the
    platform is not the CPU, and this host's is); all restored afterwards."""
    for name in VLLM_ENV:  # set then delete: monkeypatch restores each to absent
        monkeypatch.setenv(name, "0")
        monkeypatch.delenv(name)
    platform = getattr(_executor_module(), "current_platform", None)
    if platform is not None:
        monkeypatch.setattr(type(platform), "is_cpu", lambda self: False)
    threads = torch.get_num_threads()
    torch.set_num_threads(START_THREADS)
    yield monkeypatch
    torch.set_num_threads(threads)


class TestParentCopyThreads(AdapterContract):
    adapter_id = "parent_copy_threads"
    not_observable_on_cpu = ("a speed, not a result: the states are the same on one thread, and on vLLM's CPU "
                             "backend the adapter is not needed (the workers use the cores); measured on the "
                             "H200 by bench/device/stages.sh parent-copy-threads")

    def test_init_executor_calls_what_lowers_the_threads(self):
        """The drift bridged, read from the real release: _init_executor calls the function that
        lowers this process's torch threads (and from 0.32.0 the one that puts it on one)."""
        module = _executor_module()
        called = _names_called(module.MultiprocExecutor._init_executor)
        assert "set_multiprocessing_worker_envs" in called
        assert "set_num_threads" in _names_called(module.set_multiprocessing_worker_envs)
        if hasattr(module, "set_torch_threads_for_runtime"):
            assert {"wait_for_ready", "set_torch_threads_for_runtime"} <= called
            assert "set_num_threads" in _names_called(module.set_torch_threads_for_runtime)

    def test_without_the_adapter_vllm_leaves_one_thread(self, clean_threads):
        """The negative proof at the mechanism: vLLM's own calls leave this process on one thread."""
        init_executor_threads_only()
        assert torch.get_num_threads() == 1

    def test_patched_call(self, clean_threads):
        init_executor_threads_only()
        environment_by_vllm = {name: os.environ.get(name) for name in VLLM_ENV}
        for name in environment_by_vllm:
            clean_threads.delenv(name, raising=False)
        torch.set_num_threads(START_THREADS)
        assert give_threads_back(init_executor_threads_only, None, (), {}) == "executor"
        assert torch.get_num_threads() == min(START_THREADS, PARENT_COPY_THREADS)
        assert {name: os.environ.get(name) for name in VLLM_ENV} == environment_by_vllm  # only torch's count

    def test_cap_and_switch(self, clean_threads):
        clean_threads.setenv(ENV_THREADS, "2")
        give_threads_back(init_executor_threads_only, None, (), {})
        assert torch.get_num_threads() == 2
        for name in VLLM_ENV:  # as before vLLM's first call
            clean_threads.delenv(name, raising=False)
        clean_threads.setenv(ENV_THREADS, "0")  # off: vLLM's count stays
        torch.set_num_threads(START_THREADS)
        give_threads_back(init_executor_threads_only, None, (), {})
        assert torch.get_num_threads() == 1

    def test_users_omp_num_threads_is_kept(self, clean_threads):
        clean_threads.setenv(OMP, "1")

        def lowers():  # whatever the executor does, a count the user chose is theirs
            torch.set_num_threads(1)

        give_threads_back(lowers, None, (), {})
        assert torch.get_num_threads() == 1

    def test_bad_switch_fails_before_the_executor_is_built(self, clean_threads):
        clean_threads.setenv(ENV_THREADS, "eight")
        built = []
        with pytest.raises(ValueError, match=ENV_THREADS):
            give_threads_back(lambda: built.append(1), None, (), {})
        assert not built
        clean_threads.setenv(ENV_THREADS, "")
        assert thread_cap() == PARENT_COPY_THREADS
