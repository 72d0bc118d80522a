"""hidden_states.processes: a spawned child (as vLLM starts its workers) is out of the reach of a
signal to the extractor's process group, and dies within moments when the extractor is killed."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")

PARENT = """
import multiprocessing, signal, sys, time
from hidden_states.processes import contained

def child():
    time.sleep(120)

if __name__ == "__main__":
    signal.signal(signal.SIGINT, lambda *a: print("parent got SIGINT", flush=True))
    with contained():
        worker = multiprocessing.get_context("spawn").Process(target=child, daemon=True)
        worker.start()
    print(worker.pid, flush=True)
    time.sleep(120)
"""


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


@pytest.fixture
def parent(tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": ROOT})
    child = int(proc.stdout.readline())
    deadline = time.monotonic() + 10
    while os.getpgid(child) == os.getpgid(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.01)  # the child's first statement moves it; the parent printed its pid before that
    yield proc, child
    for pid in (proc.pid, child):
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
    proc.wait()


def test_a_signal_to_the_group_reaches_the_parent_only(parent):
    proc, child = parent
    assert os.getpgid(child) != os.getpgid(proc.pid)
    os.killpg(proc.pid, signal.SIGINT)
    assert proc.stdout.readline().strip() == "parent got SIGINT"
    time.sleep(0.5)
    assert alive(child)


def test_the_child_dies_with_its_parent(parent):
    proc, child = parent
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 5
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(child), "the spawned child outlived its killed parent"


def test_outside_the_block_children_are_left_as_they_are():
    import multiprocessing.util

    from hidden_states.processes import contained

    original = multiprocessing.util.spawnv_passfds
    with contained():
        assert multiprocessing.util.spawnv_passfds is not original
    assert multiprocessing.util.spawnv_passfds is original
