"""vLLM's worker processes, tied to the extractor: out of the terminal's reach, dead with their parent.

vLLM starts its workers (and, for ``vllm.LLM``, its engine core) with multiprocessing's ``spawn``:
a fresh interpreter running ``-c "from multiprocessing.spawn import spawn_main; ..."``. Two things
go wrong with them as they are:

* they share the extractor's process group, so a Ctrl-C in a terminal (sent to the whole
  foreground group) or a group-wide SIGTERM (``timeout``) reaches them too; vLLM's own handler then
  ends them mid-batch and the extractor, instead of finishing its batch, dies on "cancelled";
* when the extractor is killed (``kill -9``, the OOM killer) they live on as orphans for tens of
  seconds, holding memory and a shared-memory segment.

While :func:`contained` is active, every such child first moves into a process group of its own
and asks the kernel for SIGKILL when its parent dies (``prctl(PR_SET_PDEATHSIG)``), before running
vLLM's code. The extractor alone then receives the signal and shuts vLLM down in order; and when it
dies, its workers die with it, and multiprocessing's resource tracker (which ignores SIGINT/SIGTERM
and is left as it is) removes their shared-memory segments. Linux only; elsewhere nothing changes.

The block also records the processes started in it (:class:`Children`) and the order in which they
end: when vLLM fails because one of them died (the kernel's OOM killer SIGKILLs a worker, a kernel
crashes one), vLLM's own error says little ("cancelled", "EngineCore encountered an issue"), and
:meth:`Children.first_exits` says which process it was and how it ended.
"""
from __future__ import annotations

import contextlib
import multiprocessing.connection
import multiprocessing.process
import multiprocessing.util
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

SPAWNED_CHILD = "--multiprocessing-fork"  # the last argument of every spawn-started child
PR_SET_PDEATHSIG = 1

# Runs first in the child. The parent may die between fork and prctl: then the child's parent is no
# longer the pid that started it, and it leaves at once.
_PROLOGUE = ("import ctypes, os, signal; os.setpgid(0, 0); "
             "ctypes.CDLL(None, use_errno=True).prctl({option}, int(signal.SIGKILL), 0, 0, 0); "
             "os.getppid() == {parent} or os._exit(1)\n")


# How long a failed run (or a server whose engine stopped) waits for one of vLLM's processes to exit
# before it shuts vLLM down: the engine core of ``vllm.LLM`` reports its death to this process before it exits.
EXIT_WAIT = 5.0


def _contain(spawnv_passfds):
    def spawn(path, args, passfds):
        # PR_SET_PDEATHSIG fires when the *thread* that started the child ends: only children started
        # from the main thread (which lives as long as the process) are tied to it.
        on_main_thread = threading.current_thread() is threading.main_thread()
        if args and args[-1] == SPAWNED_CHILD and "-c" in args and on_main_thread:
            args = list(args)
            code = args.index("-c") + 1
            args[code] = _PROLOGUE.format(option=PR_SET_PDEATHSIG, parent=os.getpid()) + args[code]
        return spawnv_passfds(path, args, passfds)

    spawn.__wrapped__ = spawnv_passfds
    return spawn


@contextlib.contextmanager
def contained():
    """Children spawned inside this block get their own process group and die with this process.

    Yields the :class:`Children` started in the block (recorded on Linux; elsewhere none)."""
    children = Children()
    if not sys.platform.startswith("linux"):
        try:
            yield children
        finally:
            children.close()
        return
    spawn, start = multiprocessing.util.spawnv_passfds, multiprocessing.process.BaseProcess.start
    multiprocessing.util.spawnv_passfds = _contain(spawn)
    multiprocessing.process.BaseProcess.start = _recorded(start, children)
    try:
        yield children
    finally:
        multiprocessing.util.spawnv_passfds = spawn
        multiprocessing.process.BaseProcess.start = start
        children.close()


def _recorded(start, children: Children):
    def recorded_start(process):
        kwargs = getattr(process, "_kwargs", None)  # start() deletes it
        start(process)
        children.watch(process, kwargs)

    recorded_start.__wrapped__ = start
    return recorded_start


LESS_MEMORY = ("lower --batch-size or --gpu-memory-utilization, or spread the model over more ranks with a larger "
               "--tp-size")
