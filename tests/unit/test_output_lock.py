"""One run at a time per output directory (``output.DirectoryLock``): another process holding the
lock (a real one, ``flock`` on the lock file) refuses a run before it writes anything, naming it; a
lock whose holder was killed is taken over, and said; a static shard's run shares the directory
with its other shards only. With the small fake backend of test_extraction_stages; two real
extract processes meet in tests/e2e/test_extractor.py."""
import json
import os
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("torch")

from hidden_states.plan.batches import ShardBatches  # noqa: E402
from hidden_states.errors import OutputError  # noqa: E402
from hidden_states.extract.command import Extraction  # noqa: E402
from hidden_states.shards import Shard  # noqa: E402
from hidden_states.status import status  # noqa: E402
from tests.conftest import ROOT  # noqa: E402
from tests.unit.fakes import FakeBackend, quiet  # noqa: E402

HOLD = ("import sys, time\n"
        "from hidden_states.output.lock import DirectoryLock\n"
        "DirectoryLock(sys.argv[1], sys.argv[2] or None).acquire()\n"
        "print('held', flush=True)\n"
        "time.sleep(300)\n")


@pytest.fixture
def holding():
    """Start a process that takes a directory's lock (``tag``: as that static shard) and keeps it."""
    started = []

    def start(directory, tag: str = "") -> subprocess.Popen:
        Path(directory).mkdir(parents=True, exist_ok=True)
        proc = subprocess.Popen([sys.executable, "-c", HOLD, str(directory), tag], stdout=subprocess.PIPE, text=True,
                                cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
        started.append(proc)
        assert proc.stdout.readline().strip() == "held"
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def tree(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def test_a_run_is_refused_while_another_holds_the_directory_and_takes_a_killed_ones_lock_over(job, holding):
    Extraction(replace(job, max_samples=4), log=quiet).run()
    out = Path(job.output_dir)
    holder = holding(out)
    before = tree(out)

    held = f"--output-dir {out}: another run \\(pid {holder.pid} on .+\\) is writing into it; wait for it to end"
    with pytest.raises(OutputError, match=held):
        Extraction(job, log=quiet).plan()  # `hidden-states plan` says so, before any load
    with pytest.raises(OutputError, match=held):
        Extraction(job, log=quiet).run()
    assert tree(out) == before and FakeBackend.created == 1
    assert f"another run (pid {holder.pid} on " in status(out)

    holder.send_signal(signal.SIGKILL)  # the kernel lets its lock go; its record stays
    holder.wait()
    said = []
    summary = Extraction(job, log=said.append).run()
    assert (summary.extracted, summary.skipped) == (2, 4)
    assert any(f"{out}: lock taken over from a run that ended (pid {holder.pid} on " in line for line in said), said
    assert (out / ".hidden-states.lock").read_bytes() == b""  # and this run, which ended, left no record
    assert "is writing into it now" not in status(out)


def test_static_shards_share_the_directory_and_nothing_else_does(job, holding):
    out = Path(job.output_dir)
    shard0 = holding(out, "shard-0-of-2")
    summary = Extraction(job, log=quiet, source=ShardBatches(Shard(1, 2, "--shard"))).run()  # the other shard runs
    assert summary.extracted == 2  # its batches: samples 2 and 3 (batch size 2)

    with pytest.raises(OutputError, match=f"another run's static shards \\(shard-0-of-2: pid {shard0.pid} on "):
        Extraction(job, log=quiet).run()  # a single run, while a shard writes
    with pytest.raises(OutputError, match=f"another run \\(pid {shard0.pid} on "):
        Extraction(job, log=quiet, source=ShardBatches(Shard(0, 2, "--shard"))).run()  # the same shard twice


def test_a_run_holding_the_directory_refuses_a_shard(job, holding):
    holder = holding(Path(job.output_dir))
    with pytest.raises(OutputError, match=f"another run \\(pid {holder.pid} on "):
        Extraction(job, log=quiet, source=ShardBatches(Shard(0, 2, "--shard"))).run()


def test_a_range_limited_run_keeps_the_lengths_of_the_samples_it_did_not_touch(job):
    """The index a run writes lists every finished sample, not only its range's."""
    out = Path(job.output_dir)
    Extraction(replace(job, start_index=3), log=quiet).run()
    Extraction(replace(job, max_samples=2), log=quiet).run()
    assert json.loads((out / "sample_lengths.json").read_text()) == {"0": 3, "1": 4, "3": 6, "4": 7, "5": 8}
