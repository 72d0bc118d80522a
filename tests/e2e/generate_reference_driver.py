"""vLLM's own generation of the given prompts, for tests/e2e/test_generate.py's reference.

    python generate_reference_driver.py SPEC.json OUT.json

SPEC.json: {"model": dir, "prompts": [[ids...], ...], "max_tokens": N, "max_model_len": M}
OUT.json: [[generated ids...], ...], one per prompt: ``vllm.LLM.generate`` with greedy
``SamplingParams(temperature=0, max_tokens=N)``, one call, the prompts as token ids.
"""
import json
import sys


def main(spec_path: str, out_path: str) -> int:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = json.loads(open(spec_path).read())
    llm = LLM(model=spec["model"], max_model_len=spec["max_model_len"], gpu_memory_utilization=0.02,
              enforce_eager=True)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in spec["prompts"]],
                           SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"]))
    with open(out_path, "w") as handle:
        json.dump([list(output.outputs[0].token_ids) for output in outputs], handle)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
