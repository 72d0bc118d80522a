"""The model in this process: the backend that loads it and runs its forwards, and the background
writer every sample file of this process goes through. A single run, a static shard and each Ray
replica hold one; a Ray driver holds none (``replicas.RayReplicas`` in its place).

:meth:`ModelHere.load` starts the backend (vLLM loads the model), checks its forward and writes the
full config; :meth:`ModelHere.open_writer` starts the writer; :meth:`ModelHere.finish` drains the
writer, counts what it wrote and shuts the backend down (after a failure too).
"""
from __future__ import annotations

import os
import time

from ..backends.shared.regions import SHM
from ..certify.certifier import Certifier, uncertified_hint
from ..errors import OutputError
from ..plan.estimates import duration
from ..files import atomic_write_json, read_json
from ..inputs.identity import difference
from ..output.names import CONFIG, format_name
from ..output.writer import BackgroundWriter
from ..plan.planner import load_model
from ..sizes import human_size
from .prepared import PreparedRun
from .summary import DRAIN_THREADS, Summary


class ModelHere:
    """This process's backend and writer, for ``prepared``'s run; counts into ``summary``.

    Attributes:
        backend: the backend (after :meth:`load`).
        layer_order: where each listed layer is among those the backend captures (backends capture
            each layer once, in the model's order; the files list them as asked).
        writer: the background writer (after :meth:`open_writer`), its ledger tagged as the plan says.
    """

    def __init__(self, prepared: PreparedRun, summary: Summary, *, log, batches_held: int):
        self.prepared, self.summary, self.log, self.batches_held = prepared, summary, log, batches_held
        self.backend = None
        self.layer_order: list[int] = []
        self.writer: BackgroundWriter | None = None
        self.certifier: Certifier | None = None  # after load: None where rows go uncertified (said then)

    def load(self) -> None:
        """Start the backend (vLLM loads the model), check its forward, write the full config."""
        prepared = self.prepared
        estimate = prepared.time_estimate
        expected = f"about {duration(estimate.load_s)}, the plan's estimate" if estimate else "tens of seconds"
        loaded = load_model(prepared.run_plan.settings, prepared.model_plan, prepared.memory_check, log=self.log,
                            batches_held=self.batches_held, held=self._hold, expected=f"{expected}; Ctrl-C stops at once")
        self.backend, self.layer_order, info = loaded.backend, loaded.layer_order, loaded.info
        self.summary.load_seconds = loaded.seconds
        segment = info.get("states_segment")
        if segment and segment["in"] != SHM:
            self.log(f"warning: the states' shared segment ({human_size(segment['bytes'])}) is in {segment['in']}: "
                     f"{SHM} lacks room for it, and a file there is written back to disk (a smaller --batch-size "
                     f"fits in memory)")
        self.certifier = self._certifier()
        self.check_still_ours()
        atomic_write_json(prepared.output.path / CONFIG, {**prepared.config, **info})

    def _certifier(self) -> Certifier | None:
        """The run's certifier, its first certificate made; or None, said in one line, where its rows go
        uncertified."""
        return Certifier.for_model(self.prepared.run_plan.settings, self.prepared.model_plan, self.backend,
                                   self.layer_order, self.log)

    def _uncertified_by_backend(self) -> bool:
        """The run wrote rows, uncertified because its backend does not certify (not --no-certificates)."""
        return (self.backend is not None and not self.backend.certifies and self.writer is not None
                and self.writer.stats.files > 0 and self.prepared.run_plan.settings.certificates)

    def _hold(self, backend) -> None:
        self.backend = backend  # closed by finish, whatever fails from here

    def check_still_ours(self) -> None:
        """Refuse to write where another run (a shard given another input, say) took the directory
        over while the model loaded: a directory with no finished sample goes to whoever claims it."""
        prepared = self.prepared
        held = read_json(prepared.output.path / CONFIG)
        differs = difference({**held, "format": format_name(held)}, {**prepared.config, "format": prepared.format.name})
        if differs is not None:
            raise OutputError(f"{prepared.output.path}: another extraction took the directory over while the model "
                              f"loaded ({differs}); nothing was written: use another --output-dir")

    def open_writer(self) -> None:
        prepared, settings = self.prepared, self.prepared.run_plan.settings
        self.writer = BackgroundWriter(prepared.output.path, settings.writer_queue, settings.writer_threads,
                                       format=prepared.format, tag=prepared.run_plan.tag,
                                       max_threads=settings.max_writer_threads)

    def finish(self, started: float | None) -> None:
        """Drain the writer, shut the backend down; the summary's times from ``started`` (the loop's
        start; None: now)."""
        drain_started = time.monotonic()
        started = started or drain_started
        try:
            try:
                if self.writer is not None:
                    # waits for the files still queued (time the extraction waits on disk), with up to
                    # DRAIN_THREADS writing them: the run's last batch, written after its last forward
                    self.writer.close(drain_threads=max(0, min(DRAIN_THREADS, os.cpu_count() or 1) - self.writer.stats.threads))
            finally:
                # what the writer did is counted before vLLM's shutdown, which a second signal can
                # cut short: the summary then still counts the files written, and no more
                self.summary.seconds = time.monotonic() - started
                if self.writer is not None:
                    self.count_written(time.monotonic() - drain_started)
                if self.certifier is not None and self.certifier.rows:
                    self.log(f"certificates: {self.certifier.said()} (hidden-states verify "
                             f"{self.prepared.output.path} checks them again)")
                elif self._uncertified_by_backend():
                    self.log(uncertified_hint(self.prepared.run_plan.settings.backend, self.prepared.output.path))
            # the rate counts until the last file is whole: vLLM's worker shutdown that follows
            # (seconds, whatever the run's length) is reported on its own
            if self.backend is not None:
                self.log("debug: shutting vLLM down")
                self.backend.close()
                # None unless a backend has a word (vllm-engine: --cuda-graphs, waits for room for states)
                for line in (self.backend.closing_line or "").splitlines():
                    self.log(line)
        finally:
            self.summary.shutdown_seconds = time.monotonic() - started - self.summary.seconds

    def report_failures(self) -> None:
        """Nothing: a batch that fails here stops the run as it fails."""

    def count_written(self, drain: float) -> None:
        """The summary's counts of what this process's writer wrote: the files whole on disk (a
        row handed to a writer that then failed is not extracted), their bytes, and the finished
        set they join."""
        stats = self.writer.stats
        self.summary.extracted = stats.files
        self.summary.bytes_written = stats.bytes
        self.summary.stall_seconds = stats.stall_seconds + drain
        self.summary.writer_threads_grown = max(0, stats.threads - self.prepared.run_plan.settings.writer_threads)
        self.prepared.finished.update(stats.lengths)
