"""Import paths of the consumer code the adapters patch (speculators 0.3.x / 0.4.x), in one place."""

GENERATOR = "speculators.data_generation.vllm_hidden_states_generator"
WORKER_EXTENSION = "speculators.data_generation.custom_worker:HiddenStatesWorkerExtension"
# speculators releases that drive vLLM internals in-process (0.5+ talk to a vLLM server instead)
IN_PROCESS_SPECULATORS = ">=0.3.0,<0.5"


def generator_name(name: str) -> str:
    """A module-level name inside the generator module, e.g. the ``Scheduler`` it imported."""
    return f"{GENERATOR}:{name}"
