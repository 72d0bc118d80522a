"""The extraction run around a backend: what its summary counts, and what a rerun trusts. A small
fake backend stands in for vLLM here; the real one runs in tests/e2e/test_extractor.py."""
import json
import os
import re
import signal
import time
from pathlib import Path

import pytest

from hidden_states import backends
from hidden_states.plan import planner
from hidden_states.errors import PreflightError
from hidden_states.extract.command import Extraction
from hidden_states.settings import Settings
from hidden_states.forward_check import KernelCheck
from tests.unit.fakes import FakeBackend

pytest.importorskip("torch")

SHUTDOWN = 1.0
WORKER_LIFE = 300  # seconds a fake vLLM worker lives unless killed (they are, at the backend's close)


class SlowShutdownBackend(FakeBackend):
    kernel_errors = [0.0, 1e-6]  # what the forward check reports: one relative error per self-test

    def check_forward(self, probe):
        assert probe and all(0 <= i < 64 for i in probe)  # ids the model's vocabulary has
        return [KernelCheck("RMSNorm (q_norm)", "[16, 4, 32]/stride [256, 32, 1]", e) for e in self.kernel_errors]

    def close(self):
        self.closing_began = time.monotonic()
        time.sleep(SHUTDOWN)


@pytest.fixture
def job(fake_model, tmp_path, monkeypatch):
    """Three samples (3, 4 and 5 tokens) of the fake model and settings that run the fake backend."""
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"input_ids": [5] * n}) + "\n" for n in (3, 4, 5)))
    monkeypatch.setattr(backends, "create", lambda name, settings: SlowShutdownBackend(settings))
    return Settings(model_path=str(fake_model), prepared_data=str(data), output_dir=str(tmp_path / "out"),
                    batch_size=2, layer_ids=[1, 3], backend="fake", format="speculators-0.3")


def run(settings, log):
    return Extraction(settings, log=log).run()


def data_files(settings):
    return sorted(p.name for p in Path(settings.output_dir).glob("data_*.pt"))


def test_shutdown_is_reported_apart_from_the_extraction(job, monkeypatch):
    made = []
    monkeypatch.setattr(backends, "create", lambda name, settings: made.append(SlowShutdownBackend(settings)) or made[-1])
    before = time.monotonic()
    summary = run(job, log=lambda message: None)

    assert (summary.extracted, summary.tokens) == (3, 12)
    assert summary.shutdown_seconds >= SHUTDOWN
    # the extraction's time ends where the shutdown begins, however long either took on a busy host
    assert summary.seconds <= made[0].closing_began - before
    assert f"shutdown {summary.shutdown_seconds:.1f} s" in summary.line()
    assert data_files(job) == ["data_0.pt", "data_1.pt", "data_2.pt"]


@pytest.mark.parametrize("damage", [b"", b"PK\x03\x04 the first bytes of a zip, and no end"])
def test_a_file_cut_short_by_a_crash_is_redone(job, damage):
    import torch

    run(job, log=lambda message: None)
    cut = Path(job.output_dir) / "data_1.pt"
    cut.write_bytes(damage)  # what a power cut can leave: the rename on disk, the data not
    said = []

    summary = run(job, log=said.append)

    assert (summary.extracted, summary.skipped) == (1, 2)
    assert any("1 files" in line and "cut short" in line and "data_1.pt" in line for line in said), said
    assert data_files(job) == ["data_0.pt", "data_1.pt", "data_2.pt"]
    assert torch.load(cut, weights_only=True)["input_ids"].tolist() == [5] * 4


def test_no_writer_thread_is_refused_when_called_as_a_library(job):
    from hidden_states.errors import UsageError

    job.writer_threads = 0
    with pytest.raises(UsageError, match="--writer-threads 0: must be at least 1"):
        run(job, log=lambda message: None)
    assert not Path(job.output_dir).exists()


