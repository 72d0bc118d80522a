"""``vllm.LLM`` waits forever once its engine core process has died: wake it with the error.

Not a drift between releases but a defect of every one checked (0.11.0 through 0.33.0, read; run
on 0.16.0 to 0.32.0): the sync client's ``get_output()`` blocks on ``outputs_queue.get()``. When
the engine core dies (killed, e.g. by the kernel's OOM killer), the client's monitor thread marks
the engine dead and calls ``shutdown()``, which stops the thread that fills that queue, and nothing
is put in it: ``LLM.generate`` (``--backend vllm-native``) then hangs with no message. A process
that dies with an error is reported (the engine sends its error first); a killed one is not.

What it does: after ``SyncMPClient.shutdown()`` of a client whose engine is marked dead, puts
``EngineDeadError`` into its outputs queue, so a caller waiting in ``get_output()`` raises it
(vLLM's own error for a dead engine, ``_format_exception``) and the extractor names the process
that died (hidden_states/processes.py). A client shut down while its engine lives is untouched.

Scope: global (vLLM's own engine client; nothing changes until an engine has died). Disable:
``VLLM_COMPAT_DISABLE=sync_client_engine_dead``.
"""
from packaging.specifiers import SpecifierSet

from ..adapter import Adapter, Patch, Scope
from ..wrapping import function_wrapper

CLIENT = "vllm.v1.engine.core_client:SyncMPClient"


def wake_waiting_caller(wrapped, client, args, kwargs):
    # read before: the shutdown's own cleanup marks the engine dead too (0.16), a live one included
    died = client.resources.engine_dead
    try:
        return wrapped(*args, **kwargs)
    finally:
        if died:
            from vllm.v1.engine.exceptions import EngineDeadError

            client.outputs_queue.put_nowait(EngineDeadError())


ADAPTER = Adapter(
    id="sync_client_engine_dead",
    summary="wake vllm.LLM's wait for outputs with EngineDeadError when its engine core has died",
    drift="the sync engine client's get_output() blocks forever once a killed engine core shut it down",
    scope=Scope.GLOBAL,
    vllm=SpecifierSet(">=0.11.0"),
    patches=(Patch(f"{CLIENT}.shutdown", function_wrapper(wake_waiting_caller)),),
    verified_through="0.32.0",
    evidence="vllm/v1/engine/core_client.py (0.32.0): start_engine_core_monitor() -> shutdown() stops "
             "process_outputs_socket without a put; SyncMPClient.get_output() waits on outputs_queue.get()",
)
