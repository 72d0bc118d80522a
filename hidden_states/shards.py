"""Static shards: N independent processes (SLURM tasks, torchrun ranks, hand-started jobs) splitting
one input into one shared output directory, without any coordinator.

Shard ``I`` of ``N`` takes every ``N``-th batch of the range: sample ``i`` belongs to shard
``((i - start) // batch_size) % N``. Whole batches keep each shard's batches the ones a single run
makes (the same samples side by side, so the same states); taking every ``N``-th one balances a
range whose lengths drift. Each shard writes its own ledger (``done.shard-I-of-N.jsonl``); whole
files are what count as finished, so a rerun with any shard count, or a single run, resumes what
every shard finished.

Where the shard comes from, first found wins: ``--shard I/N``; torchrun's ``RANK``/``WORLD_SIZE``;
SLURM's ``SLURM_PROCID``/``SLURM_NTASKS``. A world of one is no sharding.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from .errors import UsageError

# torchrun's variables, read here and removed before vLLM starts: vLLM's workers run their own
# process group, and must not take the launcher's rank for theirs.
TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE",
            "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


@dataclass(frozen=True)
class Shard:
    index: int
    count: int
    origin: str  # where it came from, for the log: "--shard", "RANK/WORLD_SIZE", ...

    @property
    def tag(self) -> str:
        """The writer tag: the shard's ledger is ``done.<tag>.jsonl``."""
        return f"shard-{self.index}-of-{self.count}"

    def owns(self, index: int, start: int, batch_size: int) -> bool:
        return (index - start) // batch_size % self.count == self.index

    def __str__(self) -> str:
        return f"shard {self.index}/{self.count} (from {self.origin})"


def parse(text: str, origin: str = "--shard") -> Shard:
    """``"I/N"`` -> :class:`Shard`, or UsageError naming ``origin``."""
    index, sep, count = text.partition("/")
    try:
        if not sep:
            raise ValueError
        shard = Shard(int(index), int(count), origin)
    except ValueError:
        raise UsageError(f"{origin} {text!r}: expected I/N, e.g. 0/4 (shard I of N, counting from 0)") from None
    if shard.count < 1 or not 0 <= shard.index < shard.count:
        raise UsageError(f"{origin} {text!r}: needs 0 <= I < N")
    return shard


def from_environment(flag: str | None, environ: Mapping[str, str] = os.environ) -> Shard | None:
    """The shard this process is: ``--shard`` when given, else the launcher's variables; None
    when there is no sharding (no launcher, or a world of one)."""
    if flag is not None:
        shard = parse(flag)
    else:
        shard = None
        for rank, size, origin in (("RANK", "WORLD_SIZE", "RANK/WORLD_SIZE"),
                                   ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_PROCID/SLURM_NTASKS")):
            if environ.get(rank) is not None and environ.get(size) is not None:
                shard = parse(f"{environ[rank]}/{environ[size]}", origin)
                break
    return shard if shard is not None and shard.count > 1 else None


def leave_torchrun(environ=os.environ, tp_size: int = 1) -> str | None:
    """Under torchrun: drop its variables so vLLM's workers do not read them, and, when nothing chose
    the devices yet, give this rank its own ``tp_size`` GPUs (``LOCAL_RANK * tp_size`` on; the caller
    passes ``--tp-size x --pp-size``: every pipeline stage's tensor-parallel GPUs). Returns
    the ``CUDA_VISIBLE_DEVICES`` it set, or None."""
    if "LOCAL_RANK" not in environ or "TORCHELASTIC_RUN_ID" not in environ:
        return None
    local_rank = int(environ["LOCAL_RANK"])
    chosen = None
    if "CUDA_VISIBLE_DEVICES" not in environ:
        chosen = ",".join(str(local_rank * tp_size + k) for k in range(tp_size))
        environ["CUDA_VISIBLE_DEVICES"] = chosen
    for name in TORCHRUN:
        environ.pop(name, None)
    return chosen
