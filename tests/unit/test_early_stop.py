"""Every way a run stops early ends with the same summary: what it extracted, every sample of its range
no file holds (not only the batch in flight), and what to do. A signal, bad input past the samples
the preflight reads, a failing backend, the loss of the only Ray replica; and a command that needs an
optional package refuses before any work. Small fakes stand in for vLLM and Ray."""
import importlib.util
import json
import os
import signal
import sys
import threading
from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("torch")

from hidden_states import backends  # noqa: E402
from hidden_states.replicas import driver  # noqa: E402
from hidden_states.cli import main  # noqa: E402
from hidden_states.errors import InputError  # noqa: E402
from hidden_states.extract.command import Extraction
from hidden_states.run.summary import ExtractionFailed  # noqa: E402
from hidden_states.plan.run_checks import FIRST_LINES  # noqa: E402
from tests.unit.fake_ray import FakeRay  # noqa: E402
from tests.unit.fakes import FakeBackend, fails, interrupt  # noqa: E402
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
    # the input was not read past the bad line: its lines from there on are counted (the bad one as
    # the sample it is meant to be once fixed)
    assert summary.extracted == written and summary.unfinished == total - written and summary.unfinished_exact
    assert said[-2].startswith(f"stopped: {written} samples extracted, 0 already finished, "
                               f"{summary.unfinished} samples not extracted, ")
    assert said[-1] == (f"fix {job.prepared_data}:{bad} (the error below) and rerun the same command: finished "
                        f"samples are kept and skipped")


@pytest.mark.parametrize("bad_row", ['{"input_ids": [5, 5,', '{"input_ids": [5, 5, 5, "x"]}'],
                         ids=["not-json", "a-bad-value"])
def test_a_bad_row_past_the_peek_is_recovered_as_the_stop_message_says(job, bad_row):
    """"fix line 121 and rerun the same command": the rerun on the corrected input keeps every
    finished sample and extracts the rest (a line that is not JSON was read again, and failed, while
    the run recorded where it stopped: the rerun was refused as another input)."""
    total, bad = 150, 121
    assert bad > FIRST_LINES
    lines = [LINE] * total
    lines[bad - 1] = bad_row + "\n"
    write_input(job, lines)
    stopped, said, failure = ran(job)
    assert isinstance(failure, InputError) and str(failure).startswith(f"{job.prepared_data}:{bad}: ")
    assert said[-1].startswith(f"fix {job.prepared_data}:{bad} (the error below) and rerun the same command")
    kept = files(job)
    assert kept == stopped.extracted > 0

    lines[bad - 1] = LINE  # as the message says: the line fixed, the same command again
    write_input(job, lines)
    resumed, said, failure = ran(job)
    assert failure is None, failure
    assert (resumed.skipped, resumed.extracted) == (kept, total - kept) and files(job) == total


def signalling(settings) -> FakeBackend:
    """Ctrl-C during its second batch."""
    return FakeBackend(settings, on_batch={2: interrupt})


def failing(settings) -> FakeBackend:
    """Raises on its third batch (vLLM reporting a failed worker)."""
    return FakeBackend(settings, on_batch={3: fails("Worker failed with error 'shape mismatch'")})


def test_a_signal_and_a_failure_end_with_the_same_summary(job, monkeypatch):
    write_input(job, [LINE] * 20)
    monkeypatch.setattr(backends, "create", lambda name, settings: signalling(settings))
    interrupted, said, failure = ran(job)
    assert failure is None and interrupted.interrupted == signal.SIGINT
    assert interrupted.unfinished == 20 - files(job) == 20 - interrupted.extracted
    # the input is short enough for the preflight to read it whole: the count is exact
    assert interrupted.line().startswith(f"interrupted: {interrupted.extracted} samples extracted, 0 already "
                                         f"finished, {interrupted.unfinished} samples not extracted, ")
    assert interrupted.next_step == "rerun the same command to resume: finished samples are kept and skipped"

    job = replace(job, output_dir=job.output_dir + "-2")
    monkeypatch.setattr(backends, "create", lambda name, settings: failing(settings))
    stopped, said, failure = ran(job)
    assert isinstance(failure, ExtractionFailed)
    assert stopped.unfinished == 20 - files(job) == 20 - stopped.extracted == 16
    assert said[-2].startswith(f"stopped: 4 samples extracted, 0 already finished, 16 samples not extracted, ")
    assert said[-1] == "finished samples are kept: once the error below is dealt with, rerun the same command to resume"