# What a signal that the extractor did not send most likely means, and what to do about it.
SIGNAL_CAUSES = {
    signal.SIGKILL: "a SIGKILL nobody asked for is most often the kernel's OOM killer, which ends the largest "
                    "process when the host runs out of memory (`dmesg` then shows 'Killed process {pid}'): "
                    + LESS_MEMORY,
    signal.SIGSEGV: "a crash in native code (a kernel or library vLLM runs; its output above may show where)",
    signal.SIGBUS: "often shared memory (/dev/shm) running out: vLLM passes batches through it, and a "
                   "container's is small unless enlarged (docker --shm-size)",
    signal.SIGABRT: "an abort in native code (a failed check in a kernel or library; its output above shows "
                    "the message)",
    signal.SIGTERM: "another program asked it to stop (the extractor's own Ctrl-C and SIGTERM do not reach "
                    "vLLM's processes; a scheduler that signals every process of a job, such as SLURM, does)",
}
# vLLM's engine core (``vllm.LLM``) exits with an error when one of its own workers dies; only it
# learns how that worker ended, and says so in its log.
ENGINE_CORE = "EngineCore"


def oom_kills() -> int | None:
    """The kernel's count of processes its OOM killer has killed since boot (``oom_kill`` in
    /proc/vmstat, Linux 4.13+; host-wide, cgroup limits included), or None where it cannot be read."""
    try:
        for line in Path("/proc/vmstat").read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == "oom_kill":
                return int(value)
    except (OSError, ValueError):
        pass
    return None


def oom_kills_since(before: int | None) -> int | None:
    """Processes the kernel's OOM killer killed since :func:`oom_kills` gave ``before``; None where
    either count is unknown."""
    now = oom_kills()
    return None if now is None or before is None else now - before


@dataclass(frozen=True)
class Exit:
    """How one child process ended.

    Attributes:
        name: its multiprocessing name (vLLM's ``VllmWorker-<rank>``, ``EngineCore_DP<n>``).
        pid: its process id.
        exitcode: multiprocessing's: the exit code, or ``-N`` when signal N killed it; None when
            its status could not be learned.
        title: a worker of one of vLLM's pipeline stages: its process title, which names its stage
            (``VLLM::Worker_PP<stage>_TP<rank>``); None otherwise.
    """

    name: str
    pid: int
    exitcode: int | None
    title: str | None = None

    def how(self) -> str:
        if self.exitcode is None:
            return "ended (how is not known)"
        if self.exitcode < 0:
            return f"was killed by {_signal_name(-self.exitcode)}"
        return f"exited with code {self.exitcode}"

    def explain(self, oom_kills: int | None = None) -> str:
        """One sentence: which process, how it ended and what that most likely means.

        Args:
            oom_kills: processes the kernel's OOM killer killed during the run
                (:meth:`Children.oom_kills`); None when not known.
        """
        stage = f", pipeline stage {self.title.split('_PP')[1].split('_')[0]}: {self.title}" if self.title else ""
        text = f"vLLM's process {self.name} (pid {self.pid}{stage}) {self.how()}"
        killed_by = -self.exitcode if self.exitcode is not None and self.exitcode < 0 else None
        if self.exitcode is not None and self.exitcode >= 0:
            text += " (its output above says why" + (
                "; when one of its own workers died, vLLM's line 'Worker proc ... died unexpectedly' names it: "
                "with pipeline stages, VllmWorker-<rank> runs stage <rank> // --tp-size)"
                if self.name.startswith(ENGINE_CORE) else ")")
        elif killed_by in SIGNAL_CAUSES:
            text += ": " + SIGNAL_CAUSES[killed_by].format(pid=self.pid)
        if oom_kills:
            text += f". The kernel's OOM killer killed {oom_kills} process(es) on this host during the run"
            if killed_by != signal.SIGKILL:
                text += f" (`dmesg` names them; if one was vLLM's: {LESS_MEMORY})"
        elif oom_kills == 0 and killed_by == signal.SIGKILL:
            text += (". The kernel's own count of OOM kills (oom_kill in /proc/vmstat) did not move during the run: "
                     "another program may have sent it (a userspace OOM killer such as systemd-oomd or earlyoom, "
                     "a scheduler, a person)")
        return text


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def pipeline_of(kwargs: dict | None) -> tuple[int, int]:
    """(pipeline stages, ranks per stage) of the vLLM configuration among a process's start arguments
    (``kwargs``: its target's; an engine core's or a worker's); (1, 1) where they hold none."""
    parallel = getattr((kwargs if isinstance(kwargs, dict) else {}).get("vllm_config"), "parallel_config", None)
    stages, tp = getattr(parallel, "pipeline_parallel_size", 1), getattr(parallel, "tensor_parallel_size", 1)
    return (stages, tp) if isinstance(stages, int) and isinstance(tp, int) else (1, 1)


