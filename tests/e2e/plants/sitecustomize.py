"""Injected into an extractor subprocess (PYTHONPATH) to plant one capture bug, named by
HIDDEN_STATES_PLANT, of the kinds peers shipped unnoticed; the certificate must catch each, and the
same run without it must pass (tests/e2e/test_certificates.py). Every plant keeps the token ids the
capture stores right, so that the parent's own check of them passes and only the states are wrong:

* ``shift``: every state one position late (row i holds row i - 1's);
* ``swap``: two requests of a step exchange their states (their first rows, as many as the shorter has);
* ``stale``: every other request's states are not copied: its region keeps what its last owner left;
* ``prefix_offset``: rows vLLM's prefix cache gave a request are copied from one row too far;
* ``pre_residual``: the capture point moved before the residual add (the own capture's hooks keep the
  layer's output without its residual);
* ``decode_swap``: in a step that only decodes (one token per request: ``generate``'s replies), each
  request's row holds the next request's state; prefills (and so the sequence certified at load) are right.
"""
import os

import wrapt

PLANT = os.environ.get("HIDDEN_STATES_PLANT", "")


def _swap_two_requests(worker, aux):
    from vllm_compat.extractor_api import scheduled_in_row_order

    tokens, _ = worker._hidden_states_step
    order, row, spans = scheduled_in_row_order(worker.model_runner, tokens), 0, []
    for request_id in order:
        if request_id in worker._hidden_states_regions:
            spans.append((row, tokens[request_id]))
        row += tokens[request_id]
    if len(spans) < 2:
        return aux
    (a, na), (b, nb) = spans[:2]
    k = min(na, nb)
    swapped = []
    for layer in aux:
        layer = layer.clone()
        first, second = layer[a:a + k].clone(), layer[b:b + k].clone()
        layer[a:a + k], layer[b:b + k] = second, first
        swapped.append(layer)
    return swapped


def _store(wrapped, worker, args, kwargs):
    import torch

    aux = list(args[0])
    if worker._hidden_states_step is not None:
        if PLANT == "shift":
            aux = [torch.roll(layer, 1, dims=0) for layer in aux]
        elif PLANT == "swap":
            aux = _swap_two_requests(worker, aux)
        elif PLANT == "decode_swap" and len(tokens := worker._hidden_states_step[0]) > 1 and set(tokens.values()) == {1}:
            aux = [torch.roll(layer, 1, dims=0) for layer in aux]
    return wrapped(aux, *args[1:], **kwargs)


_copies = {"n": 0}


def _copy_rows(wrapped, worker, args, kwargs):
    import torch

    from hidden_states.backends.shared.regions import HEADER

    aux, scales, row, take, offset, length, start, row_bytes = args
    _copies["n"] += 1
    if _copies["n"] % 2:
        return wrapped(*args, **kwargs)
    first = offset + HEADER + 4 * start  # the ids only: the states stay what the region held
    worker._hidden_states_host[first:first + 4 * take].view(torch.int32).copy_(
        worker._hidden_states_input_ids[row:row + take])
    return None


def _copy_from_one_row_on(wrapped, backend, args, kwargs):
    import torch

    from hidden_states.backends.shared.regions import layer_start

    into, into_length, source, source_length, rows = args
    wrapped(*args, **kwargs)
    if rows + 1 > source_length:
        return
    size = rows * backend.row_bytes
    for index in range(len(backend.settings.layer_ids)):
        backend.pool.view(into + layer_start(into_length, index, backend.row_bytes, backend.scales), torch.uint8,
                          size).copy_(backend.pool.view(source + layer_start(source_length, index, backend.row_bytes,
                                                                             backend.scales) + backend.row_bytes,
                                                        torch.uint8, size))


def _without_residual(wrapped, instance, args, kwargs):
    output = args[0]
    return output[0] if isinstance(output, tuple) else output


# plant -> (the module, the function it wraps there, the wrapper)
PLANTS = {
    "shift": ("hidden_states.backends.worker.engine_capture", "StreamingStates._store_captured_states", _store),
    "swap": ("hidden_states.backends.worker.engine_capture", "StreamingStates._store_captured_states", _store),
    "decode_swap": ("hidden_states.backends.worker.engine_capture", "StreamingStates._store_captured_states", _store),
    "stale": ("hidden_states.backends.worker.engine_capture", "StreamingStates._copy_rows", _copy_rows),
    "prefix_offset": ("hidden_states.backends.vllm_engine", "VllmEngineBackend.copy_rows", _copy_from_one_row_on),
    "pre_residual": ("hidden_states.backends.worker.own_capture", "layer_output", _without_residual),
}

if PLANT:
    if PLANT not in PLANTS:
        raise SystemExit(f"HIDDEN_STATES_PLANT={PLANT!r}: no such plant (known: {', '.join(PLANTS)})")
    _module, _target, _wrapper = PLANTS[PLANT]
    wrapt.when_imported(_module)(lambda module: wrapt.wrap_function_wrapper(module, _target, _wrapper))
