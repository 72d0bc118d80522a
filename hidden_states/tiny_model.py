"""Tiny random-weight checkpoints, built locally, for demos and tests (no model hub needed).

Each family is a small decoder with real architecture code paths in both vLLM and HF
transformers: fixed seed, fp32 weights, ``head_dim`` 32 (vLLM's CPU attention supports 32 and
up), and a word-level tokenizer made with ``tokenizers`` so that ``AutoTokenizer`` loads it
offline.

    python -m hidden_states.tiny_model llama /tmp/tiny-llama
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

VOCAB_SIZE = 512
MAX_POSITIONS = 4096
SEED = 1234

# Shapes shared by every family: 4 heads of 32, 2 KV heads (GQA), 6 layers.
_COMMON = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=MAX_POSITIONS,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    torch_dtype="float32",
)

FAMILIES = {
    "llama": ("LlamaConfig", dict(_COMMON, head_dim=32)),
    "qwen3": ("Qwen3Config", dict(_COMMON, head_dim=32)),
    "qwen2": ("Qwen2Config", dict(_COMMON)),
}


def _tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    vocab = {tok: i for i, tok in enumerate(specials)}
    for i in range(len(specials), VOCAB_SIZE):
        vocab[f"w{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.save_pretrained(path)


def build(family: str, path: str | Path, *, seed: int = SEED) -> Path:
    """Write a tiny ``family`` checkpoint and tokenizer to ``path``; reuse it if already complete.

    Args:
        family: one of ``FAMILIES``.
        path: directory to write (created).
        seed: torch seed for the random weights; the same seed gives the same bytes.

    Returns:
        The checkpoint directory.
    """
    import torch
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"unknown tiny model family {family!r}; choose from {sorted(FAMILIES)}")
    path = Path(path)
    stamp = path / ".tiny-model.json"
    recipe = {"family": family, "seed": seed, "config": FAMILIES[family][1]}
    if stamp.exists() and json.loads(stamp.read_text()) == recipe:
        return path
    path.mkdir(parents=True, exist_ok=True)
    config_cls_name, kwargs = FAMILIES[family]
    config = getattr(transformers, config_cls_name)(**kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    # Default init leaves RMSNorm weights at 1 and a tiny weight scale: give every tensor signal so
    # that a wrong layer or a post-norm state is visibly different from the right one.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.08)
    model.save_pretrained(path, safe_serialization=True)
    _tokenizer(path)
    stamp.write_text(json.dumps(recipe, sort_keys=True))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build a tiny random-weight model for tests and demos.")
    parser.add_argument("family", choices=sorted(FAMILIES))
    parser.add_argument("path")
    parser.add_argument("--seed", type=int, default=SEED)
    args = parser.parse_args(argv)
    print(build(args.family, args.path, seed=args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
