"""Regions across hosts: a pipeline stage whose worker cannot map the parent's region file (a stage on
another host) sends the bytes it stores to the parent over one TCP connection, and the parent's
:class:`RegionSink` writes them into the pool where the stage's own stores would have put them.

* Who may write: the parent makes a random secret per run (``secrets.token_bytes``) and hands it to
  the workers with the pool's other particulars, through vLLM's own call to its workers (the channel
  the run's requests and model already travel). A connection is accepted only if it answers a fresh
  random challenge with ``HMAC-SHA256(secret, challenge + block)``: the secret never crosses the
  sink's socket, a recorded answer does not answer another challenge, and 256 random bits cannot be
  guessed; so only this run's stages write. One connection per capturing stage (a second one for the
  same block is refused). The stream is neither encrypted nor signed past the handshake: like vLLM's
  own traffic between its stages, it trusts the cluster's network against on-path tampering.
* What it may write: a frame is ``(region, length, offset, nbytes)`` then the bytes. The bytes must
  lie in the stage's own parts of the region at ``region`` laid out for ``length`` rows (its counter
  block, its token ids, the row scales, its layers' slots), and that layout must fit the region the
  pool reserved there; a frame outside the pool or in another stage's parts is a protocol error that
  fails the run naming the stage (``RegionPool.fail``). A frame for a region no longer reserved (a
  request ended early, its region released) is dropped, as a local stage's late store would land in
  a free region unread.
* Order: the sender sends a step's bytes first and its counters last, over one stream, and the sink
  writes frames in the order they come: a counter the parent reads is never ahead of its rows.
* A stage whose connection closes (its process ended) fails every batch waiting for rows at once,
  naming the stage, instead of letting them wait for the rows' timeout.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import socket
import struct
import sys
import threading

from .regions import HEADER, _per_row, ids_start, layer_start, scales_start

logger = logging.getLogger(__name__)

SINK_ENV = "VLLM_COMPAT_REGION_SINK"  # "always": every capturing stage sends through the sink (one host, tests)
FRAME = struct.Struct("<QQQI")  # region, rows it is laid out for, offset in the pool, bytes that follow
CHALLENGE = 32
HELLO = struct.Struct("<I")  # the stage's counter block, then the HMAC of challenge + these bytes
ACCEPTED = b"\x01"  # the sink's answer to a proven stage (a refused one reads the connection's end)
NONCE = 16  # the pool file's first bytes: how a worker knows the file it opened is this run's pool


def proof(secret: bytes, challenge: bytes, block: int) -> bytes:
    return hmac.new(secret, challenge + HELLO.pack(block), hashlib.sha256).digest()


def forced(environ=os.environ) -> bool:
    """Whether the test switch sends every capturing stage through the sink (one host, ``mp``)."""
    return environ.get(SINK_ENV, "") == "always"


def ray_node_id() -> str | None:
    """This process's Ray node id; None where Ray does not run it."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    return ray.get_runtime_context().get_node_id()


def stored_ranges(region: int, length: int, start: int, take: int, slots: list[int], block: int, blocks: int,
                  row_bytes: int, scales: bool) -> list[tuple[int, int]]:
    """The (offset, bytes) a stage stores for rows ``start .. start + take`` of a region: its token ids,
    the rows' scales (FP8), each of its layers' rows."""
    ranges = [(region + ids_start(length, block, blocks) + 4 * start, 4 * take)]
    if scales:
        ranges.append((region + scales_start(length, blocks) + 4 * start, 4 * take))
    ranges += [(region + layer_start(length, slot, row_bytes, scales, blocks) + start * row_bytes, take * row_bytes)
               for slot in slots]
    return ranges


def _recv_exactly(sock: socket.socket, into: memoryview) -> bool:
    """Fill ``into`` from ``sock``; False at EOF before it is full."""
    while len(into):
        got = sock.recv_into(into)
        if not got:
            return False
        into = into[got:]
    return True


