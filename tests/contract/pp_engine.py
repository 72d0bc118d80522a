"""Run from tests/contract/test_cpu_pp_intermediate_buffers.py in a process of its own: vLLM's own
``LLM`` on a tiny model with ``pipeline_parallel_size`` stages (vLLM's multiprocessing executor,
eager), after ``vllm_compat.apply()`` (``VLLM_COMPAT_DISABLE`` in the environment disables adapters);
prints the greedy tokens of ``PROMPTS`` as one JSON line behind ``TOKENS``.

    python tests/contract/pp_engine.py MODEL PP_SIZE
"""
import json
import sys

# two prompts of different lengths (a batch of uneven rows crosses the stage boundary)
PROMPTS = [[1, 5, 9, 33, 70, 100, 4, 8], [2, 17, 250, 3, 3, 91, 12, 40, 7, 64, 11, 5, 300]]
MAX_TOKENS = 8
KV_CACHE_BYTES = 64 * 2**20


def main(model: str, pp_size: int) -> None:
    import vllm_compat

    vllm_compat.apply()
    import vllm

    llm = vllm.LLM(model=model, pipeline_parallel_size=pp_size, distributed_executor_backend="mp",
                   enforce_eager=True, kv_cache_memory_bytes=KV_CACHE_BYTES, max_model_len=256, seed=0)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in PROMPTS],
                           vllm.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0), use_tqdm=False)
    print("TOKENS " + json.dumps([list(o.outputs[0].token_ids) for o in outputs]), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
