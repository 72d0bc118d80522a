"""vLLM 0.32.0's engine shutdown fails when a process it is killing exits on its own first.

A defect of one release: 0.32.0's ``kill_process_tree`` (``vllm/utils/system_utils.py:207``) lists a
process's children, then names each one in a log line (``child.name()``) inside a
``suppress(ProcessLookupError)``. A child that exits between the listing and the naming makes psutil
raise ``NoSuchProcess``, which that block does not catch: the shutdown of ``vllm.LLM``'s engine core
(``--backend vllm-native``, after the engine outlived its shutdown timeout) ends with that error, the
children after it and the engine core itself are left running, and an extraction whose files were
all written exits 1. Seen in CI: the TP=8 rehearsal, whose eight workers exit while the engine core
is being killed. 0.31.0 did not name children; 0.33.0 suppresses ``psutil.NoSuchProcess`` too.

What it does: calls vLLM's own ``kill_process_tree`` again when it raises ``NoSuchProcess``. Each
call lists the tree afresh, so the child that is gone is not named again; a parent that is gone
ends the call, as vLLM intends. At most ``ATTEMPTS`` calls, then the error is vLLM's own.

Scope: global (a process that has already exited is what any caller of a kill wants). Patched where
vLLM defines the function and in ``vllm.v1.utils``, which imports it by value and runs the engine
cores' shutdown. Disable: ``VLLM_COMPAT_DISABLE=process_tree_kill_race``.
"""
from packaging.specifiers import SpecifierSet

from ..adapter import Adapter, Patch, Scope
from ..wrapping import function_wrapper

ATTEMPTS = 16  # each failed call means one more process of the tree has exited


def kill_again_when_one_exited(wrapped, instance, args, kwargs):
    import psutil

    for _ in range(ATTEMPTS - 1):
        try:
            return wrapped(*args, **kwargs)
        except psutil.NoSuchProcess:
            continue  # listed, then gone before vLLM named it: the next listing leaves it out
    return wrapped(*args, **kwargs)


ADAPTER = Adapter(
    id="process_tree_kill_race",
    summary="finish vLLM's kill of a process tree when one of its processes exits first",
    drift="0.32.0's kill_process_tree names each child outside a NoSuchProcess guard (0.33.0 guards it)",
    scope=Scope.GLOBAL,
    vllm=SpecifierSet(">=0.32.0,<0.33.0"),
    patches=(
        Patch("vllm.utils.system_utils:kill_process_tree", function_wrapper(kill_again_when_one_exited)),
        Patch("vllm.v1.utils:kill_process_tree", function_wrapper(kill_again_when_one_exited)),
    ),
    verified_through="0.32.0",
    evidence="vllm/utils/system_utils.py:207 (0.32.0): child.name() under suppress(ProcessLookupError) only; "
             "0.31.0 :206 names no child; 0.33.0 :230 suppress(ProcessLookupError, psutil.NoSuchProcess)",
)
