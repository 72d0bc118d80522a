"""Every way a run stops early ends with the same summary: what it extracted, every sample of its range
no file holds (not only the batch in flight), and what to do. A signal, bad input past the samples
the preflight reads, a failing backend, the loss of the only Ray replica; and a command that needs an
optional package refuses before any work. Small fakes stand in for vLLM and Ray."""
import importlib.util
import json
import os
import signal
import sys
from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("torch")

from hidden_states import backends, replicas  # noqa: E402
from hidden_states.cli import main  # noqa: E402
from hidden_states.errors import InputError  # noqa: E402
from hidden_states.extraction import Extraction, ExtractionFailed  # noqa: E402
from hidden_states.preflight import FIRST_LINES  # noqa: E402
from tests.unit.test_extraction_stages import FakeBackend, job  # noqa: E402,F401  (job: a fixture)
from tests.unit.test_replicas import FakeRay  # noqa: E402
from vllm_compat.environment import installer  # noqa: E402

LINE = json.dumps({"input_ids": [5] * 4}) + "\n"  # every line the same length: the estimate is exact


def write_input(settings, lines: list[str]) -> None:
    Path(settings.prepared_data).write_text("".join(lines))


def files(settings) -> int:
    return len(list(Path(settings.output_dir).glob("data_*.pt")))


def ran(settings, extraction=Extraction):
    said = []
    run = extraction(settings, log=said.append)
    try:
        run.run()
    except (Exception, KeyboardInterrupt) as exc:  # noqa: BLE001 - what each case raises is checked there
        return run.summary, said, exc
    return run.summary, said, None


def test_bad_input_past_the_preflight_ends_with_the_summary_and_the_line_to_fix(job):
    total = FIRST_LINES + 40
    bad = FIRST_LINES + 11  # 1-based line
    lines = [LINE] * total
    lines[bad - 1] = '{"input_ids": [5, 5, 5, "x"]}\n'
    write_input(job, lines)
    summary, said, failure = ran(job)
    assert isinstance(failure, InputError) and str(failure).startswith(f"{job.prepared_data}:{bad}: ")
    written = files(job)
    assert written == bad - 1 - (bad - 1) % job.batch_size  # the whole batches before the bad line
    # the input was not read past the bad line: the rest is estimated from its bytes (the bad line
    # itself made no sample to count by), and said so
    assert summary.extracted == written and total - written - 1 <= summary.unfinished <= total - written
    assert not summary.unfinished_exact
    assert said[-2].startswith(f"stopped: {written} samples extracted, 0 already finished, about "
                               f"{summary.unfinished} samples not extracted, ")
    assert said[-1] == (f"fix {job.prepared_data}:{bad} (the error below) and rerun the same command: finished "
                        f"samples are kept and skipped")


class SignallingBackend(FakeBackend):
    """Ctrl-C during its second batch."""

    def extract(self, batch):
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return super().extract(batch)


class FailingBackend(FakeBackend):
    """Raises on its third batch (vLLM reporting a failed worker)."""

    def extract(self, batch):
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls == 3:
            raise RuntimeError("Worker failed with error 'shape mismatch'")
        return super().extract(batch)


def test_a_signal_and_a_failure_end_with_the_same_summary(job, monkeypatch):
    write_input(job, [LINE] * 20)
    monkeypatch.setattr(backends, "create", lambda name, settings: SignallingBackend(settings))
    interrupted, said, failure = ran(job)
    assert failure is None and interrupted.interrupted == signal.SIGINT
    assert interrupted.unfinished == 20 - files(job) == 20 - interrupted.extracted
    # the input is short enough for the preflight to read it whole: the count is exact
    assert interrupted.line().startswith(f"interrupted: {interrupted.extracted} samples extracted, 0 already "
                                         f"finished, {interrupted.unfinished} samples not extracted, ")
    assert interrupted.next_step == "rerun the same command to resume: finished samples are kept and skipped"

    job = replace(job, output_dir=job.output_dir + "-2")
    monkeypatch.setattr(backends, "create", lambda name, settings: FailingBackend(settings))
    stopped, said, failure = ran(job)
    assert isinstance(failure, ExtractionFailed)
    assert stopped.unfinished == 20 - files(job) == 20 - stopped.extracted == 16
    assert said[-2].startswith(f"stopped: 4 samples extracted, 0 already finished, 16 samples not extracted, ")
    assert said[-1] == "finished samples are kept: once the error below is dealt with, rerun the same command to resume"


def test_the_only_ray_replica_lost_counts_every_sample_it_left(job, monkeypatch):
    """The report: 40 of 48 samples missing, the run said 16 (the batches in flight)."""
    write_input(job, [LINE] * 48)
    fake = FakeRay({0: ("die", 2)})
    monkeypatch.setattr(replicas, "import_ray", lambda: fake)
    settings = replace(job, batch_size=8, data_parallel_size=1)
    summary, said, failure = ran(settings, replicas.RayExtraction)
    assert isinstance(failure, ExtractionFailed)
    written = files(settings)
    assert written == 8 and summary.unfinished == 40
    assert said[-2].startswith("stopped: 8 samples extracted, 0 already finished, 40 samples not extracted, ")
    assert str(failure).startswith("40 samples were not extracted (finished files are kept")


def hide(monkeypatch, module):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == module else find_spec(name, *a))


def test_convert_to_05_without_datasets_refuses_before_the_first_sample(job, monkeypatch, tmp_path, capsys):
    write_input(job, [LINE] * 4)
    Extraction(job, log=lambda message: None).run()
    hide(monkeypatch, "datasets")
    dst = tmp_path / "converted"
    assert main(["convert", job.output_dir, str(dst), "--to", "speculators-0.5"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(
        "hidden-states: error: --to speculators-0.5 (its dataset index, which the trainer reads) needs the "
        f"'datasets' package, not installed here: {installer()} \"datasets>=4\" \"transformers=="), err
    assert not dst.exists()


def test_a_parquet_input_without_pyarrow_names_what_to_install_before_the_load(job, monkeypatch):
    path = Path(job.prepared_data).with_suffix(".parquet")
    path.write_bytes(b"PAR1" + b"\0" * 16 + b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # an import of it fails, as where it is not installed
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    monkeypatch.setattr(backends, "create", lambda name, settings: pytest.fail("the model was loaded"))
    with pytest.raises(InputError) as refused:
        Extraction(replace(job, prepared_data=str(path)), log=lambda message: None).run()
    assert f"reading Parquet needs the 'pyarrow' package: {installer()} \"pyarrow\"" in str(refused.value)
    assert not Path(job.output_dir).exists()
