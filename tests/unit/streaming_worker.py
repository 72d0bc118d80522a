"""The capturing worker's streaming half (engine_capture.StreamingStates) set up without vLLM, and how
to read what it stored in a region: shared by the unit tests of the vllm-engine backend and of
``generate`` (support module)."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from hidden_states.backends.shared.regions import HEADER, layer_start, region_bytes

HIDDEN = 4
LAYERS = 2
WAIT = 120  # seconds for a batch of the fakes here (vLLM itself is imported before any wait: vllm_imported)


def worker(capture, regions, order, size=1 << 16):
    """A capturing worker after ``_hidden_states_stream_to``: its segment, regions, batch order."""
    extension = object.__new__(capture.StreamingStates)
    extension._hidden_states_host = torch.zeros(size, dtype=torch.uint8)
    extension._hidden_states_regions = {request: (*region, 0)[:3] for request, region in regions.items()}
    extension._hidden_states_step = None
    extension._hidden_states_prompts = {}
    extension._hidden_states_first = {}
    extension._hidden_states_ends = {}
    extension._hidden_states_copies = extension._hidden_states_done = None  # a CPU worker: copies done on return
    extension.model_runner = SimpleNamespace(input_batch=SimpleNamespace(req_ids=order))
    return extension


def rows_of(extension, capture, offset, length):
    """(rows stored, token ids stored, [layers, length, hidden]) of one region."""
    host, row_bytes = extension._hidden_states_host, HIDDEN * 4
    stored = int(host[offset:offset + 8].view(torch.int64)[0])
    ids = host[offset + HEADER:offset + HEADER + 4 * length].view(torch.int32).tolist()
    data = host[offset + layer_start(length, 0, row_bytes):offset + region_bytes(length, LAYERS, row_bytes)]
    return stored, ids, data.view(torch.float32).view(LAYERS, length, HIDDEN)


def token(request: int, position: int) -> int:
    return 100 * request + position
