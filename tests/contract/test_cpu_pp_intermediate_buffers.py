"""vLLM's own pipeline parallelism on its CPU backend, eager: a second stage's first step gathers
into a receive buffer only the (skipped) warm-up allocated. Each engine runs in a process of its
own (tests/contract/pp_engine.py): PP=1 as the reference, PP=2 with the adapter, PP=2 without it.
About 25 s an engine on two cores."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.contract.base import AdapterContract
from tests.e2e import harness
from vllm_compat.adapters.cpu_pp_intermediate_buffers import ADAPTER
from vllm_compat.probes.live import LiveSource
from vllm_compat.probes.verdicts import ADAPTED

ENGINE = Path(__file__).with_name("pp_engine.py")
# what stage 1's worker dies of without the adapter (gpu_model_runner.py:3174 in 0.32.0; the assert
# has no message, so the traceback's source line is what names it)
ASSERTED = "assert self.intermediate_tensors is not None"


def greedy_tokens(pp_size: int, disable: str = "") -> tuple[list[list[int]] | None, str]:
    # this checkout first: the script's own folder heads its path, and a venv may hold another
    # checkout's editable install of the shim
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0|1", HF_HUB_OFFLINE="1", VLLM_COMPAT_DISABLE=disable,
               PYTHONPATH=path)
    done = subprocess.run([sys.executable, str(ENGINE), str(harness.tiny_model("llama")), str(pp_size)],
                          env=env, capture_output=True, text=True, timeout=400)
    log = done.stdout + done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("TOKENS ")]
    return (json.loads(lines[-1][len("TOKENS "):]) if done.returncode == 0 and lines else None), log


class TestCpuPpIntermediateBuffers(AdapterContract):
    adapter_id = "cpu_pp_intermediate_buffers"
    first_new = "0.27.0"
    last_new = "0.33.0"
    not_observable_on_cpu = ("vLLM's own pipeline parallelism, which the generator has no parameter for: "
                             "test_without_it_the_second_stage_asserts is the negative proof, on vllm-cpu 0.32.0")

    def needed_here(self):
        needed, detail = ADAPTER.host_probe()
        if not needed:
            pytest.skip(detail)
        if self.probe(LiveSource()).verdict != ADAPTED:
            pytest.skip("this vLLM's CPU worker warms up in eager mode, which allocates the buffer: PP runs as is")

    @pytest.mark.per_vllm  # vLLM's engine alone, in processes of its own: no speculators code runs
    def test_patched_call(self):
        self.needed_here()
        reference, log = greedy_tokens(1)
        assert reference is not None, log[-4000:]
        two_stages, log = greedy_tokens(2)
        assert two_stages == reference, log[-4000:]

    @pytest.mark.per_vllm
    def test_without_it_the_second_stage_asserts(self):
        self.needed_here()
        tokens, log = greedy_tokens(2, disable=self.adapter_id)
        assert tokens is None and ASSERTED in log and "AssertionError" in log, log[-4000:]
