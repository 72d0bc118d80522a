"""What the GPU was doing while a bench phase ran: ``nvidia-smi`` sampled twice a second beside it.

Two runs of one workload on one machine have differed by a third (docs/benchmarks.md, the second
``generate`` run of 2026-12-04); the record this writes says whether the GPU was busy, at what SM
clock, and why the driver held the clock down, over the seconds that were timed.

    with GpuSampler() as sampler:
        started = time.monotonic(); ...; ended = time.monotonic()   # the measured work
    record = sampler.summary(started, ended)   # None where there is no nvidia-smi
"""
from __future__ import annotations

import shutil
import statistics
import subprocess
import threading
import time

FIELDS = ("utilization.gpu", "clocks.sm", "clocks.max.sm", "temperature.gpu", "power.draw",
          "clocks_event_reasons.active")
# drivers before 535 name the last field clocks_throttle_reasons.active
OLD_REASONS = "clocks_throttle_reasons.active"
# the bits of clocks_event_reasons.active (nvml's nvmlClocksEventReason*)
REASONS = {0x1: "gpu_idle", 0x2: "applications_clocks_setting", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
           0x10: "sync_boost", 0x20: "sw_thermal_slowdown", 0x40: "hw_thermal_slowdown",
           0x80: "hw_power_brake_slowdown", 0x100: "display_clock_setting"}


def reasons(mask: int) -> list[str]:
    return [name for bit, name in REASONS.items() if mask & bit] + ([f"0x{mask:x}"] if mask & ~sum(REASONS) else [])


def parse(line: str) -> dict | None:
    """One ``--format=csv,noheader,nounits`` line of ``FIELDS`` (the first GPU's), or None."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != len(FIELDS):
        return None
    try:
        return {"util": float(parts[0]), "sm_mhz": float(parts[1]), "max_sm_mhz": float(parts[2]),
                "temp_c": float(parts[3]), "power_w": float(parts[4]), "reasons": int(parts[5], 16)}
    except ValueError:
        return None


def summarise(samples: list[tuple[float, dict]], since: float, until: float) -> dict | None:
    """The samples taken from ``since`` to ``until``: utilisation and SM clock (min, median), the hottest
    and the most power drawn, each clock-event reason seen with the share of samples it held in."""
    kept = [s for t, s in samples if since <= t <= until]
    if not kept:
        return None
    seen: dict[str, int] = {}
    for sample in kept:
        for name in reasons(sample["reasons"]):
            seen[name] = seen.get(name, 0) + 1
    return {"samples": len(kept),
            "util_pct": {"min": min(s["util"] for s in kept), "median": statistics.median(s["util"] for s in kept)},
            "sm_mhz": {"min": min(s["sm_mhz"] for s in kept), "median": statistics.median(s["sm_mhz"] for s in kept),
                       "max_clock": max(s["max_sm_mhz"] for s in kept)},
            "temp_c_max": max(s["temp_c"] for s in kept), "power_w_max": max(s["power_w"] for s in kept),
            "clock_reasons": {name: round(count / len(kept), 2) for name, count in sorted(seen.items())}}


class GpuSampler:
    """Samples the first GPU every ``interval_ms`` in a ``nvidia-smi -lms`` process read by a thread."""

    def __init__(self, interval_ms: int = 500):
        self.interval_ms = interval_ms
        self.samples: list[tuple[float, dict]] = []
        self._process = None
        self._reader = None

    def __enter__(self) -> "GpuSampler":
        smi = shutil.which("nvidia-smi")
        if smi is None:
            return self
        for fields in (FIELDS, FIELDS[:-1] + (OLD_REASONS,)):
            query = [smi, f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits", "--id=0"]
            probe = subprocess.run(query, capture_output=True, text=True)
            if probe.returncode == 0 and parse(probe.stdout.splitlines()[0] if probe.stdout else "") is not None:
                break
        else:
            return self
        self._process = subprocess.Popen(query + [f"-lms={self.interval_ms}"], stdout=subprocess.PIPE,
                                         stderr=subprocess.DEVNULL, text=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        return self

    def _read(self) -> None:
        for line in self._process.stdout:
            sample = parse(line)
            if sample is not None:
                self.samples.append((time.monotonic(), sample))

    def __exit__(self, *exc) -> None:
        if self._process is not None:
            self._process.terminate()
            self._process.wait()
            self._reader.join(timeout=5)

    def summary(self, since: float, until: float) -> dict | None:
        """The samples of the timed part of the phase (``time.monotonic()`` values)."""
        return summarise(self.samples, since, until)
