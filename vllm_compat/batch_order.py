"""Worker side: which requests a forward pass holds, in the order of its rows.

Model Runner V1 keeps a persistent batch (``model_runner.input_batch.req_ids``) that is in forward
order while the model runs. Model Runner V2 (default for some architectures from vLLM 0.22, for
all from 0.29) has no ``input_batch`` attribute: it builds each step's batch in ``prepare_inputs``
(sorted: decodes first, then by token count) and keeps it in a local. The ``v2_batch_order``
adapter notes that batch's request ids here as ``prepare_inputs`` returns it.
"""
from __future__ import annotations

_v2 = {"req_ids": None}  # this process's last V2 batch, in row order


def remember_v2_batch(wrapped, runner, args, kwargs):
    batch = wrapped(*args, **kwargs)
    _v2["req_ids"] = list(batch.req_ids)
    return batch


def batch_order(model_runner) -> list[str]:
    """Request ids of the forward in flight, in row order, from whichever runner is active."""
    input_batch = getattr(model_runner, "input_batch", None)
    if input_batch is not None:
        return list(input_batch.req_ids)
    if _v2["req_ids"] is not None:
        return list(_v2["req_ids"])
    raise RuntimeError(f"vllm-compat: cannot read the batch order of {type(model_runner).__name__} "
                       f"(is the v2_batch_order adapter disabled?)")


def scheduled_in_row_order(model_runner, tokens: dict[str, int]) -> list[str]:
    """The requests of this forward (``tokens``: request id -> tokens scheduled this step) in the
    order their rows appear."""
    order = [rid for rid in batch_order(model_runner) if rid in tokens]
    if len(order) != len(tokens):
        raise RuntimeError(f"vllm-compat: the runner's batch {order} does not hold the scheduled "
                           f"requests {sorted(tokens)}")
    return order
