"""bench/gpu_clocks.py: what the GPU did during a bench phase, from nvidia-smi's samples (a stand-in
nvidia-smi script here: the parsing, the window, the old field name, and no nvidia-smi at all)."""
import importlib.util
import os
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("gpu_clocks", ROOT / "bench" / "gpu_clocks.py")
gpu_clocks = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_clocks)


def test_a_sample_line_and_its_clock_reasons():
    sample = gpu_clocks.parse("100, 1980, 1980, 61, 655.20, 0x0000000000000004")
    assert sample == {"util": 100.0, "sm_mhz": 1980.0, "max_sm_mhz": 1980.0, "temp_c": 61.0, "power_w": 655.2,
                      "reasons": 4}
    assert gpu_clocks.reasons(0x4 | 0x40) == ["sw_power_cap", "hw_thermal_slowdown"]
    assert gpu_clocks.reasons(0x1000) == ["0x1000"]
    assert gpu_clocks.parse("[N/A], 1980, 1980, 61, 655.20, 0x0") is None
    assert gpu_clocks.parse("100, 1980, 61") is None


def test_the_summary_keeps_only_the_timed_window():
    fast = {"util": 100.0, "sm_mhz": 1980.0, "max_sm_mhz": 1980.0, "temp_c": 60.0, "power_w": 600.0, "reasons": 0}
    slow = {**fast, "sm_mhz": 1200.0, "temp_c": 85.0, "reasons": 0x4}
    idle = {**fast, "util": 0.0, "sm_mhz": 345.0, "reasons": 0x1}
    samples = [(0.0, idle), (1.0, fast), (2.0, slow), (3.0, fast), (4.0, idle)]
    summary = gpu_clocks.summarise(samples, 1.0, 3.0)
    assert summary == {"samples": 3, "util_pct": {"min": 100.0, "median": 100.0},
                       "sm_mhz": {"min": 1200.0, "median": 1980.0, "max_clock": 1980.0},
                       "temp_c_max": 85.0, "power_w_max": 600.0, "clock_reasons": {"sw_power_cap": 0.33}}
    # the idle samples before and after the work would say otherwise
    assert gpu_clocks.summarise(samples, 0.0, 4.0)["util_pct"]["min"] == 0.0
    assert gpu_clocks.summarise(samples, 5.0, 6.0) is None


def stand_in_smi(folder: Path, accepts_new_field: bool) -> None:
    """An nvidia-smi that answers the query once, or every -lms interval until it is stopped."""
    smi = folder / "nvidia-smi"
    refuse = "" if accepts_new_field else 'case "$*" in *clocks_event_reasons*) echo "Field not valid" >&2; exit 2;; esac\n'
    smi.write_text("#!/bin/sh\n" + refuse +
                   'case "$*" in *-lms=*) while true; do echo "97, 1755, 1980, 70, 640.5, 0x4"; sleep 0.05; done;; '
                   '*) echo "97, 1755, 1980, 70, 640.5, 0x4";; esac\n')
    smi.chmod(0o755)


def sample_with(folder: Path, monkeypatch) -> dict | None:
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")
    with gpu_clocks.GpuSampler(interval_ms=50) as sampler:
        since = time.monotonic()
        time.sleep(0.6)
        until = time.monotonic()
    return sampler.summary(since, until)


def test_the_sampler_reads_nvidia_smi_while_the_work_runs(tmp_path, monkeypatch):
    stand_in_smi(tmp_path, accepts_new_field=True)
    summary = sample_with(tmp_path, monkeypatch)
    assert summary["samples"] >= 3
    assert summary["sm_mhz"] == {"min": 1755.0, "median": 1755.0, "max_clock": 1980.0}
    assert summary["clock_reasons"] == {"sw_power_cap": 1.0}


def test_an_older_driver_is_asked_the_old_field_name(tmp_path, monkeypatch):
    stand_in_smi(tmp_path, accepts_new_field=False)
    assert sample_with(tmp_path, monkeypatch)["samples"] >= 3


def test_no_nvidia_smi_no_record(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_clocks.shutil, "which", lambda name: None)
    with gpu_clocks.GpuSampler() as sampler:
        pass
    assert sampler.summary(0.0, time.monotonic()) is None
