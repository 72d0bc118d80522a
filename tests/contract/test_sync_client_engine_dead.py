"""vLLM's own ``SyncMPClient.get_output`` and ``shutdown`` on a client whose engine core died: the
waiting caller raises ``EngineDeadError`` with the adapter, and waits forever without it. The client
is made without starting an engine (no model); everything it runs is vLLM's code. The whole run
(a killed engine core under ``--backend vllm-native``) is tests/e2e/test_backends.py's."""
import queue
import threading
import weakref

import pytest
import zmq

import vllm_compat
from tests.contract.base import AdapterContract

WAIT = 3.0


def client_of_dead_engine(engine_dead: bool = True):
    """A SyncMPClient as its monitor thread leaves it: the engine marked dead, the output thread
    gone (nothing will ever be put in the queue)."""
    from vllm.v1.engine.core_client import BackgroundResources, SyncMPClient

    client = object.__new__(SyncMPClient)
    client.resources = BackgroundResources(ctx=zmq.Context())
    client.resources.engine_dead = engine_dead
    client.outputs_queue = queue.Queue()
    client._finalizer = weakref.finalize(client, client.resources)
    return client


def wait_for_output(client) -> tuple[list, threading.Thread]:
    """get_output() on a thread, as LLM.generate calls it: what it raised ([] while it waits), and the thread."""
    raised = []

    def waiting():
        try:
            client.get_output()
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            raised.append(exc)

    thread = threading.Thread(target=waiting, daemon=True)  # left waiting when the drift shows
    thread.start()
    return raised, thread


class TestSyncClientEngineDead(AdapterContract):
    adapter_id = "sync_client_engine_dead"
    first_new = "0.11.0"
    not_observable_on_cpu = "vLLM's engine client, not the generator: tests/e2e/test_backends.py (vllm-native, a killed engine core)"

    def test_patched_call(self):
        from vllm.v1.engine.exceptions import EngineDeadError

        assert vllm_compat.apply()[self.adapter_id].status == "applied"
        client = client_of_dead_engine()
        raised, thread = wait_for_output(client)
        client.shutdown()
        thread.join(WAIT)
        assert not thread.is_alive(), "get_output() still waits after the dead engine's client shut down"
        assert len(raised) == 1 and isinstance(raised[0], EngineDeadError), raised

    def test_the_defect_is_still_there(self):
        """Negative proof on this release: without the adapter the caller waits on."""
        client = client_of_dead_engine()
        raised, thread = wait_for_output(client)
        client.shutdown()
        thread.join(WAIT)
        assert thread.is_alive() and not raised
        client.outputs_queue.put_nowait(RuntimeError("test over"))  # let the thread end

    def test_a_live_engine_shut_down_leaves_the_queue_alone(self):
        vllm_compat.apply()
        client = client_of_dead_engine(engine_dead=False)
        client.shutdown()
        with pytest.raises(queue.Empty):
            client.outputs_queue.get_nowait()
