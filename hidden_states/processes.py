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
"""
from __future__ import annotations

import contextlib
import multiprocessing.util
import os
import sys
import threading

SPAWNED_CHILD = "--multiprocessing-fork"  # the last argument of every spawn-started child
PR_SET_PDEATHSIG = 1

# Runs first in the child. The parent may die between fork and prctl: then the child's parent is no
# longer the pid that started it, and it leaves at once.
_PROLOGUE = ("import ctypes, os, signal; os.setpgid(0, 0); "
             "ctypes.CDLL(None, use_errno=True).prctl({option}, int(signal.SIGKILL), 0, 0, 0); "
             "os.getppid() == {parent} or os._exit(1)\n")


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
    """Children spawned inside this block get their own process group and die with this process."""
    if not sys.platform.startswith("linux"):
        yield
        return
    original = multiprocessing.util.spawnv_passfds
    multiprocessing.util.spawnv_passfds = _contain(original)
    try:
        yield
    finally:
        multiprocessing.util.spawnv_passfds = original
