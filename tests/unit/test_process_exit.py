"""vllm_compat.process_exit: a process that registered it ends without the interpreter's last
collection (the finalizer of an object in a reference cycle does not run), one that did not, or that
set VLLM_COMPAT_FINAL_GC=1, runs it; the plugin registers it only in processes a parent started."""
import multiprocessing
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

CHILD = """
import sys
from vllm_compat import process_exit

class Cycle:
    def __del__(self):
        open(sys.argv[1], "w").write("collected")

held = Cycle()
held.self = held  # only a collection frees it
del held
if sys.argv[2] == "skip":
    print(process_exit.skip_final_collection())
"""


@pytest.mark.parametrize("mode, keep, collected", [("skip", None, False), ("skip", "1", True), ("none", None, True)],
                         ids=["skipped", "kept-by-env", "not-registered"])
def test_the_last_collection_runs_unless_skipped(tmp_path, mode, keep, collected):
    marker = tmp_path / "marker"
    env = {**os.environ, "PYTHONPATH": ROOT}
    env.pop("VLLM_COMPAT_FINAL_GC", None)
    if keep:
        env["VLLM_COMPAT_FINAL_GC"] = keep
    proc = subprocess.run([sys.executable, "-c", CHILD, str(marker), mode], env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert marker.exists() is collected, proc.stdout


def _is_started(queue):
    from vllm_compat.process_exit import started_by_vllm

    queue.put(started_by_vllm())


def test_only_a_process_a_parent_started_counts_as_vllms():
    from vllm_compat.process_exit import started_by_vllm

    assert not started_by_vllm()
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=_is_started, args=(queue,))
    child.start()
    assert queue.get(timeout=60) is True
    child.join(timeout=60)
