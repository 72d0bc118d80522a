"""The writer's drain: the files queued when a run ends (its last batch, written after the last
forward) are written by more threads than the run used, all at once."""
import threading

import pytest

from hidden_states.output.writer import BackgroundWriter

QUEUED = 4


class BarrierFormat:
    """Each save waits until ``QUEUED`` saves run at once (or fails after a while): a file is
    written only if as many threads as files are writing."""

    def __init__(self):
        self.barrier = threading.Barrier(QUEUED, timeout=5)

    def sample_file(self, index):
        return f"data_{index}.bin"

    def save(self, record, handle):
        self.barrier.wait()
        handle.write(record)

    def length(self, record):
        return len(record)


def queued_writer(tmp_path):
    writer = BackgroundWriter(tmp_path, max_pending=QUEUED, threads=1, format=BarrierFormat())
    for index in range(QUEUED):
        writer.submit(index, b"states")
    return writer


def test_drain_threads_write_the_queued_files_together(tmp_path):
    writer = queued_writer(tmp_path)
    writer.close(drain_threads=QUEUED - 1)
    assert sorted(p.name for p in tmp_path.glob("data_*.bin")) == [f"data_{i}.bin" for i in range(QUEUED)]
    assert writer.stats.files == QUEUED


def test_without_them_one_thread_writes_one_file_at_a_time(tmp_path):
    writer = queued_writer(tmp_path)
    with pytest.raises(threading.BrokenBarrierError):
        writer.close()
