"""vllm_compat.process_exit: a spawned process that asked for it ends as a forked one does, its exit
handlers run and its exit code kept, without the interpreter's teardown (the finalizer of an object
in a reference cycle, which the last collection would run, does not); one that did not ask, or set
VLLM_COMPAT_FINAL_GC=1, is torn down as always; any other sys.exit is Python's. The plugin asks only
in processes a parent started."""
import atexit
import gc
import multiprocessing
import os
import sys
from pathlib import Path

import pytest


class Cycle:
    def __init__(self, marker: str):
        self.marker, self.me = marker, self

    def __del__(self):
        Path(self.marker).write_text("collected")


def _child(folder: str, ask: bool, fail: bool) -> None:
    from vllm_compat.process_exit import end_without_teardown

    gc.disable()  # only the interpreter's last collection may free the cycle
    Cycle(os.path.join(folder, "collected"))
    atexit.register(Path(os.path.join(folder, "exit-handler")).write_text, "ran")
    if ask:
        end_without_teardown()
    if fail:
        raise RuntimeError("the target failed")


def run_child(tmp_path: Path, ask: bool, fail: bool = False) -> tuple[int, set[str]]:
    context = multiprocessing.get_context("spawn")
    child = context.Process(target=_child, args=(str(tmp_path), ask, fail))
    child.start()
    child.join(timeout=120)
    return child.exitcode, {p.name for p in tmp_path.iterdir()}


@pytest.fixture(autouse=True)
def teardown_not_kept(monkeypatch):
    monkeypatch.delenv("VLLM_COMPAT_FINAL_GC", raising=False)


def test_a_spawned_process_that_asked_ends_without_teardown_its_exit_handlers_run(tmp_path):
    assert run_child(tmp_path, ask=True) == (0, {"exit-handler"})


def test_its_exit_code_is_kept(tmp_path):
    assert run_child(tmp_path, ask=True, fail=True) == (1, {"exit-handler"})


def test_one_that_did_not_ask_is_torn_down_and_collects_the_cycle(tmp_path):
    assert run_child(tmp_path, ask=False) == (0, {"exit-handler", "collected"})


def test_the_variable_keeps_the_teardown(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_COMPAT_FINAL_GC", "1")
    assert run_child(tmp_path, ask=True) == (0, {"exit-handler", "collected"})


def test_any_other_sys_exit_is_pythons(monkeypatch):
    from vllm_compat.process_exit import end_without_teardown

    monkeypatch.setattr(sys, "exit", sys.exit)
    assert end_without_teardown()
    assert hasattr(sys.exit, "__wrapped__")
    with pytest.raises(SystemExit) as ended:
        sys.exit(3)  # called from here, not from multiprocessing's spawn_main
    assert ended.value.code == 3


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
