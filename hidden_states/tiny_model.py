"""Tiny random-weight checkpoints, built locally, for demos and tests (no model hub needed).

Each family is a small decoder with real architecture code paths in both vLLM and HF
transformers: fixed seed, fp32 weights, ``head_dim`` 32 (vLLM's CPU attention supports 32 and
up; ``qwen3_hd128`` has Qwen3's real 128), and a word-level tokenizer made with ``tokenizers`` so that ``AutoTokenizer`` loads it
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
    # Qwen3's real head size (128, as in Qwen3-0.6B to 235B): 2 query heads over 1 KV head
    "qwen3_hd128": ("Qwen3Config", dict(_COMMON, num_attention_heads=2, num_key_value_heads=1, head_dim=128)),
    # Qwen3-MoE layout (every layer routed, top-2 of 8 experts, q/k-norm) in miniature
    "qwen3_moe": ("Qwen3MoeConfig", dict(
        _COMMON, head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
        decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)),
    "qwen2": ("Qwen2Config", dict(_COMMON)),
    # DeepSeek-V3 layout (MLA, a dense first layer, routed + shared experts, grouped top-k) in miniature
    "deepseek": ("DeepseekV3Config", dict(
        _COMMON, num_key_value_heads=4, moe_intermediate_size=64, n_shared_experts=1, n_routed_experts=8,
        num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
        norm_topk_prob=True, topk_method="noaux_tc", scoring_func="sigmoid", q_lora_rank=64,
        kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32)),  # MLA kernels want 512 + 64
}

# Real shapes with random weights, for the GPU benchmarks (bf16, built on the GPU).
_DEEPSEEK_V3_MLA = dict(q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
                        v_head_dim=128)
LARGE = {
    # Llama-3-8B: 8.0 B parameters (6.98 B without the embeddings), 32 layers, GQA 32/8 heads.
    "llama3-8b": ("LlamaConfig", dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=8192,
        rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
        pad_token_id=0, torch_dtype="bfloat16")),
    # The DeepSeek-V3 / Kimi-K2 layer shapes (MLA with their real head dims, a first dense layer,
    # routed + shared experts, grouped top-k) scaled to 12 layers, 2048 wide, 64 experts.
    "deepseek-v3-small": ("DeepseekV3Config", dict(
        vocab_size=32768, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=512,
        num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=16, n_shared_experts=1,
        n_routed_experts=64, num_experts_per_tok=6, n_group=8, topk_group=4, first_k_dense_replace=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, topk_method="noaux_tc", scoring_func="sigmoid", max_position_embeddings=8192, rms_norm_eps=1e-6,
        rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        torch_dtype="bfloat16", **_DEEPSEEK_V3_MLA)),
}


def _tokenizer(path: Path, vocab_size: int = VOCAB_SIZE) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    vocab = {tok: i for i, tok in enumerate(specials)}
    for i in range(len(specials), vocab_size):
        vocab[f"w{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.save_pretrained(path)
    # transformers 5 names its class TokenizersBackend, which transformers 4 cannot load; the 4.x
    # name loads in both, and the matrix shares one model directory across vLLM releases.
    config_path = Path(path) / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2))


# transformers 5 saves some config fields under new names that transformers 4 does not read (it then
# takes its default: Qwen3-MoE's 128 experts instead of 8), and the matrix shares one model directory
# across vLLM releases that bring either. Keep the old name beside the new one.
_RENAMED_IN_TRANSFORMERS_5 = ("num_experts",)


def _keep_config_names(path: Path, kwargs: dict) -> None:
    config_path = path / "config.json"
    config = json.loads(config_path.read_text())
    missing = {name: kwargs[name] for name in _RENAMED_IN_TRANSFORMERS_5 if name in kwargs and name not in config}
    if missing:
        config_path.write_text(json.dumps({**config, **missing}, indent=2, sort_keys=True))


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

    known = {**FAMILIES, **LARGE}
    if family not in known:
        raise ValueError(f"unknown model family {family!r}; choose from {sorted(known)}")
    path = Path(path)
    stamp = path / ".tiny-model.json"
    recipe = {"family": family, "seed": seed, "config": known[family][1]}
    if stamp.exists() and json.loads(stamp.read_text()) == recipe:
        return path
    path.mkdir(parents=True, exist_ok=True)
    config_cls_name, kwargs = known[family]
    config = getattr(transformers, config_cls_name)(**kwargs)
    torch.manual_seed(seed)
    large = family in LARGE
    dtype = torch.bfloat16 if large else torch.float32
    device = "cuda" if large and torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=dtype)
    # Default init leaves RMSNorm weights at 1 and a tiny weight scale: give every tensor signal so
    # that a wrong layer or a post-norm state is visibly different from the right one. The large
    # shapes keep a trained model's scale (std 0.02) so activations stay in bf16's range.
    scale = 0.02 if large else 0.08
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            elif name.endswith("mlp.gate.weight") and large:
                # A trained router separates its top experts clearly; a random one at weight scale
                # leaves near-ties that bf16 and fp32 break differently (a different expert, a
                # different state). Give the random router a trained one's margins.
                param.normal_(0.0, 1.0)
            elif name.endswith("e_score_correction_bias") and large:
                param.zero_()
            else:
                param.normal_(0.0, scale)
    model.save_pretrained(path, safe_serialization=True)
    _keep_config_names(path, kwargs)
    _tokenizer(path, kwargs["vocab_size"])
    stamp.write_text(json.dumps(recipe, sort_keys=True))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build a tiny random-weight model for tests and demos.")
    parser.add_argument("family", choices=sorted({**FAMILIES, **LARGE}))
    parser.add_argument("path")
    parser.add_argument("--seed", type=int, default=SEED)
    args = parser.parse_args(argv)
    print(build(args.family, args.path, seed=args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