class RegionSink:
    """The parent's end: listens on ``host`` (a port of the system's choosing), one thread per stage.
    ``slots``: capturing block -> the layer slots its stage stores; ``stages``: block -> pipeline stage
    (for messages)."""

    def __init__(self, pool, secret: bytes, slots: dict[int, list[int]], row_bytes: int, scales: bool,
                 host: str = "127.0.0.1"):
        self.pool, self.secret, self.slots = pool, secret, slots
        self.row_bytes, self.scales = row_bytes, scales
        self.dropped = 0  # frames for regions already released
        self.closing = False
        self._connected: set[int] = set()
        self._lock = threading.Lock()
        self._listener = socket.create_server((host, 0))
        self.address = (host, self._listener.getsockname()[1])
        threading.Thread(target=self._accept, name="hidden-states-region-sink", daemon=True).start()

    @property
    def connected(self) -> list[int]:
        """The pipeline stages connected (proven), in order."""
        with self._lock:
            return sorted(self.pool.stages[block] for block in self._connected)

    def _stage(self, block: int) -> str:
        return f"pipeline stage {self.pool.stages[block]}"

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(sock,), name="hidden-states-region-sink-stage",
                             daemon=True).start()

    def _hello(self, sock: socket.socket) -> int | None:
        """The block of a stage that proved the run's secret, else None (the connection refused)."""
        challenge = secrets.token_bytes(CHALLENGE)
        sock.settimeout(30.0)
        sock.sendall(challenge)
        answer = bytearray(HELLO.size + hashlib.sha256().digest_size)
        if not _recv_exactly(sock, memoryview(answer)):
            return None
        (block,) = HELLO.unpack_from(answer)
        if not hmac.compare_digest(bytes(answer[HELLO.size:]), proof(self.secret, challenge, block)):
            logger.warning("region sink: refused a connection that does not know this run's secret")
            return None
        with self._lock:
            if block not in self.slots or block in self._connected:
                logger.warning("region sink: refused a second or unknown stage (block %d)", block)
                return None
            self._connected.add(block)
        sock.sendall(ACCEPTED)
        sock.settimeout(None)
        return block

    def _serve(self, sock: socket.socket) -> None:
        with sock:
            try:
                block = self._hello(sock)
            except OSError:
                return
            if block is None:
                return
            try:
                self._receive(sock, block)
            except OSError as exc:
                self._closed(block, f"its connection failed ({exc})")

    def _receive(self, sock: socket.socket, block: int) -> None:
        header = bytearray(FRAME.size)
        mapping = memoryview(self.pool.mapping)
        while True:
            if not _recv_exactly(sock, memoryview(header)):
                self._closed(block, "it closed its connection (its process ended?)")
                return
            region, length, offset, nbytes = FRAME.unpack(header)
            wrong = self._outside(block, region, length, offset, nbytes)
            if wrong:
                self.pool.fail(f"{self._stage(block)} sent rows {wrong}: the region sink's protocol is broken")
                return
            if self.pool.reserved_size(region) is None:  # released: read into nothing
                self.dropped += 1
                if not _recv_exactly(sock, memoryview(bytearray(nbytes))):
                    self._closed(block, "it closed its connection (its process ended?)")
                    return
                continue
            if not _recv_exactly(sock, mapping[offset:offset + nbytes]):
                self._closed(block, "it closed its connection mid-frame (its process ended?)")
                return

    def _outside(self, block: int, region: int, length: int, offset: int, nbytes: int) -> str | None:
        """Why the frame may not be written (None: it may)."""
        pool, end = self.pool, offset + nbytes
        if offset < pool.base or end > pool.base + pool.capacity:
            return f"at {offset}..{end}, outside the pool ({pool.base}..{pool.base + pool.capacity})"
        size = pool.reserved_size(region)
        if size is None:
            return None  # a released region: dropped by the caller
        blocks = len(pool.stages)
        layers = max((s for slots in self.slots.values() for s in slots), default=-1) + 1
        if layer_start(length, layers, self.row_bytes, self.scales, blocks) > size:
            return f"for a region at {region} of {length} rows, larger than the region reserved there"
        parts = [(region + block * HEADER, HEADER), (region + ids_start(length, block, blocks), _per_row(length))]
        if self.scales:
            parts.append((region + scales_start(length, blocks), _per_row(length)))
        parts += [(region + layer_start(length, slot, self.row_bytes, self.scales, blocks), length * self.row_bytes)
                  for slot in self.slots[block]]
        if any(start <= offset and end <= start + size for start, size in parts):
            return None
        return f"at {offset}..{end}, outside its own counters, token ids and layers of the region at {region}"

    def _closed(self, block: int, why: str) -> None:
        if not self.closing:
            self.pool.fail(f"{self._stage(block)} stopped sending its rows: {why}")

    def close(self) -> None:
        self.closing = True
        self._listener.close()


class RegionSender:
    """A stage's end: connected and proven at construction; ``send`` writes one step's frames (called
    from the one thread that waits for the step's copies, ``engine_capture.CopiesDone``)."""

    def __init__(self, address: tuple[str, int], secret: bytes, block: int, host):
        self._host = host  # the worker's own copy of the pool (a uint8 tensor): what it stored, read here
        self._sock = socket.create_connection(tuple(address), timeout=30.0)
        challenge = bytearray(CHALLENGE)
        if not _recv_exactly(self._sock, memoryview(challenge)):
            raise RuntimeError(f"the region sink at {address[0]}:{address[1]} closed the connection")
        self._sock.sendall(HELLO.pack(block) + proof(secret, bytes(challenge), block))
        if not _recv_exactly(self._sock, memoryview(bytearray(len(ACCEPTED)))):
            raise RuntimeError(f"the region sink at {address[0]}:{address[1]} refused pipeline stage block {block} "
                               f"(not this run's secret, or the block connected already)")
        self._sock.settimeout(None)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def send(self, ranges: list[tuple[int, int, int, int]], counters: list[tuple[int, int, int, int]]) -> None:
        """``ranges``: (region, length, offset, bytes) stored; ``counters``: (region, length, offset, 8) of
        the counters written, sent after every range."""
        data = self._host.numpy()
        for region, length, offset, nbytes in [*ranges, *counters]:
            self._sock.sendall(FRAME.pack(region, length, offset, nbytes))
            self._sock.sendall(memoryview(data[offset:offset + nbytes]))

    def close(self) -> None:
        self._sock.close()

