"""One ``hidden-states extract`` run: plan -> prepare -> load -> loop -> finish.

* plan and prepare: ``run.prepared.PreparedRun`` (what can be checked and foreseen before anything is
  written or loaded: the lines ``hidden-states plan`` prints and the run logs first; then the output
  directory against this run's identity, the samples still to do, the run's plan);
* load and finish: ``run.lifecycle.Lifecycle`` with the model here (``run.model_here.ModelHere``) or on
  Ray replicas (``replicas.driver.RayReplicas``, with extract's batch kind);
* the loop (:meth:`Extraction.loop`): batches from the batch source (``batches.py``: a single run's,
  or a static shard's) handed to the dispatcher: ``rows.ExtractRows`` here, the Ray driver there.

The input is opened once and read once, streaming (``inputs.InputStream``): the preflight peeks at
its first samples, and the loop reads on from there.
"""
from __future__ import annotations

import itertools
import time

from ..plan.batches import BatchSource, batch_source
from ..inputs.streams import Sample
from ..plan.planner import BATCHES_HELD
from ..progress import Progress, log_to_stderr
from ..replicas.driver import RayReplicas, SampleBatches, on_ray
from ..run.lifecycle import Lifecycle
from ..run.model_here import ModelHere
from ..run.prepared import PreparedRun
from ..run.summary import Summary
from ..plan.run_plan import RunPlan
from ..settings import Settings
from ..inputs.tokenization import save_token_frequencies
from .rows import ExtractRows


