"""``hidden-states``' exit (``hidden_states.cli.console``): the interpreter's teardown is left out where
nothing is left for it to wait on, and nothing a normal exit does that anyone could notice is: the code,
output still buffered, exit handlers; a thread that is not a daemon gets the usual exit (an idle
concurrent.futures worker too, which only that exit tells to stop). Each run in a process of its own:
the exit handlers are the process's."""
import subprocess
import sys

from tests.conftest import ROOT

PROGRAM = """
import atexit, sys, threading, time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
import hidden_states.cli as cli

KEPT = []

def main(argv=None):
    what = sys.argv[2]
    if what == "thread":
        def late():
            time.sleep(0.5)
            Path(sys.argv[1]).write_text("written")
        threading.Thread(target=late).start()  # not a daemon: a normal exit waits for it
    elif what == "pool":  # an idle worker, never shut down: a normal exit tells it to stop
        KEPT.append(ThreadPoolExecutor(1))  # still referenced when main returns (a backend an error keeps)
        KEPT[0].submit(lambda: Path(sys.argv[1]).write_text("written")).result()
    else:
        Path(sys.argv[1]).write_text("written")
    atexit.register(lambda: print("exit handler ran", file=sys.stderr))
    sys.stdout.write("no newline, still buffered")
    return 7

cli.main = main
cli.console()
"""


def run(tmp_path, what: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-c", PROGRAM, str(tmp_path / "file.txt"), what], capture_output=True,
                          text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 7, proc.stderr
    assert proc.stdout == "no newline, still buffered"
    assert "exit handler ran" in proc.stderr
    assert (tmp_path / "file.txt").read_text() == "written"
    return proc


def test_the_fast_exit_keeps_the_code_the_output_and_the_exit_handlers(tmp_path):
    run(tmp_path, "nothing running")


def test_a_thread_that_is_not_a_daemon_gets_the_usual_exit(tmp_path):
    run(tmp_path, "thread")


def test_an_idle_pool_worker_does_not_hold_the_exit(tmp_path):
    """A run that ends on an error may leave an executor it never shut down: its idle worker waits for
    work that only the usual exit's stop signal ends (joined without it, the process never exited)."""
    run(tmp_path, "pool")


def test_the_module_entry_point_exits_with_mains_code(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "hidden_states", "status", str(tmp_path / "missing")],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert proc.stderr.strip().splitlines()[-1].startswith("hidden-states: "), proc.stderr