@pytest.fixture
def small_disk(tmp_path):
    """A real 256 KiB filesystem (tmpfs), so that the disk fills up the way it does in production."""
    import subprocess

    mount = tmp_path / "small-disk"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], capture_output=True,
                          text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN): {made.stderr.strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


class BigStatesBackend(SlowShutdownBackend):
    """States far larger than the config's hidden size says, so that the preflight's estimate lets
    the run start and the disk fills up mid-run (about 64 KiB per sample)."""

    def extract(self, batch):
        import torch

        return [[torch.ones(len(ids), 4096) for _ in self.settings.layer_ids] for ids in batch]

    def close(self):
        pass


def test_a_full_disk_is_one_message_naming_the_file_and_keeps_finished_samples(job, small_disk, monkeypatch,
                                                                                 capsys):
    import torch

    from hidden_states.cli import main

    data = Path(job.prepared_data)
    data.write_text("".join(json.dumps({"input_ids": [5] * 2}) + "\n" for _ in range(12)))
    monkeypatch.setattr(backends, "create", lambda name, settings: BigStatesBackend(settings))
    monkeypatch.setattr(planner, "check_vllm", lambda backend, touched, speculators: "audit: not run (a fake backend)")
    out = small_disk / "out"

    code = main(["extract", "--model-path", job.model_path, "--prepared-data", str(data), "--output-dir", str(out),
                 "--format", "speculators-0.3", "--layer-ids", "1", "3", "--batch-size", "2", "--backend", "vllm-native"])

    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("hidden-states: error:")]
    assert len(errors) == 1, err
    assert re.search(r"writing sample \d+: .*/data_\d+\.pt: no space left on device$", errors[0]), errors[0]
    finished = sorted(out.glob("data_*.pt"))
    assert 0 < len(finished) < 12
    for path in finished:  # every file under a final name is whole
        assert torch.load(path, weights_only=True)["hidden_states"][0].shape == (2, 4096)
    assert not list(out.glob(".tmp-*"))


class DyingWorkerBackend(SlowShutdownBackend):
    """Runs a worker process, as vLLM's executor does; on the second batch the worker is SIGKILLed
    (as the kernel's OOM killer does) and the backend fails with what vLLM then raises."""

    worker = None

    def start(self):
        import multiprocessing

        type(self).worker = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(WORKER_LIFE,),
                                                                          name="VllmWorker-0", daemon=True)
        self.worker.start()
        self.extracts = 0
        return super().start()

    def extract(self, batch):
        self.extracts += 1
        if self.extracts == 2:
            os.kill(self.worker.pid, signal.SIGKILL)
            raise RuntimeError("cancelled")
        return super().extract(batch)

    def close(self):
        self.worker.terminate()
        self.worker.join()


def test_a_worker_process_that_dies_is_named_and_the_finished_samples_are_kept(job, monkeypatch):
    from hidden_states.run.summary import ExtractionFailed
    from hidden_states.processes import ProcessDied

    monkeypatch.setattr(backends, "create", lambda name, settings: DyingWorkerBackend(settings))
    with pytest.raises(ProcessDied) as died:
        run(job, log=lambda message: None)
    pid = DyingWorkerBackend.worker.pid
    message = str(died.value)
    assert message.startswith(f"vLLM's process VllmWorker-0 (pid {pid}) was killed by SIGKILL: a SIGKILL nobody "
                              f"asked for is most often the kernel's OOM killer"), message
    assert message.endswith("The run stopped on it: ExtractionFailed: extracting samples 2 (line 3) failed: "
                            "RuntimeError: cancelled. Finished samples are kept: rerun the same command to resume")
    assert [(e.name, e.pid, e.exitcode) for e in died.value.exits] == [("VllmWorker-0", pid, -signal.SIGKILL)]
    assert isinstance(died.value.__cause__, ExtractionFailed)
    assert data_files(job) == ["data_0.pt", "data_1.pt"]


class FailingBackend(DyingWorkerBackend):
    """Fails on the second batch with its worker alive (an error vLLM reports, not a death)."""

    def extract(self, batch):
        self.extracts += 1
        if self.extracts == 2:
            raise RuntimeError("Worker failed with error 'shape mismatch'")
        return SlowShutdownBackend.extract(self, batch)


def test_a_failure_without_a_death_is_reported_as_it_is_after_a_bounded_wait(job, monkeypatch):
    from hidden_states.run import lifecycle
    from hidden_states.run.summary import ExtractionFailed

    monkeypatch.setattr(backends, "create", lambda name, settings: FailingBackend(settings))
    monkeypatch.setattr(lifecycle, "EXIT_WAIT", 0.5)
    started = time.monotonic()
    with pytest.raises(ExtractionFailed, match="RuntimeError: Worker failed with error 'shape mismatch'"):
        run(job, log=lambda message: None)
    # the point is a bound: a wait for the worker's death that EXIT_WAIT did not end would last as long
    # as the worker (WORKER_LIFE); half of that is a margin no loaded host uses up
    assert time.monotonic() - started < WORKER_LIFE / 2
    assert data_files(job) == ["data_0.pt", "data_1.pt"]


