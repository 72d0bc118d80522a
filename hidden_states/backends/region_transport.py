"""How ``--backend vllm-engine``'s capturing stages reach this process's region pool: the file, mapped,
on this host; a region sink (``shared/region_sink``) for stages that cannot map it (vLLM's Ray
executor may place a stage on another host; ``VLLM_COMPAT_REGION_SINK=always`` forces the sink on
one host). What the workers get (``transport``) says how to tell the pool is theirs to map (this
process's Ray node id and the nonce in the file's first bytes) and where the sink is, with the run's
secret that a stage proves to it."""
from __future__ import annotations

import os
import secrets

from .shared.region_sink import NONCE, RegionSink, forced, ray_node_id


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE)


def stage_slots(replies: list, layer_ids: list[int], stages: list[int]) -> dict[int, list[int]]:
    """Capturing block -> the slots (among the run's sorted layers) its stage stores."""
    wanted = sorted(set(layer_ids))
    by_stage = {reply.get("stage", 0): reply.get("layers", wanted) for reply in replies if reply is not None}
    return {block: [wanted.index(layer) for layer in by_stage[stage]] for block, stage in enumerate(stages)}


def sink_host() -> str:
    """Where the sink listens: this process's Ray node's address (the one the stages' nodes reach it
    by) where Ray runs, else loopback (every stage is on this host)."""
    if ray_node_id() is None:
        return "127.0.0.1"
    import ray

    return ray.util.get_node_ip_address()


def open_transport(pool, slots: dict[int, list[int]], row_bytes: int, scales: bool, on_ray: bool,
                   environ=os.environ) -> tuple[RegionSink | None, dict]:
    """The sink (None where every stage is on this host under vLLM's multiprocessing executor) and what
    the workers are told (``worker/pool_access``)."""
    sink = RegionSink(pool, secrets.token_bytes(32), slots, row_bytes, scales, sink_host()) \
        if on_ray or forced(environ) else None
    nonce = bytes(pool.mapping[:pool.base][:NONCE])
    # the node tells hosts apart only where vLLM's Ray executor places the stages: a process that Ray
    # runs (a data-parallel replica) starts its stages itself under the multiprocessing executor, on
    # its own host, and they are not Ray's
    return sink, {"nonce": nonce, "node": ray_node_id() if on_ray else None, "size": pool.base + pool.capacity,
                  "sink": sink.address if sink else None, "secret": sink.secret if sink else b""}


def sink_info(sink: RegionSink | None) -> dict:
    """What the run's config records of the sink: where it listened, the stages that connected."""
    return {"region_sink": {"address": "%s:%d" % sink.address, "stages": sink.connected}} if sink else {}
