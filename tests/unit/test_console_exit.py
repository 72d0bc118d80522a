"""``hidden-states``' exit (``hidden_states.cli.console``): the interpreter's teardown is left out, and
nothing a normal exit does that anyone could notice is: the code, output still buffered, threads that
are not daemons, exit handlers. Run in a process of its own: the exit handlers are the process's."""
import subprocess
import sys

from tests.conftest import ROOT

PROGRAM = """
import atexit, sys, threading, time
from pathlib import Path
import hidden_states.cli as cli

def main(argv=None):
    def late():
        time.sleep(0.5)
        Path(sys.argv[1]).write_text("written")
    threading.Thread(target=late).start()  # not a daemon: a normal exit waits for it
    atexit.register(lambda: print("exit handler ran", file=sys.stderr))
    sys.stdout.write("no newline, still buffered")
    return 7

cli.main = main
cli.console()
"""


def test_the_exit_keeps_the_code_the_output_the_threads_and_the_exit_handlers(tmp_path):
    written = tmp_path / "late.txt"
    proc = subprocess.run([sys.executable, "-c", PROGRAM, str(written)], capture_output=True, text=True, cwd=ROOT,
                          timeout=60)
    assert proc.returncode == 7, proc.stderr
    assert proc.stdout == "no newline, still buffered"
    assert "exit handler ran" in proc.stderr
    assert written.read_text() == "written"


def test_the_module_entry_point_exits_with_mains_code(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "hidden_states", "status", str(tmp_path / "missing")],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert proc.stderr.strip().splitlines()[-1].startswith("hidden-states: "), proc.stderr
