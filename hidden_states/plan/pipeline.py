"""Pipeline parallelism as planned before the load: which decoder layers each stage holds, as vLLM
splits them, and which stage captures each of the run's layers.

vLLM splits ``num_hidden_layers`` into ``pp_size`` contiguous stages in ``get_pp_indices``
(``vllm/distributed/utils.py``; the same rule in 0.17, 0.32 and 0.34): ``VLLM_PP_LAYER_PARTITION``
(``"a,b,..."``, one whole number of layers per stage, adding up to the model's layers) when set, else
``num_layers // pp_size`` each, the remainder given one layer apiece to the stages before the last,
from the one before the last backwards (the last stage holds the final norm and LM head; the first
the embedding). :func:`pp_partition` is that rule, written here so that the plan knows it without
importing vLLM; ``tests/contract/test_pipeline_partition.py`` holds it to the installed vLLM's.
"""
from __future__ import annotations

import os
from collections.abc import Mapping

from ..errors import UsageError

PARTITION_ENV = "VLLM_PP_LAYER_PARTITION"


def pp_partition(num_layers: int, pp_size: int, environ: Mapping[str, str] = os.environ) -> list[tuple[int, int]]:
    """Each stage's decoder layers, ``(start, end)`` (end excluded), as vLLM assigns them. A
    ``VLLM_PP_LAYER_PARTITION`` vLLM would refuse is refused here, naming the variable."""
    chosen = environ.get(PARTITION_ENV)
    if chosen is not None:
        try:
            counts = [int(part) for part in chosen.split(",")]
        except ValueError:
            raise UsageError(f"{PARTITION_ENV}={chosen!r}: not a comma-separated list of whole numbers of "
                             f"layers (vLLM refuses it: 'Invalid partition string')") from None
        if len(counts) != pp_size:
            raise UsageError(f"{PARTITION_ENV}={chosen!r}: {len(counts)} stages, but --pp-size {pp_size} "
                             f"(vLLM refuses it: the count must match pp_size)")
        if sum(counts) != num_layers:
            raise UsageError(f"{PARTITION_ENV}={chosen!r}: {sum(counts)} layers, but the model has {num_layers} "
                             f"(vLLM refuses it: the sum must match num_hidden_layers)")
        if any(count < 0 for count in counts):
            raise UsageError(f"{PARTITION_ENV}={chosen!r}: a negative number of layers (vLLM 0.34 refuses it)")
    else:
        counts = [num_layers // pp_size] * pp_size
        for k in range(2, num_layers % pp_size + 2):
            counts[-k] += 1
    stages, start = [], 0
    for count in counts:
        stages.append((start, start + count))
        start += count
    return stages


def check_pipeline_parallel(num_layers: int, pp_size: int, environ: Mapping[str, str] = os.environ
                            ) -> list[tuple[int, int]]:
    """``--pp-size`` against the model: at least one layer per stage (unless ``VLLM_PP_LAYER_PARTITION``
    chose otherwise), and a partition vLLM accepts. Returns the stages."""
    if pp_size < 1:
        raise UsageError(f"--pp-size {pp_size}: must be at least 1")
    if pp_size > num_layers:
        raise UsageError(f"--pp-size {pp_size}: more stages than the model's {num_layers} decoder layers")
    return pp_partition(num_layers, pp_size, environ)


def stage_of(layer: int, stages: list[tuple[int, int]]) -> int:
    """The stage whose layers hold ``layer``."""
    for k, (start, end) in enumerate(stages):
        if start <= layer < end:
            return k
    raise ValueError(f"layer {layer} is in no stage of {stages}")


def _span(start: int, end: int) -> str:
    return "none" if end <= start else f"{start}" if end - start == 1 else f"{start}-{end - 1}"


def pipeline_line(stages: list[tuple[int, int]], layer_ids) -> str:
    """The plan's line: the stages' layers and which stage captures each of ``layer_ids`` (the
    extractor's count), the last one named (it holds the LM head: the certificates' logprobs)."""
    ids = sorted(set(layer_ids))
    held = []
    for k, stage in enumerate(stages):
        mine = [str(layer) for layer in ids if stage[0] <= layer < stage[1]]
        if mine:
            held.append(f"{' '.join(mine)} on stage {k}")
    last = len(stages) - 1
    spans = [_span(*stage) for stage in stages]
    return (f"pipeline: {len(stages)} stages, layers {', '.join(spans[:-1])} and {spans[-1]}; captured "
            f"{', '.join(held) or 'none'} (stage {last} is the last: LM head, certificates)")


def gpus_here(environ: Mapping[str, str] = os.environ) -> int | None:
    """The GPUs vLLM may use on this host, asked without a CUDA context: ``CUDA_VISIBLE_DEVICES`` when
    set, else NVML's count; None when neither tells."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([device for device in visible.split(",") if device.strip()])
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetCount())
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - advisory: vLLM says it at the load
        return None


def check_one_host(tp_size: int, pp_size: int, gpus: int | None) -> str | None:
    """Every stage runs on this host (vLLM's multiprocessing executor, no ``--ray-address``):
    ``tp_size * pp_size`` GPUs here, else refused before the load (stages over a Ray cluster:
    ``ray_stages``). Returns the plan's line, or None where the GPUs are not known."""
    if gpus is None:
        return None
    needed = tp_size * pp_size
    if needed > gpus:
        raise UsageError(f"--pp-size {pp_size}: --tp-size {tp_size} x --pp-size {pp_size} needs {needed} GPUs on "
                         f"this host, which has {gpus}; stages on other hosts: --ray-address (vLLM's Ray executor)")
    return f"GPUs: {needed} of this host's {gpus} (--tp-size {tp_size} x --pp-size {pp_size})"
