"""bench/certificates.py's table: each side's median and range, the certificates' overhead, and with
vLLM's prefill beside them, extract's ratio to it (the figures the benchmarks page quotes)."""
import importlib.util
import sys
from pathlib import Path

from tests.conftest import ROOT as _ROOT

BENCH = Path(_ROOT) / "bench"
_spec = importlib.util.spec_from_file_location("bench_certificates", BENCH / "certificates.py")
certificates = importlib.util.module_from_spec(_spec)
sys.path.insert(0, str(BENCH))  # the script imports its neighbours as the bench folder's modules
try:
    _spec.loader.exec_module(certificates)
finally:
    sys.path.remove(str(BENCH))


def record_of(**rates):
    return {"runs": [{"side": side, "tokens_per_s": value} for side, values in rates.items() for value in values]}


def test_the_table_gives_medians_ranges_the_overhead_and_the_ratio_to_the_prefill():
    record = record_of(prefill=[110, 90, 100], off=[80, 82, 81], on=[77, 79, 78])
    lines = certificates.table(record).splitlines()
    assert record["median_tokens_per_s"] == {"prefill": 100, "off": 81, "on": 78}
    assert record["overhead_percent"] == 3.7
    assert record["extract_vs_prefill"] == {"off": 0.81, "on": 0.78}
    assert "| vLLM's eager prefill | 3 | 100 | 90-110 |" in lines
    assert "| extract, certificates on | 3 | 78 | 77-79 |" in lines
    assert lines[-1] == "extract / vLLM's eager prefill: 0.81x certificates off, 0.78x on"


def test_without_the_prefill_there_is_no_ratio_to_it():
    record = record_of(off=[100, 100, 100], on=[95, 96, 94])
    text = certificates.table(record)
    assert "extract_vs_prefill" not in record and "prefill" not in text
    assert record["overhead_percent"] == 5.0 and text.endswith("overhead: 5.0 %")
