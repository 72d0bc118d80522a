"""``--backend vllm-engine``'s worker extension when speculators 0.3/0.4 is installed: speculators'
capture (``HiddenStatesWorkerExtension``: its patched base-model ``forward`` hands every step's
target-layer outputs to ``_store_captured_states``, kept right across vLLM releases by the shim's
adapters), streamed into the parent's regions by ``engine_capture.StreamingStates``.

Only vLLM's workers import this module (it is named to vLLM in ``worker_extension_cls``): it
imports speculators.
"""
from __future__ import annotations

from speculators.data_generation.custom_worker import HiddenStatesWorkerExtension

from .engine_capture import StreamingStates


class StreamingCapture(StreamingStates, HiddenStatesWorkerExtension):
    """speculators' capture, its rows streamed per step (``StreamingStates`` first: its
    ``_store_captured_states`` replaces speculators' accumulating one)."""
