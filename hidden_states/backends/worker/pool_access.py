"""How a capturing stage's worker reaches the parent's region pool: the file itself, mapped, where the
worker runs on the parent's host and finds this run's pool there; else a copy of its own, whose
stored bytes go to the parent's region sink (``shared/region_sink``).

The same host is told by Ray's node id where Ray runs the stages (the parent passes its own; two Ray
nodes on one host share an IP and ``/dev/shm``, so an address or a file that exists would not tell),
and the file by the nonce the parent wrote in its first bytes. ``VLLM_COMPAT_REGION_SINK=always``
sends every stage through the sink (how one host under vLLM's multiprocessing executor proves it).
"""
from __future__ import annotations

import mmap
import os

from ..shared.region_sink import RegionSender, forced, ray_node_id


def mapped_pool(path: str, transport: dict | None) -> mmap.mmap | None:
    """The parent's region file mapped, if this worker may use it (``transport`` None: the parent asks
    for no check, the file is mapped); else None."""
    if transport is not None and (forced() or transport["node"] is not None and transport["node"] != ray_node_id()):
        return None
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        if transport is None:
            raise
        return None
    try:
        mapping = mmap.mmap(fd, 0)
    finally:
        os.close(fd)
    nonce = transport["nonce"] if transport is not None else b""
    if mapping[:len(nonce)] != nonce:  # another file of that name: not this run's pool
        mapping.close()
        return None
    return mapping


def open_pool(path: str, transport: dict | None, stage: int) -> tuple[mmap.mmap, bool]:
    """(mapping, remote): the pool mapped (remote False), or a private copy of the pool's size whose
    stored bytes the caller sends to the parent's sink (``connect``)."""
    mapping = mapped_pool(path, transport)
    if mapping is not None:
        return mapping, False
    if transport.get("sink") is None:
        raise RuntimeError(f"hidden-states vllm-engine capture: pipeline stage {stage} cannot map the parent's "
                           f"region file (another host) and the parent started no region sink")
    return mmap.mmap(-1, transport["size"]), True


def connect(transport: dict, block: int, host) -> RegionSender:
    return RegionSender(tuple(transport["sink"]), transport["secret"], block, host)