def stage_title(kwargs: dict | None) -> str | None:
    """The process title vLLM gives a worker of one of its pipeline stages (``VLLM::Worker_PP<stage>``, with
    ``_TP<rank>`` after it when the stage has more than one rank: ``multiproc_executor.py``'s ``WorkerProc``
    on 0.17.0, set in the worker once it runs; its logs' prefix too), found from the arguments it was
    started with (``kwargs``, read before ``start`` drops them: its configuration and global rank =
    stage * TP size + TP rank); None for any other process, and without pipeline stages."""
    stages, tp = pipeline_of(kwargs)
    rank = (kwargs or {}).get("rank")
    if stages <= 1 or not isinstance(rank, int):
        return None
    return f"VLLM::Worker_PP{rank // tp}" + (f"_TP{rank % tp}" if tp > 1 else "")


class Children:
    """The processes started while :func:`contained` is active, and the order in which they end.

    A thread waits on each child's sentinel (a pipe multiprocessing gives every child, which closes
    when it exits; this watches a duplicate of it, so the owner may close its own), so the first
    to end is known even after vLLM has stopped the others in turn. The exit status comes from
    multiprocessing itself (``Process.exitcode``); nothing here reaps a child of its own accord.
    """

    def __init__(self):
        self._oom_kills_before = oom_kills()
        self._changed = threading.Condition()
        self._watched: dict[int, multiprocessing.process.BaseProcess] = {}  # our sentinel duplicate -> process
        self._ended: list[list[multiprocessing.process.BaseProcess]] = []  # in order; each: seen ending together
        # each process's pid and multiprocessing's handle on it: its owner may close the Process
        # (vLLM's client does, as it shuts down on its engine core's death), which then says nothing
        self._pids: dict[multiprocessing.process.BaseProcess, int] = {}
        self._titles: dict[multiprocessing.process.BaseProcess, str | None] = {}  # a stage worker's process title
        self._popens: dict[multiprocessing.process.BaseProcess, object] = {}
        self._wake_read, self._wake_write = os.pipe()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._killed: set[int] = set()  # pids :meth:`kill` sent SIGKILL: their end is no failure to report
        self.stages = None  # stage_exits.StageExits: the pipeline stages' workers below vLLM's engine core

    def watch(self, process, kwargs: dict | None = None) -> None:
        """Record ``process`` (started) and watch for its end (an engine core running pipeline stages: its
        stages' workers too, :mod:`stage_exits`; ``kwargs``: its target's, which ``start`` drops)."""
        with self._changed:
            if self._closed:
                return
            stages, tp = pipeline_of(kwargs)
            if process.name.startswith(ENGINE_CORE) and stages > 1:
                from .stage_exits import StageExits  # only with stages: serve's wing imports it not otherwise

                self.stages = StageExits(process.pid, stages * tp)
            self._watched[os.dup(process.sentinel)] = process
            self._pids[process] = process.pid
            self._titles[process] = stage_title(kwargs)
            self._popens[process] = getattr(process, "_popen", None)
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name="hidden-states-children", daemon=True)
                self._thread.start()
        os.write(self._wake_write, b".")

    def _watch(self) -> None:
        while True:
            with self._changed:
                if self._closed:
                    return
                sentinels = list(self._watched)
            ready = multiprocessing.connection.wait([*sentinels, self._wake_read])
            if self._wake_read in ready:
                os.read(self._wake_read, 4096)
            ended = [fd for fd in ready if fd != self._wake_read]
            if ended:
                with self._changed:
                    self._ended.append([self._watched.pop(fd) for fd in ended])
                    self._changed.notify_all()
                for fd in ended:
                    os.close(fd)

    def first_exits(self, wait: float = 0.0) -> list[Exit]:
        """The child(ren) that first ended in error (killed by a signal, or a non-zero exit code), with
        how each ended; [] when none has. One that exited with code 0 did its job; one that :meth:`kill`
        ended was asked to (not the OOM killer's SIGKILL, which it would read as). ``wait``: seconds to
        wait for one to end in error when none has and some run (a failure learned before its exit)."""
        deadline = time.monotonic() + wait
        checked = 0
        while True:
            with self._changed:
                self._changed.wait_for(lambda: len(self._ended) > checked or not self._watched,
                                       timeout=max(0.0, deadline - time.monotonic()))
                groups, running = self._ended[checked:], bool(self._watched)
            for group in groups:
                failed = [e for e in (Exit(p.name, self._pids[p], self._exitcode(p), self._titles.get(p)) for p in group)
                          if e.exitcode != 0 and not (e.pid in self._killed and e.exitcode == -signal.SIGKILL)]
                if failed:
                    return failed
            checked += len(groups)
            if not running or time.monotonic() >= deadline:
                return []

    def kill(self) -> list[int]:
        """SIGKILL every recorded child still running, with its process group (a contained child leads
        its own, which holds the processes it started: vLLM's workers); returns their pids."""
        with self._changed:
            alive = [self._pids[process] for process in self._watched.values()]
            self._killed.update(alive)
        for pid in alive:
            try:
                if os.getpgid(pid) == pid:
                    os.killpg(pid, signal.SIGKILL)
                else:
                    os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):  # ended meanwhile
                pass
        deadline = time.monotonic() + 5  # until each has ended (not reaped: its owner reaps it), so that
        for pid in alive:  # what runs next (vLLM's shutdown) finds the engine dead, not dying
            while running(pid) and time.monotonic() < deadline:
                time.sleep(0.01)
        return alive

    def _exitcode(self, process) -> int | None:
        code = _exitcode(process)
        popen = self._popens.get(process)
        if code is None and popen is not None:  # closed by its owner, who reaped it first
            try:
                code = popen.wait(0)
            except (OSError, ValueError):
                pass
        return code

    def oom_kills(self) -> int | None:
        """Processes the kernel's OOM killer killed on this host since these children were first
        recorded; None where its count cannot be read."""
        return oom_kills_since(self._oom_kills_before)

    def close(self) -> None:
        """Stop watching (the processes themselves are left as they are)."""
        with self._changed:
            self._closed = True
        os.write(self._wake_write, b".")
        if self._thread is not None:
            self._thread.join()
        for fd in (*self._watched, self._wake_read, self._wake_write):
            os.close(fd)
        self._watched.clear()


