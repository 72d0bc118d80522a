"""The backend the project exists for: the unmodified speculators generator, made to run (and be right) by
``vllm_compat.apply()``."""
from __future__ import annotations

from concurrent.futures import Future

from . import ONE_BATCH_AHEAD, Backend, BackendSettings, completed
from .overlap import OverlappedCalls


def refuse_pipeline(pp_size: int) -> None:
    """speculators 0.3/0.4's generator has no pipeline parallelism: ``VllmHiddenStatesGenerator``
    takes ``tensor_parallel_size`` only (the config it builds, and its KV cache configs, are one per
    tensor-parallel worker), and its worker extension's capture returns early on every stage but the
    last (``custom_worker.py``), so the states of the other stages' layers would be lost."""
    if pp_size > 1:
        from ..errors import UsageError

        raise UsageError(f"--pp-size {pp_size}: --backend speculators cannot split the model into stages "
                         f"(speculators 0.3/0.4's VllmHiddenStatesGenerator takes tensor_parallel_size only, and "
                         f"its capture stores states on the last pipeline stage only); use --backend vllm-engine")


class SpeculatorsBackend(Backend):
    name = "speculators"
    tokens_per_submit = None  # a batch is one generator call
    tokens_ahead = ONE_BATCH_AHEAD  # one call runs while the one before it is copied out (overlap.py)

    def __init__(self, settings: BackendSettings):
        self.settings = settings
        self._generator = None
        self._calls: OverlappedCalls | None = None

    def start(self) -> dict:
        from vllm_compat.extractor_api import apply

        report = apply()
        from speculators.data_generation.vllm_hidden_states_generator import VllmHiddenStatesGenerator

        # The generator keeps len(prompt) + 1 <= max_model_len (it asks for one output token).
        self._generator = VllmHiddenStatesGenerator(
            self.settings.model_path,
            layer_ids=self.settings.layer_ids,
            max_model_len=self.settings.max_seq_len + 1,
            gpu_memory_utilization=self.settings.gpu_memory_utilization,
            tensor_parallel_size=self.settings.tp_size,
        )
        if self.settings.overlap:
            self._calls = OverlappedCalls(self._generator.executor, self._generate)
        return {"backend": self.name, "vllm_compat": report.to_dict()}

    def submit(self, batch: list[list[int]]) -> Future:
        return self._calls.submit(batch) if self._calls is not None else completed(self._generate, batch)

    def extract(self, batch: list[list[int]]) -> list[list]:
        return self.submit(batch).result()

    def _generate(self, batch: list[list[int]]) -> list[list]:
        results = self._generator.generate(batch)
        states = []
        for position, (ids, result) in enumerate(zip(batch, results, strict=True)):
            if result["input_ids"].tolist() != ids:
                raise RuntimeError(f"generator returned the states of other ids at batch position {position}")
            states.append(result["hidden_states"])
        return states

    def check_forward(self, probe: list[int]) -> list:
        from ..forward_check import verify_forward

        return verify_forward(self._generator.executor.collective_rpc, lambda: self.extract([probe]))

    def close(self) -> None:
        generator, self._generator = self._generator, None
        if generator is not None:
            generator.executor.shutdown()


BACKEND = SpeculatorsBackend
NEEDS_SPECULATORS = True  # the generator is speculators 0.3/0.4's
