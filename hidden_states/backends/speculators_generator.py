"""The mission's backend: the unmodified speculators generator, made to run (and be right) by
``vllm_compat.apply()``."""
from __future__ import annotations


class SpeculatorsBackend:
    name = "speculators"

    def __init__(self, *, model_path: str, layer_ids: list[int], max_seq_len: int, tp_size: int,
                 gpu_memory_utilization: float, trust_remote_code: bool = False):
        self.model_path = model_path
        self.layer_ids = list(layer_ids)
        self.max_seq_len = max_seq_len
        self.tp_size = tp_size
        self.gpu_memory_utilization = gpu_memory_utilization
        self.trust_remote_code = trust_remote_code
        self._generator = None

    def start(self) -> dict:
        import vllm_compat

        report = vllm_compat.apply()
        from speculators.data_generation.vllm_hidden_states_generator import VllmHiddenStatesGenerator

        # The generator keeps len(prompt) + 1 <= max_model_len (it asks for one output token).
        self._generator = VllmHiddenStatesGenerator(
            self.model_path,
            layer_ids=self.layer_ids,
            max_model_len=self.max_seq_len + 1,
            gpu_memory_utilization=self.gpu_memory_utilization,
            tensor_parallel_size=self.tp_size,
        )
        return {"backend": self.name, "vllm_compat": report.to_dict()}

    def extract(self, batch: list[list[int]]) -> list[list]:
        results = self._generator.generate(batch)
        states = []
        for position, (ids, result) in enumerate(zip(batch, results, strict=True)):
            if result["input_ids"].tolist() != ids:
                raise RuntimeError(f"generator returned the states of other ids at batch position {position}")
            states.append(result["hidden_states"])
        return states

    def close(self) -> None:
        generator, self._generator = self._generator, None
        if generator is not None:
            generator.executor.shutdown()