def death(children: Children, then: str, wait: float = EXIT_WAIT) -> ProcessDied | None:
    """The error that names the process(es) of ``children`` that first died, how, and the likely
    cause, followed by ``then`` (what stopped on it, what to do); None when none has died within
    ``wait`` seconds (vLLM's own error may come before its process ends). ``extract``, ``generate``
    and ``serve`` say a death the same way."""
    exits = children.first_exits(wait=wait)
    if not exits:
        return None
    stage = ""
    if getattr(children, "stages", None) is not None and any(e.name.startswith(ENGINE_CORE) for e in exits):
        from .stage_exits import said

        stage = said(children.stages)
    return ProcessDied("; ".join(e.explain(children.oom_kills()) for e in exits) + stage + then, exits)


def running(pid: int) -> bool:
    """Whether the child ``pid`` has not yet ended, asked of the kernel without reaping it: a child
    another waiter reaped first is not running, though multiprocessing, which then never learns its
    exit, keeps saying ``is_alive()``."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT | os.WNOHANG) is None
    except (OSError, AttributeError):  # reaped already; no waitid here
        return False


def _exitcode(process, timeout: float = 5.0) -> int | None:
    """How ``process`` ended, from multiprocessing: its sentinel closes a moment before the kernel
    can report the exit, so this waits (``join``) for multiprocessing to learn it."""
    try:
        process.join(timeout)
        return process.exitcode
    except (ValueError, AssertionError):  # closed by its owner, or not this process's child
        return None


class ProcessDied(RuntimeError):
    """vLLM failed because one of its processes died; names it, how it ended and the likely cause.

    Attributes:
        exits: the process(es) that ended first (:class:`Exit`).
    """

    def __init__(self, message: str, exits: list[Exit]):
        super().__init__(message)
        self.exits = exits