@pytest.mark.parametrize("depth, expected", [
    (3, [2, 1, 0, 2]), (4, [2, 2, 1, 3]), (6, [2, 3, 3, 5]), (8, [2, 4, 5, 7]), (32, [2, 16, 29, 31]),
    (61, [2, 30, 58, 60]),
])
def test_default_layer_ids_are_speculators_own_four_at_every_depth(job, depth, expected):
    """speculators 0.3/0.4's generator default is [2, N//2, N-3, N-1] and its trainer fuses all
    entries but the last: four entries even where layers coincide, each state where it is listed."""
    import torch

    config = Path(job.model_path) / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "num_hidden_layers": depth}))
    job.layer_ids = None

    run(job, log=lambda message: None)

    assert json.loads((Path(job.output_dir) / "data_config.json").read_text())["layer_ids"] == expected
    saved = torch.load(Path(job.output_dir) / "data_0.pt", weights_only=True)["hidden_states"]
    assert [int(state[0, 0]) for state in saved] == expected  # the fake fills each layer's state with its id


def test_given_layer_ids_are_written_in_the_order_given(job):
    import torch

    job.layer_ids = [3, 1]
    run(job, log=lambda message: None)
    saved = torch.load(Path(job.output_dir) / "data_0.pt", weights_only=True)["hidden_states"]
    assert [int(state[0, 0]) for state in saved] == [3, 1]


def test_a_model_too_shallow_for_the_default_needs_layer_ids(job):
    from hidden_states.errors import UsageError

    config = Path(job.model_path) / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "num_hidden_layers": 2}))
    job.layer_ids = None
    with pytest.raises(UsageError, match="the model has 2 layers; speculators' default layer ids need at least 3"):
        run(job, log=lambda message: None)


def test_a_kernel_the_forward_check_finds_wrong_stops_the_run_before_any_file(job, monkeypatch):
    monkeypatch.setattr(SlowShutdownBackend, "kernel_errors", [0.0, 1.37])
    with pytest.raises(PreflightError, match=r"(?s)1 of 2 kernel self-tests.*relative error 1.37e\+00 \(WRONG\)"):
        run(job, log=lambda message: None)
    assert data_files(job) == []


def test_skip_forward_check_runs_without_it(job, monkeypatch):
    monkeypatch.setattr(SlowShutdownBackend, "kernel_errors", [1.37])
    job.forward_check = False
    said = []
    assert run(job, log=said.append).extracted == 3
    assert any("forward check skipped" in line for line in said), said


@pytest.mark.parametrize("where, warned", [("/dev/shm", False), ("/tmp", True)])
def test_a_states_segment_outside_dev_shm_is_warned_about(job, monkeypatch, where, warned):
    """vllm-engine's shared segment falls back to the temporary directory when /dev/shm lacks room:
    a file there is written back to disk, which the run says once it has started."""
    monkeypatch.setattr(SlowShutdownBackend, "start",
                        lambda self: {"backend": self.name, "states_segment": {"bytes": 2 * 10**9, "in": where}})
    said = []
    run(job, log=said.append)
    lines = [line for line in said if "the states' shared segment" in line]
    assert bool(lines) == warned, said
    if warned:
        assert lines[0] == ("warning: the states' shared segment (2.0 GB) is in /tmp: /dev/shm lacks room for it, "
                            "and a file there is written back to disk (a smaller --batch-size fits in memory)")


def test_a_refused_certificate_waits_for_no_process_to_die(monkeypatch):
    """A row its certificate refuses stops the run on the extractor's own word: no process died, so
    the run does not wait EXIT_WAIT for one (any other failure does, to name a death behind it)."""
    from hidden_states.certify.certifier import CertificateFailed
    from hidden_states.run import lifecycle

    asked = []
    monkeypatch.setattr(lifecycle.processes, "death", lambda *args, **kwargs: asked.append(kwargs["wait"]))
    cycle = object.__new__(lifecycle.Lifecycle)
    cycle.children = None
    assert cycle.process_died(CertificateFailed("sample 2 (line 3): not the engine's states; not written")) is None
    assert asked == []
    assert cycle.process_died(RuntimeError("cancelled")) is None
    assert asked == [lifecycle.EXIT_WAIT]
