"""The writer grows while the run waits on it: a file rate above what its threads write (rows served
from shared prefixes write several times the bytes they compute) gets more threads, up to its cap,
and a run whose writer keeps up keeps the threads it started with."""
import threading
import time

from hidden_states.output.writer import BackgroundWriter
from hidden_states.settings import WRITER_THREADS_CAP, Settings


class SlowFormat:
    """Each save takes ``seconds``; counts the saves running at once."""

    def __init__(self, seconds):
        self.seconds, self.running, self.most = seconds, 0, 0
        self.lock = threading.Lock()

    def sample_file(self, index):
        return f"data_{index}.bin"

    def save(self, record, handle):
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
        time.sleep(self.seconds)
        with self.lock:
            self.running -= 1
        handle.write(record)

    def length(self, record):
        return len(record)


def write(tmp_path, files, seconds, **threads):
    writer = BackgroundWriter(tmp_path, max_pending=2, format=(fmt := SlowFormat(seconds)), **threads)
    writer.GROW_INTERVAL = 0.05
    for index in range(files):
        writer.submit(index, b"states")
    writer.close()
    assert writer.stats.files == files
    return writer, fmt


def test_a_writer_the_run_waits_on_grows_to_its_cap(tmp_path):
    writer, fmt = write(tmp_path, 40, 0.1, threads=1, max_threads=4)
    assert writer.stats.threads == 4 and fmt.most == 4


def test_a_fixed_writer_keeps_its_threads(tmp_path):
    writer, fmt = write(tmp_path, 12, 0.05, threads=2)
    assert writer.stats.threads == 2 and fmt.most <= 2


class SteppedClock:
    """The writer's clock (``time`` in hidden_states.output.writer), moved only by the test: the producer's
    work between two files takes ``step``, a file written takes no time. How long a busy host keeps
    a thread off the CPU then never counts as the producer waiting."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now

    def __getattr__(self, name):
        return getattr(time, name)


def test_a_writer_that_keeps_up_does_not_grow(tmp_path, monkeypatch):
    from hidden_states.output import writer as writer_module

    clock = SteppedClock()
    monkeypatch.setattr(writer_module, "time", clock)
    writer = BackgroundWriter(tmp_path, max_pending=8, format=SlowFormat(0.0), threads=1, max_threads=4)
    writer.GROW_INTERVAL = 0.05
    for index in range(20):
        while writer.stats.files < index:  # slower than the writer: the last file is written first
            time.sleep(0.001)
        clock.now += 0.01
        writer.submit(index, b"states")
    writer.close()
    assert writer.stats.files == 20
    assert writer.stats.threads == 1


def test_the_cap_by_default_and_per_backend(tmp_path, monkeypatch):
    paths = dict(model_path="m", prepared_data="d", output_dir="o")
    monkeypatch.setattr("os.cpu_count", lambda: 32)
    assert Settings(**paths).max_writer_threads == WRITER_THREADS_CAP
    assert Settings(**paths, backend="vllm-native").max_writer_threads == 1
    assert Settings(**paths, writer_threads=12).max_writer_threads == 12  # never below the start
    assert Settings(**paths, writer_threads=3, max_writer_threads=3).max_writer_threads == 3
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert Settings(**paths).max_writer_threads == 2  # writer_threads' default: half the cores is less


def test_a_writer_whose_run_waits_often_and_briefly_grows(tmp_path):
    """Files of tens of MB free a queue slot every few ms: no single wait is long, yet the run spends
    most of its time waiting. The writer counts the waits over an interval, not one at a time."""
    writer = BackgroundWriter(tmp_path, max_pending=1, format=(fmt := SlowFormat(0.01)), threads=1, max_threads=4)
    writer.GROW_INTERVAL = 0.05
    for index in range(120):
        writer.submit(index, b"states")
    writer.close()
    assert writer.stats.threads == 4 and fmt.most == 4


def test_a_starved_writer_doubles_its_threads(tmp_path):
    """One starved interval takes 2 threads to 4, not 3: a run of a few seconds (shared prefixes on
    the H200) ended before one thread per interval had reached what its disk needed."""
    writer = BackgroundWriter(tmp_path, max_pending=1, format=SlowFormat(0.05), threads=2, max_threads=8)
    writer.GROW_INTERVAL = 0.3
    index = 0
    while writer.stats.threads == 2 and index < 200:
        writer.submit(index, b"states")
        index += 1
    writer.close()
    assert writer.stats.threads == 4