@pytest.mark.parametrize("stopping", ["signalling", "failing"])
def test_a_signal_or_a_failure_past_the_peek_is_resumed_as_the_stop_message_says(job, monkeypatch, stopping):
    """"rerun the same command to resume": the rerun keeps what the stopped one finished."""
    total = FIRST_LINES + 86
    write_input(job, [LINE] * total)
    monkeypatch.setattr(backends, "create", lambda name, settings: globals()[stopping](settings))
    stopped, said, _ = ran(job)
    assert "rerun the same command" in stopped.next_step and stopped.stopped
    kept = files(job)
    assert 0 < kept < total
    monkeypatch.setattr(backends, "create", lambda name, settings: FakeBackend(settings))
    resumed, said, failure = ran(job)
    assert failure is None, failure
    assert (resumed.skipped, resumed.extracted) == (kept, total - kept) and files(job) == total


def test_the_only_ray_replica_lost_counts_every_sample_it_left(job, monkeypatch):
    """The report: 40 of 48 samples missing, the run said 16 (the batches in flight)."""
    write_input(job, [LINE] * 48)
    fake = FakeRay({0: ("die", 2)})
    monkeypatch.setattr(driver, "import_ray", lambda: fake)
    settings = replace(job, batch_size=8, data_parallel_size=1, ray_address="auto")  # one replica, on Ray
    summary, said, failure = ran(settings)
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


def test_a_stop_past_the_peek_counts_exactly_the_samples_not_finished(job, monkeypatch):
    """The report: "about 1413 samples not extracted" where 1,312 were not. The rows after the first
    samples are longer than those: the rest of the input, estimated from the bytes read at the rate of
    the first rows, was off; its lines are counted now."""
    total = FIRST_LINES + 60
    write_input(job, [LINE] * (FIRST_LINES + 6) + [json.dumps({"input_ids": [5] * 60}) + "\n"] * 54)
    monkeypatch.setattr(backends, "create", lambda name, settings: signalling(settings))
    summary, said, failure = ran(job)
    assert failure is None and summary.interrupted == signal.SIGINT
    assert summary.unfinished == total - files(job) and summary.unfinished_exact
    assert summary.line().startswith(f"interrupted: {files(job)} samples extracted, 0 already finished, "
                                     f"{total - files(job)} samples not extracted, ")


class AbortedShutdown(FakeBackend):
    """Ctrl-C during its second batch, and again while vLLM shuts down (an impatient user)."""

    def __init__(self, settings):
        super().__init__(settings, on_batch={2: interrupt})

    def close(self):
        from hidden_states.interrupts import Aborted

        raise Aborted(signal.SIGINT)


def test_a_second_signal_during_the_shutdown_still_counts_the_files_written(job, monkeypatch):
    """The report: "0.0 MB written" and every written file counted as not extracted, after a run
    whose shutdown a second signal cut short."""
    write_input(job, [LINE] * 20)
    monkeypatch.setattr(backends, "create", lambda name, settings: AbortedShutdown(settings))
    summary, said, failure = ran(job)
    assert isinstance(failure, KeyboardInterrupt)
    written = sorted(Path(job.output_dir).glob("data_*.pt"))
    assert written and summary.extracted == len(written)
    assert summary.bytes_written == sum(path.stat().st_size for path in written)
    assert summary.unfinished == 20 - len(written)
    assert said[-2].startswith(f"interrupted: {len(written)} samples extracted, 0 already finished, "
                               f"{20 - len(written)} samples not extracted, ")


def test_rows_a_full_disk_refused_are_not_counted_as_extracted(job, monkeypatch):
    """Rows handed to the writer whose files the disk then refused are not extracted: the summary
    counts the files written, and with the samples not extracted makes the range (the report: 151
    of 150)."""
    import errno

    import torch

    saved, real_save, lock = [], torch.save, threading.Lock()

    def full_after_five(obj, f, *args, **kwargs):
        with lock:  # the writer's threads save at once
            if len(saved) >= 5:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            saved.append(f)
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_after_five)
    write_input(job, [LINE] * 40)
    summary, said, failure = ran(replace(job, writer_queue=16))
    assert "no space left on device" in str(failure)
    assert files(job) == 5 and summary.extracted == 5 and summary.unfinished == 35
    assert said[-2].startswith("stopped: 5 samples extracted, 0 already finished, 35 samples not extracted, ")
