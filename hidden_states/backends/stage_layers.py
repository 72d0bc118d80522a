"""``--backend vllm-engine`` under vLLM's pipeline parallelism (one host): what is refused before the
load, and the stages' setup replies merged into one layout.

Each stage's tensor-parallel rank 0 captures the run's layers its stage runs (vLLM's split:
``start_layer <= L < end_layer`` of its decoder stack, ``VLLM_PP_LAYER_PARTITION`` where set) and
stores them at their slots of the run's layers, with a counter block and a token-id array of its own
in every region (``shared/regions.py``). A stage that runs none of them captures nothing.
"""
from __future__ import annotations

import os

from vllm_compat.extractor_api import PRESENT, Exists

from ..errors import UsageError
from .engine_feed import present

# What the stages touch in vLLM (among vllm_engine's touch points): each stage's rank learns its stage;
# LLM(pipeline_parallel_size=..., distributed_executor_backend="ray") reaches EngineArgs (new_llm,
# executor_keywords)
STAGE_TOUCHPOINTS = [
    (Exists("vllm.distributed:get_pp_group"), frozenset({PRESENT})),
    *present("vllm.engine.arg_utils:EngineArgs", "pipeline_parallel_size", "distributed_executor_backend"),
]


def ray_stages(settings) -> bool:
    """Whether vLLM's Ray executor places the stages (``--pp-size`` with ``--ray-address``): a stage
    may then run on another host, and reaches the regions through the sink (``region_transport``)."""
    return settings.pp_size > 1 and bool(getattr(settings, "ray_address", None))


def executor_keywords(settings, ray=None) -> dict:
    """The ``LLM`` keywords of the stages' executor: with ``ray_stages``, Ray's, on the run's cluster
    (joined here first: vLLM's Ray executor uses the Ray this process initialized); else none
    (vLLM's multiprocessing executor, one host)."""
    if not ray_stages(settings):
        return {}
    join_ray(settings.ray_address, ray)
    return {"distributed_executor_backend": "ray"}


# what the stages' workers get of this process's environment (a remote node has its own otherwise)
FORWARDED_ENV = ("VLLM_", "HF_", "TRANSFORMERS_", "OMP_NUM_THREADS")


def join_ray(address: str, ray=None, environ=os.environ) -> None:
    """This process joins the Ray cluster at ``address`` (once), its ``FORWARDED_ENV`` variables
    handed to the processes Ray starts for it."""
    if ray is None:
        import ray
    if not ray.is_initialized():
        env = {name: value for name, value in environ.items() if name.startswith(FORWARDED_ENV)}
        ray.init(address=address, log_to_driver=True, runtime_env={"env_vars": env})


def refuse_pipeline(settings, capture_asked: str, speculators: str) -> None:
    """With ``pp_size`` > 1, what cannot run, refused before the load, one line each: speculators'
    capture (its patched forward stores nothing on a stage before the last), ``--cuda-graphs`` (its
    capture reads the token ids at the embedding, which only the first stage has), ``--state-dtype
    fp8`` (a row's scale is the largest value over all its layers, which no one stage holds)."""
    if settings.pp_size <= 1:
        return
    if capture_asked == speculators:
        raise UsageError(f"--pp-size {settings.pp_size}: speculators' capture stores nothing on a pipeline stage "
                         f"before the last; unset VLLM_COMPAT_ENGINE_CAPTURE or set it to own")
    if settings.cuda_graphs:
        raise UsageError(f"--cuda-graphs: not with --pp-size {settings.pp_size} (its capture reads the token ids at "
                         f"the embedding, which only the first pipeline stage runs)")
    if settings.state_dtype == "fp8":
        raise UsageError(f"--state-dtype fp8: not with --pp-size {settings.pp_size} (a row's scale is the largest "
                         f"value over all its layers, which no one pipeline stage holds)")


def merge_stage_replies(replies: list, layer_ids: list[int]) -> tuple[dict, list[int]]:
    """The capturing ranks' setup replies (one per pipeline stage; None from the other ranks) as one
    layout, and the stages that capture, in order (a region's counter blocks). Raises unless every
    layer of the run is captured by exactly one stage."""
    replies = sorted((reply for reply in replies if reply is not None), key=lambda reply: reply.get("stage", 0))
    if not replies:
        raise RuntimeError("hidden-states vllm-engine capture: no worker answered the capture's setup")
    by_layer: dict[int, list[int]] = {}
    for reply in replies:
        for layer in reply.get("layers", layer_ids):
            by_layer.setdefault(layer, []).append(reply.get("stage", 0))
    twice = {layer: stages for layer, stages in by_layer.items() if len(stages) > 1}
    if twice:
        raise RuntimeError("hidden-states vllm-engine capture: layers captured by more than one pipeline stage: "
                           + ", ".join(f"layer {layer} by stages {stages}" for layer, stages in sorted(twice.items())))
    missing = sorted(set(layer_ids) - set(by_layer))
    if missing:
        raise RuntimeError(f"hidden-states vllm-engine capture: no pipeline stage runs layers {missing} "
                           f"(the stages run {sorted(by_layer)})")
    capturing = [reply for reply in replies if reply.get("layers", layer_ids)]
    return capturing[0], [reply.get("stage", 0) for reply in capturing]
