"""hidden_states.processes: a spawned child (as vLLM starts its workers) is out of the reach of a
signal to the extractor's process group, and dies within moments when the extractor is killed."""
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT

# seconds for what takes milliseconds on an idle host: a bound only a wait that never ends reaches
WAIT = 120

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
    deadline = time.monotonic() + WAIT
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
    deadline = time.monotonic() + WAIT
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


def test_outside_the_block_process_starts_are_no_longer_recorded():
    import multiprocessing.process

    from hidden_states.processes import contained

    original = multiprocessing.process.BaseProcess.start
    with contained():
        assert multiprocessing.process.BaseProcess.start is not original
    assert multiprocessing.process.BaseProcess.start is original


def test_the_first_child_to_die_is_named_with_its_signal_though_others_end_after_it():
    """What vLLM does after one worker dies: it stops the others (here SIGTERM); the one that died
    first is the one named."""
    import multiprocessing

    from hidden_states.processes import contained

    spawn = multiprocessing.get_context("spawn")
    with contained() as children:
        helper = spawn.Process(target=time.sleep, args=(0,), name="Helper")  # ends well: not a death
        helper.start()
        helper.join()
        workers = [spawn.Process(target=time.sleep, args=(60,), name=f"Worker-{rank}") for rank in range(3)]
        for worker in workers:
            worker.start()
        assert children.first_exits(wait=0.2) == []  # running, or ended with code 0: nothing to name
        os.kill(workers[1].pid, signal.SIGKILL)
        killed = [("Worker-1", workers[1].pid, -signal.SIGKILL)]
        assert [(e.name, e.pid, e.exitcode) for e in children.first_exits(wait=WAIT)] == killed
        for worker in (workers[0], workers[2]):
            worker.terminate()
            worker.join()
        assert [(e.name, e.pid, e.exitcode) for e in children.first_exits()] == killed


def test_a_run_without_children_is_not_kept_waiting():
    from hidden_states.processes import contained

    with contained() as children:
        started = time.monotonic()
        assert children.first_exits(wait=WAIT) == []
    # the point is the bound: with no child to wait for, none of the WAIT s a child would get is spent;
    # half of it is a margin no busy host uses up
    assert time.monotonic() - started < WAIT / 2


@pytest.mark.parametrize("exitcode, says", [
    (-signal.SIGKILL, "vLLM's process VllmWorker-5 (pid 4242) was killed by SIGKILL: a SIGKILL nobody asked for is "
                      "most often the kernel's OOM killer, which ends the largest process when the host runs out of "
                      "memory (`dmesg` then shows 'Killed process 4242'): lower --batch-size or "
                      "--gpu-memory-utilization, or spread the model over more ranks with a larger --tp-size"),
    (-signal.SIGSEGV, "vLLM's process VllmWorker-5 (pid 4242) was killed by SIGSEGV: a crash in native code"),
    (-signal.SIGBUS, "was killed by SIGBUS: often shared memory (/dev/shm) running out"),
    (-signal.SIGABRT, "was killed by SIGABRT: an abort in native code"),
    (-signal.SIGTERM, "was killed by SIGTERM: another program asked it to stop"),
    (-signal.SIGUSR1, "vLLM's process VllmWorker-5 (pid 4242) was killed by SIGUSR1"),
    (-99, "vLLM's process VllmWorker-5 (pid 4242) was killed by signal 99"),
    (1, "vLLM's process VllmWorker-5 (pid 4242) exited with code 1 (its output above says why)"),
    (0, "vLLM's process VllmWorker-5 (pid 4242) exited with code 0 (its output above says why)"),
    (None, "vLLM's process VllmWorker-5 (pid 4242) ended (how is not known)"),
], ids=["SIGKILL", "SIGSEGV", "SIGBUS", "SIGABRT", "SIGTERM", "SIGUSR1", "signal-99", "code-1", "code-0", "unknown"])
def test_an_exit_says_how_the_process_ended_and_what_that_likely_means(exitcode, says):
    from hidden_states.processes import Exit

    explained = Exit("VllmWorker-5", 4242, exitcode).explain()
    assert explained.startswith(says) if says.startswith("vLLM") else says in explained, explained


def test_the_kernels_oom_kills_during_the_run_are_said():
    from hidden_states.processes import Exit

    killed = Exit("VllmWorker-1", 7, -signal.SIGKILL)
    assert "OOM kills" not in killed.explain(None) and "process(es)" not in killed.explain(None)
    assert killed.explain(2).endswith(". The kernel's OOM killer killed 2 process(es) on this host during the run")
    assert killed.explain(0).endswith(". The kernel's own count of OOM kills (oom_kill in /proc/vmstat) did not move "
                                      "during the run: another program may have sent it (a userspace OOM killer such "
                                      "as systemd-oomd or earlyoom, a scheduler, a person)")
    # the engine core of vllm.LLM exits with an error when a worker of its own was killed
    engine = Exit("EngineCore_DP0", 8, 1)
    assert engine.explain(0) == ("vLLM's process EngineCore_DP0 (pid 8) exited with code 1 (its output above says "
                                 "why; when one of its own workers died, vLLM's line 'Worker proc ... died "
                                 "unexpectedly' names it: with pipeline stages, VllmWorker-<rank> runs stage <rank> // --tp-size)")
    assert engine.explain(1).endswith(". The kernel's OOM killer killed 1 process(es) on this host during the run "
                                      "(`dmesg` names them; if one was vLLM's: lower --batch-size or "
                                      "--gpu-memory-utilization, or spread the model over more ranks with a larger "
                                      "--tp-size)")