class Extraction:
    """One extraction (see the module's docstring).

    Args:
        settings: what to extract, where, how.
        log: the logger (one line per message); :func:`log_to_stderr` when None.
        source: the batch source; the one ``settings`` ask for when None (``batches.batch_source``).

    Attributes:
        prepared: the plan and the output directory (``run.prepared.PreparedRun``).
        summary: what the run did (``run.summary.Summary``), returned by :meth:`run`.
    """

    def __init__(self, settings: Settings, *, log=None, source: BatchSource | None = None):
        self.settings = settings
        self.log = log or log_to_stderr
        self.source = source or batch_source(settings)
        self.summary = Summary()
        self.on_ray = on_ray(settings)
        self.prepared = PreparedRun(settings, self.source, log=self.log, loads_model_here=not self.on_ray,
                                    batches_held=BATCHES_HELD, runner=Extraction)
        self.lifecycle = Lifecycle(self.prepared, self.summary, log=self.log, unfinished=self.unfinished)
        self.progress: Progress | None = None

    @classmethod
    def executing(cls, plan: RunPlan, *, log=None) -> ExtractReplica:
        """What a Ray replica runs of ``plan`` (``replicas.replica.Replica``)."""
        return ExtractReplica(plan, log=log or log_to_stderr)

    def plan(self) -> None:
        self.prepared.plan()
        self.summary.layer_ids = self.prepared.format_layer_ids

    def run(self) -> Summary:
        prepared = self.prepared
        try:
            self.plan()
            prepared.log_plan()
            prepared.prepare()
            batches = self.source.batches(prepared.pending, self.settings.batch_size)
            first = next(batches, None)  # streams up to the first sample to do: no model load when none is left
            if first is None:
                self.summary.skipped = prepared.pending.skipped
                prepared.output.finish(prepared.finished)
                self.write_token_frequencies()
                return self.summary
            runner = (RayReplicas(prepared, self.summary, SampleBatches(), log=self.log, unfinished=self.unfinished)
                      if self.on_ray else ModelHere(prepared, self.summary, log=self.log, batches_held=BATCHES_HELD))
            summary = self.lifecycle.run(runner, lambda: self.loop(runner, itertools.chain([first], batches)))
            self.write_token_frequencies()
            return summary
        finally:
            prepared.unlock()

    def loop(self, runner, batches) -> None:
        """Hand every batch the source gives to the dispatcher, until it stops or a signal asks."""
        prepared, settings, summary = self.prepared, self.settings, self.summary
        self.log("extracting")
        self.lifecycle.started = time.monotonic()
        if self.on_ray:
            dispatch = runner
        else:
            runner.open_writer()
            dispatch = ExtractRows(runner, summary, share_prefixes=settings.share_prefixes,
                                   written=self._written)
        todo, exact = prepared.pending.todo()
        self.progress = Progress(self.source.expected(todo), log=self.log, exact=exact,
                                 interval=settings.progress_interval)
        if self.on_ray:  # the driver counts each batch as its call returns
            runner.progress = self.progress
        interrupt = self.lifecycle.interrupt
        interrupt.extracting = True
        batches = iter(batches)
        try:
            while True:
                try:
                    batch = next(batches, None)
                except Exception:  # bad input met while reading the next batch: keep what ran
                    dispatch.drain()
                    raise
                if batch is None:
                    break
                dispatch.hand_out(batch)
                if interrupt.requested is not None:
                    summary.interrupted = interrupt.requested
                    break
            dispatch.drain()
        except BaseException:
            if not self.on_ray:  # the rows already certifying are finished work: written before it stops
                dispatch.settle()
            raise
        finally:
            summary.skipped = prepared.pending.skipped
            summary.truncated = prepared.pending.truncated
            if prepared.pending.truncated:
                self.log(f"warning: {prepared.pending.truncated} samples longer than --max-seq-len "
                         f"{settings.max_seq_len} were truncated (--strict refuses them)")
            if prepared.input.tokenizer is not None:
                self.log(prepared.input.tokenizer.summary())
        self.progress.close()

    def _written(self, rows: int, tokens: int) -> None:
        todo, exact = self.prepared.pending.todo()
        self.progress.retotal(self.source.expected(todo), exact)
        self.progress.update(rows, tokens)

    def unfinished(self) -> tuple[int, bool]:
        """(samples of this run's range, or its shard's share, that no file holds, whether exact)."""
        left, exact = self.prepared.pending.left(self.prepared.finished)
        share = self.source.expected(left)
        return share, exact and share == left

    def write_token_frequencies(self) -> None:
        """``token_freq.pt`` in the output directory where the format's trainer reads it
        (speculators-0.5: speculators 0.9's ``--draft-vocab-size``; ``OutputDir.token_frequencies``),
        for an input of conversations, once this run has read every row of it from the first: the
        trained tokens of every sample, finished ones included, so a resumed run writes what one
        uninterrupted run and ``prepare`` write. A run over part of the input (``--start-index``,
        ``--max-samples`` short of its end, a stop) leaves it as it is; a speculators-0.3 run writes
        none (and leaves one an older version wrote as it is)."""
        stream, end, path = self.prepared.input, self.settings.end_index, self.prepared.output.token_frequencies
        if path is None or stream.tokenizer is None or not stream.ended or self.settings.start_index or \
                (end is not None and end < stream.samples_read):
            return
        save_token_frequencies(dict(stream.token_counts), path)


class ExtractReplica:
    """What a Ray replica runs of an extraction's plan: the model here, its batches' rows to its writer."""

    def __init__(self, plan: RunPlan, *, log):
        self.prepared = PreparedRun.adopt(plan, log=log)
        self.summary = Summary(layer_ids=self.prepared.format_layer_ids)
        self.model = ModelHere(self.prepared, self.summary, log=log, batches_held=BATCHES_HELD)
        self.rows: ExtractRows | None = None

    def start(self) -> None:
        """Load the model, open the writer."""
        self.model.load()
        self.model.open_writer()
        self.rows = ExtractRows(self.model, self.summary,
                                share_prefixes=self.prepared.run_plan.settings.share_prefixes)

    def replica_batch(self, batch: list[Sample], skip: frozenset[int]) -> dict:
        return self.rows.replica_batch(batch, skip)
