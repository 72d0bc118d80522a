#!/usr/bin/env python3
"""Extracted states against vLLM's *own* forward: a check that needs no HF implementation.

    python bench/logits_check.py --output-dir OUT [--samples 4] [--eager] [--hf] [--top 20]

OUT is an extractor output directory whose layer ids end with the model's last layer (N-1). For the
first ``--samples`` files, the captured last-layer states go through the checkpoint's final norm and
``lm_head`` (HF modules, fp32) to next-token log-probabilities; vLLM's ``LLM`` scores the same ids
with ``prompt_logprobs`` (its default compiled path; ``--eager`` for the eager path the generators
use). Per position, the ``--top`` tokens vLLM ranks first (every token with ``--top 0``) are
compared, each distribution centred: relative error |ours - vLLM| / |vLLM|. ``--hf`` adds the same
comparison for HF's own forward. Where HF and vLLM disagree but the capture agrees with vLLM, the
capture is right and the two implementations differ; where the capture alone is off, it is not.
"""
import argparse
import json
import os
from pathlib import Path


def vllm_logprobs(model: str, sequences, top: int, vocab: int, eager: bool, tp: int):
    """Per sequence: (token ids [positions, k], log-probs [positions, k]) for positions 1..n-1."""
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    k = vocab if top == 0 else top
    llm = LLM(model, max_model_len=max(len(s) for s in sequences) + 8, max_logprobs=k, enforce_eager=eager,
              enable_prefix_caching=False, tensor_parallel_size=tp,
              gpu_memory_utilization=float(os.environ.get("LOGITS_CHECK_GPU_MEMORY", "0.80")))
    outputs = llm.generate([TokensPrompt(prompt_token_ids=s) for s in sequences],
                           SamplingParams(max_tokens=1, prompt_logprobs=k))
    result = []
    for output in outputs:
        ids, values = [], []
        for position in output.prompt_logprobs[1:]:
            ranked = sorted(position.items(), key=lambda item: item[1].rank)[:k]
            ids.append([token for token, _ in ranked])
            values.append([entry.logprob for _, entry in ranked])
        result.append((torch.tensor(ids), torch.tensor(values)))
    return result


def centred_error(ours, theirs):
    ours = ours - ours.mean(-1, keepdim=True)
    theirs = theirs - theirs.mean(-1, keepdim=True)
    return (ours - theirs).norm(dim=-1) / theirs.norm(dim=-1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output-dir", required=True, type=Path)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--top", type=int, default=20, help="tokens compared per position (0: all)")
    parser.add_argument("--eager", action="store_true", help="score with vLLM's eager path")
    parser.add_argument("--hf", action="store_true", help="also compare HF's own forward")
    parser.add_argument("--tp", type=int, default=1)
    args = parser.parse_args()

    import torch

    from hidden_states.fixtures.reference import decoder_layer_outputs, load_model

    config = json.loads((args.output_dir / "data_config.json").read_text())
    model_dir = config["model"]
    layer_ids = config["layer_ids"]
    files = sorted(args.output_dir.glob("data_*.pt"), key=lambda p: int(p.stem.split("_")[1]))[: args.samples]
    samples = [torch.load(f, weights_only=True) for f in files]
    sequences = [s["input_ids"].tolist() for s in samples]

    device = "cuda" if torch.cuda.is_available() else "cpu"
    hf = load_model(model_dir, device=device)
    last = hf.config.num_hidden_layers - 1
    if layer_ids[-1] != last:
        raise SystemExit(f"{args.output_dir}: layer ids {layer_ids} do not end with the last layer ({last})")
    scored = vllm_logprobs(model_dir, sequences, args.top, hf.config.vocab_size, args.eager, args.tp)
    references = decoder_layer_outputs(hf, sequences, [last]) if args.hf else None

    def logprobs_at(states, ids):
        with torch.no_grad():
            full = torch.log_softmax(hf.lm_head(hf.model.norm(states.to(device).float())).float(), -1)[:-1]
        return full.gather(-1, ids.to(device)).cpu()

    print(f"vLLM {'eager' if args.eager else 'compiled'}, top {args.top or 'all'} tokens per position\n")
    print("| sample | tokens | capture vs vLLM mean | max |" + (" HF vs vLLM mean | max |" if args.hf else ""))
    print("|---|---|---|---|" + ("---|---|" if args.hf else ""))
    for i, (f, sample, (ids, values)) in enumerate(zip(files, samples, scored)):
        ours = centred_error(logprobs_at(sample["hidden_states"][-1], ids), values)
        row = f"| {f.name} | {len(sequences[i])} | {float(ours.mean()):.4f} | {float(ours.max()):.4f} |"
        if references is not None:
            theirs = centred_error(logprobs_at(references[i][0], ids), values)
            row += f" {float(theirs.mean()):.4f} | {float(theirs.max()):.4f} |"
        print(row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