def test_the_kernels_oom_kill_count_is_read():
    from hidden_states.processes import oom_kills

    if "oom_kill " not in Path("/proc/vmstat").read_text():
        pytest.skip("this kernel does not count OOM kills in /proc/vmstat (before Linux 4.13)")
    assert isinstance(oom_kills(), int)


def test_kill_ends_the_children_still_running_with_what_they_started():
    """A second Ctrl-C to ``serve``: vLLM's engine core and the workers it started (in its process
    group) are killed at once, and their end is not reported as a death (a SIGKILL nobody asked for)."""
    import multiprocessing

    from hidden_states.processes import contained

    spawn = multiprocessing.get_context("spawn")
    with contained() as children:
        ended = spawn.Process(target=time.sleep, args=(0,), name="Ended")
        ended.start()
        ended.join()
        core = spawn.Process(target=subprocess.call, args=([sys.executable, "-c", "import time; time.sleep(60)"],),
                             name="EngineCore")
        core.start()
        deadline = time.monotonic() + 20
        while not (grandchildren := Path(f"/proc/{core.pid}/task/{core.pid}/children").read_text().split()):
            assert time.monotonic() < deadline, "the child's own child did not start"
            time.sleep(0.05)
        assert children.kill() == [core.pid]
        # ended by the kill, not by the OOM killer: no death to report
        assert children.first_exits(wait=2) == []
        deadline = time.monotonic() + 10
        while alive(int(grandchildren[0])) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(int(grandchildren[0]))


def test_how_a_child_ended_is_known_though_its_owner_closed_it():
    """vLLM's client joins and closes its engine core's ``Process`` as it shuts down on its death:
    how it ended is read as it ends, not asked of the closed object later."""
    import multiprocessing

    from hidden_states.processes import contained

    spawn = multiprocessing.get_context("spawn")
    with contained() as children:
        core = spawn.Process(target=time.sleep, args=(60,), name="EngineCore")
        core.start()
        time.sleep(0.5)
        os.kill(core.pid, signal.SIGKILL)
        core.join()
        time.sleep(0.5)  # the watch has seen it end
        core.close()  # what vLLM's shutdown does
        assert [(e.name, e.exitcode) for e in children.first_exits(wait=5)] == [("EngineCore", -signal.SIGKILL)]


def test_a_dead_worker_of_a_pipeline_stage_is_named_with_its_stage():
    from types import SimpleNamespace

    from hidden_states.processes import Exit, stage_title

    def worker(rank, stages, tp):  # a worker's start arguments, as vLLM's executor passes them
        config = SimpleNamespace(parallel_config=SimpleNamespace(pipeline_parallel_size=stages, tensor_parallel_size=tp))
        return {"vllm_config": config, "rank": rank}

    assert stage_title(worker(3, 2, 2)) == "VLLM::Worker_PP1_TP1"
    assert stage_title(worker(1, 2, 1)) == "VLLM::Worker_PP1"  # one rank a stage: no TP in the title
    assert stage_title(worker(1, 1, 2)) is None  # no pipeline stages: the name says enough
    assert stage_title({}) is None and stage_title(None) is None  # not a worker
    explained = Exit("VllmWorker-3", 4242, -signal.SIGKILL, "VLLM::Worker_PP1_TP1").explain()
    assert explained.startswith("vLLM's process VllmWorker-3 (pid 4242, pipeline stage 1: VLLM::Worker_PP1_TP1) "
                                "was killed by SIGKILL"), explained


def _stage_worker(vllm_config=None, rank=0):
    os._exit(3)


def test_a_started_stage_worker_keeps_its_title_though_start_drops_its_arguments():
    """multiprocessing's start() deletes a process's kwargs: the title is read from them before."""
    from types import SimpleNamespace

    from hidden_states.processes import Children, _recorded

    config = SimpleNamespace(parallel_config=SimpleNamespace(pipeline_parallel_size=2, tensor_parallel_size=1))
    children = Children()
    start = _recorded(multiprocessing.process.BaseProcess.start, children)
    process = multiprocessing.get_context("fork").Process(target=_stage_worker, name="VllmWorker-1",
                                                          kwargs={"vllm_config": config, "rank": 1})
    try:
        start(process)
        process.join()
        assert [e.title for e in children.first_exits(wait=5)] == ["VLLM::Worker_PP1"]
    finally:
        children.close()


def test_the_stage_whose_worker_ended_first_is_found_below_a_process_not_ours():
    """Stage workers titled as vLLM titles them, children of another process (as under an engine core):
    the first to end is named with its stage, though the other ends after it."""
    from hidden_states.stage_exits import StageExits, said

    root = subprocess.Popen(["bash", "-c", "(exec -a VLLM::Worker_PP0 sleep 30) & (exec -a VLLM::Worker_PP1 sleep 30) "
                                           "& wait"])
    try:
        watch = StageExits(root.pid, 2)
        deadline = time.monotonic() + 20
        while not watch._fds_ready.is_set():
            assert time.monotonic() < deadline, "the workers were not found"
            time.sleep(0.05)
        workers = {title: pid for pid, title in watch.found.items()}
        assert sorted(workers) == ["VLLM::Worker_PP0", "VLLM::Worker_PP1"]
        assert said(watch) == ""
        os.kill(workers["VLLM::Worker_PP1"], signal.SIGKILL)
        while watch.first() is None:
            assert time.monotonic() < deadline, "no end seen"
            time.sleep(0.05)
        os.kill(workers["VLLM::Worker_PP0"], signal.SIGKILL)
        assert said(watch) == (f"; the first of its workers to end was pipeline stage 1's (VLLM::Worker_PP1, pid "
                               f"{workers['VLLM::Worker_PP1']}): that stage died first, the engine core stopped on it")
    finally:
        root.kill()
        root.wait()
