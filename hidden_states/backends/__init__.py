"""Extraction backends behind one interface (:class:`Backend`), selected with ``--backend``."""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class BackendSettings:
    """What every backend needs to load the model and capture the layers."""

    model_path: str
    layer_ids: list[int]
    max_seq_len: int
    tp_size: int
    gpu_memory_utilization: float
    trust_remote_code: bool = False
    overlap: bool = True  # a backend that can may run the next batch's forward while this one's states are copied
    sequences_in_flight: int = 16  # most sequences whose states are submitted and not yet written (vllm-engine's pool)


class Backend(Protocol):
    """Loads a model once, then turns batches of token ids into per-layer hidden states.

    ``extract(batch)`` returns, for each sequence of ``batch`` in order, one ``[len, hidden]``
    tensor per requested layer (speculators' convention: layer ``L`` is the output of decoder
    layer ``L``, before the final norm).
    """

    name: str
    # Tokens the extraction keeps submitted beyond the batch whose states it waits for; a backend
    # without it gets one batch ahead. The engine backends set it at start: three engine steps.
    tokens_ahead: int
    # The most tokens one submit should hold (None: the whole batch). The engine backends set one
    # engine step's: the extraction submits a batch to them in groups of that size (submit_groups).
    tokens_per_submit: int | None

    def start(self) -> dict: ...  # loads the model; returns facts for data_config.json

    def extract(self, batch: list[list[int]]) -> list[list]: ...

    def submit(self, batch: list[list[int]]) -> Future: ...  # extract(batch), maybe running on while the caller goes on

    def check_forward(self, probe: list[int]) -> list: ...  # vllm_compat.forward_check on one sequence

    def close(self) -> None: ...


def completed(function, *args) -> Future:
    """A future already holding ``function(*args)``'s result or exception (a backend without overlap)."""
    future: Future = Future()
    try:
        future.set_result(function(*args))
    except Exception as exc:  # noqa: BLE001 - the future carries it to whoever asks for the result
        future.set_exception(exc)
    return future


class OneBatchAtATime:
    """``submit`` for a backend whose ``extract`` runs a batch start to end before it returns."""

    def submit(self, batch: list[list[int]]) -> Future:
        return completed(self.extract, batch)


def create(name: str, settings: BackendSettings) -> Backend:
    if name == "speculators":
        from .speculators_generator import SpeculatorsBackend

        return SpeculatorsBackend(settings)
    if name == "vllm-native":
        from .vllm_native import VllmNativeBackend

        return VllmNativeBackend(settings)
    if name == "vllm-engine":
        from .vllm_engine import VllmEngineBackend

        return VllmEngineBackend(settings)
    raise ValueError(f"unknown backend {name!r}")


BACKENDS = ("speculators", "vllm-native", "vllm-engine")
