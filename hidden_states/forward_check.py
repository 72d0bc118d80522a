"""Is the forward a capture sees the model's? Self-tests of the kernels its layers really run.

Two silent defects of vLLM's CPU kernels (``cpu_rotary_head_layout``, ``cpu_rms_norm_strided_input``)
made every hidden state after the first token of each sequence wrong, with no error: a kernel that
is right for one memory layout and wrong for another. Which layout a model hands a kernel depends
on the family (a strided ``[tokens, heads, head_dim]`` view for Qwen3's q/k-norm, a 3-D rotary
input for DeepSeek's MLA), so the test replays the model's own layouts:

1. :func:`record_layouts` (in each worker, after the model is loaded) puts forward pre-hooks on
   every vLLM ``RMSNorm`` and rotary embedding module; the caller then runs one short sequence;
2. :func:`check_recorded` (in each worker) removes the hooks, and for each distinct (module type,
   call layout) seen runs the module as the model does (its dispatched forward: kernels, and any
   adapter on them) on small random tensors laid out in memory exactly as recorded (shape, strides),
   and compares with plain PyTorch on the same values (written here: vLLM's own ``forward_native``
   calls custom ops in newer releases).

Both take the worker as their only argument: pass them to ``collective_rpc``. Cost: a handful of
kernel calls on tensors of the recorded shapes (at most ``MAX_TOKENS`` tokens) per distinct
layout, not per layer. No HF reference and no model-sized computation is needed.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from .errors import PreflightError

MAX_TOKENS = 16  # tokens per self-test: enough for every position-dependent defect seen
TOLERANCE = 5e-2  # relative; a layout defect is off by 0.3-1.3, rounding by < 1e-5 (fp32) or < 1e-2 (bf16)
_HOOKS = "_hidden_states_forward_check"
_KINDS = {"RMSNorm": "rms_norm", "RotaryEmbedding": "rotary", "RotaryEmbeddingBase": "rotary"}
_PARAMETERS = {"rms_norm": ("x", "residual"), "rotary": ("positions", "query", "key")}  # as vLLM names them


@dataclass(frozen=True)
class KernelCheck:
    """One self-test: ``module`` (its class) on inputs laid out as ``layout``.

    Attributes:
        module: the module's class name and where it sits in the model (its first occurrence).
        layout: the recorded call, as shape/stride of each tensor argument.
        error: relative error of the dispatched forward against plain PyTorch.
        untested: why no self-test ran (a module this check cannot replay); then ``error`` is nan.
    """

    module: str
    layout: str
    error: float
    untested: str = ""

    @property
    def ok(self) -> bool:
        return bool(self.untested) or self.error <= TOLERANCE

    def __str__(self) -> str:
        if self.untested:
            return f"{self.module} on {self.layout}: not self-tested ({self.untested})"
        verdict = "ok" if self.ok else "WRONG"
        return f"{self.module} on {self.layout}: relative error {self.error:.2e} ({verdict})"


def _kind(module) -> str | None:
    for cls in type(module).__mro__:
        if cls.__module__.startswith("vllm.model_executor.layers") and cls.__name__ in _KINDS:
            return _KINDS[cls.__name__]
    return None


def _layout(tensor):
    if tensor is None:
        return None
    return (tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)


def _describe(layout) -> str:
    return "None" if layout is None else f"{list(layout[0])}/stride {list(layout[1])}/{str(layout[2])[6:]}"


def _model(worker):
    runner = worker.model_runner
    return runner.get_model() if hasattr(runner, "get_model") else runner.model


def record_layouts(worker) -> int:
    """Hook the worker's model to record, per module type, the layouts of its calls. Returns the
    number of hooked modules."""
    model = _model(worker)
    seen: dict = {}
    handles = []

    def hook(name, kind):
        def record(module, args, kwargs):
            names = _PARAMETERS[kind]
            bound = list(args) + [kwargs.get(n) for n in names[len(args):]]
            key = (type(module), *(_layout(value) for value in bound[:len(names)]))
            seen.setdefault(key, (name, module, kind))
        return record

    for name, module in model.named_modules():
        kind = _kind(module)
        if kind is not None:
            handles.append(module.register_forward_pre_hook(hook(name, kind), with_kwargs=True))
    setattr(model, _HOOKS, (handles, seen))
    return len(handles)


def _strided(layout, tokens, generator, device):
    """Random values laid out with the recorded strides, ``tokens`` rows (dim 0) at most."""
    import torch

    shape, stride, dtype = layout
    shape = (min(shape[0], tokens), *shape[1:])
    span = 1 + sum((size - 1) * step for size, step in zip(shape, stride))
    storage = torch.randn(span, generator=generator, dtype=torch.float32).to(device=device, dtype=dtype)
    return torch.as_strided(storage, shape, stride)


def _relative(got, want) -> float:
    got, want = got.float(), want.float()
    return float((got - want).norm() / want.norm().clamp_min(1e-12))


def _normalise(x, module):
    """Plain RMSNorm (vLLM's ``forward_native`` itself dispatches to an op in newer releases)."""
    import torch

    x = x.float()
    width = getattr(module, "variance_size_override", None) or x.shape[-1]
    variance = x[..., :width].pow(2).mean(dim=-1, keepdim=True)
    x = x * torch.rsqrt(variance + module.variance_epsilon)
    weight = getattr(module, "weight", None)
    return x if weight is None or not getattr(module, "has_weight", True) else x * weight.float()


def _rms_norm(module, x_layout, residual_layout, generator, device):
    x = _strided(x_layout, MAX_TOKENS, generator, device)
    if residual_layout is None:
        return _relative(module(x), _normalise(x, module))
    residual = _strided(residual_layout, x.shape[0], generator, device)
    want_residual = x.float() + residual.float()
    want_out = _normalise(want_residual, module)
    got_out, got_residual = module(x.clone(), residual.clone())
    return max(_relative(got_out, want_out), _relative(got_residual, want_residual))


def _rotate(x, positions, module):
    """Plain rotary embedding from the module's cos/sin cache: vLLM's ``forward_native`` itself
    calls a custom op (``ApplyRotaryEmb``) in newer releases, so it cannot be the reference."""
    import torch

    head_size, rotary_dim = module.head_size, module.rotary_dim
    x = x.reshape(x.shape[0], -1, head_size).float()
    cos, sin = module.cos_sin_cache.float()[positions].chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rotated, kept = x[..., :rotary_dim], x[..., rotary_dim:]
    if module.is_neox_style:
        first, second = rotated.chunk(2, dim=-1)
        rotated = torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
    else:
        first, second = rotated[..., ::2], rotated[..., 1::2]
        rotated = torch.stack((first * cos - second * sin, second * cos + first * sin), dim=-1).flatten(-2)
    return torch.cat((rotated, kept), dim=-1)


def _rotary(module, positions_layout, query_layout, key_layout, generator, device):
    import torch

    query = _strided(query_layout, MAX_TOKENS, generator, device)
    key = None if key_layout is None else _strided(key_layout, query.shape[0], generator, device)
    tokens = query.shape[0]
    limit = module.cos_sin_cache.shape[0]
    shape = (*positions_layout[0][:-1], tokens)  # M-RoPE's positions are [3, tokens]
    positions = torch.randint(0, min(limit, 4096), shape, generator=generator).to(device)
    if positions.dim() == 1:
        want_query = _rotate(query, positions, module)
        want_key = None if key is None else _rotate(key, positions, module)
    else:  # M-RoPE and kin: sections of the cache per position row; vLLM's PyTorch path is the reference
        want_query, want_key = module.forward_native(positions, query.contiguous().clone(),
                                                     None if key is None else key.contiguous().clone())
    got_query, got_key = module(positions, query, key)  # in place or not: the returned tensors count
    errors = [_relative(got_query.reshape(want_query.shape), want_query)]
    if key is not None:
        errors.append(_relative(got_key.reshape(want_key.shape), want_key))
    return max(errors)


def check_recorded(worker) -> list[KernelCheck]:
    """Remove :func:`record_layouts`' hooks and self-test every recorded (module type, layout)."""
    import torch

    model = _model(worker)
    handles, seen = getattr(model, _HOOKS, ((), {}))
    for handle in handles:
        handle.remove()
    if hasattr(model, _HOOKS):
        delattr(model, _HOOKS)
    generator = torch.Generator().manual_seed(0)
    results = []
    with torch.inference_mode():
        for key, (name, module, kind) in seen.items():
            device = module.cos_sin_cache.device if kind == "rotary" else next(module.parameters(), torch.empty(0)).device
            layouts = key[1:]
            where = f"{type(module).__name__} ({name})", ", ".join(_describe(layout) for layout in layouts)
            try:
                test = _rms_norm if kind == "rms_norm" else _rotary
                results.append(KernelCheck(*where, test(module, *layouts, generator, device)))
            except Exception as exc:  # a variant this replay does not know must not stop the run
                results.append(KernelCheck(*where, float("nan"), untested=f"{type(exc).__name__}: {exc}"[:200]))
    return results


def verify_forward(collective_rpc, run_short_sequence) -> list[KernelCheck]:
    """Record the layouts the model's kernels see on one short sequence, then self-test them.

    Args:
        collective_rpc: the engine's or executor's ``collective_rpc`` (one reply per worker).
        run_short_sequence: runs one short sequence through the model (any capture included).

    Returns:
        Every worker's checks (none for a model without vLLM RMSNorm or rotary modules); the
        forward is the model's when all are ``ok``.
    """
    collective_rpc(record_layouts)
    try:
        run_short_sequence()
    finally:
        replies = collective_rpc(check_recorded)
    return [check for reply in replies for check in reply]


def check_forward(backend, vocab_size: int) -> str:
    """Self-test, in the workers, the kernels the model's layers run, in the layouts they run them
    (:func:`verify_forward`, through ``backend.check_forward``): a kernel that is wrong for one layout
    makes every state after the first token wrong with no error (docs/explanation/capture.md, "Forward check
    (after the model load, before the first sample)"). One short sequence and a few small kernel
    calls: seconds. ``extract``, ``generate`` and ``serve`` call it after the model loads."""
    started = time.monotonic()
    probe = [(7 + 31 * i) % vocab_size for i in range(16)]  # any ids: the values are random anyway
    checks = backend.check_forward(probe)
    wrong = [check for check in checks if not check.ok]
    if wrong:
        lines = "\n".join(f"  {check}" for check in wrong)
        raise PreflightError(f"the forward vLLM runs here is not the model's: {len(wrong)} of {len(checks)} kernel "
                             f"self-tests disagree with plain PyTorch:\n{lines}\nThe captured states would be "
                             f"wrong. Run `vllm-compat audit`; --skip-forward-check skips this check at your risk.")
    untested = [f"\n  {check}" for check in checks if check.untested]
    return (f"forward check ok: {len(checks) - len(untested)} kernel self-tests on the model's own layouts "
            f"in {time.monotonic() - started:.1f} s" + "".join(untested))
