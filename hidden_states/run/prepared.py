"""A run before its model loads: what the planner found (:meth:`PreparedRun.plan`) and what the
output directory holds against it (:meth:`PreparedRun.prepare`), ending in the frozen
``run_plan.RunPlan`` every process executing the run follows. ``extract`` and ``generate`` each
hold one; a Ray replica holds one made from the driver's plan (:meth:`PreparedRun.adopt`).

Nothing is written into the output directory until every check (the plan's too) has passed: a run
refused here leaves at most the empty directory.
"""
from __future__ import annotations

import dataclasses
from datetime import datetime, timezone
from pathlib import Path

from .. import layer_conventions, run_log
from ..plan.batches import BatchSource, Pending
from ..plan.estimates import TimeEstimate
from ..inputs.identity import describe_input
from ..inputs.streams import InputStream
from ..output import formats
from ..output.directory import OutputDir
from ..output.lock import DirectoryLock
from ..plan.planner import BATCHES_HELD, MemoryCheck, ModelPlan
from ..plan.preflight import ModelFacts
from ..plan.run_plan import Planned, RunPlan, plan_run
from ..settings import Settings
from .summary import PLAN_DETAILS, package_versions


class PreparedRun:
    """The plan and the output directory of one run; every stage after them reads them here.

    Args:
        settings: what to extract, where, how.
        source: the batch source (``batches.batch_source``): a single run's batches, or a shard's.
        log: the logger.
        loads_model_here: the backend runs in this process, on this host's devices, against which
            the plan checks the memory the model needs (False on a Ray driver: each replica checks its own).
        batches_held: batches whose states a backend holds at once (the plan sizes memory by it).
        runner: what a Ray replica executes this run with (``RunPlan.runner``).

    Attributes:
        planned: what the planner found (``run_plan.Planned``, after :meth:`plan`).
        memory_check: the memory check against this host's devices (the plan's, or a Ray replica's own).
        model_plan: the ``planner.ModelPlan``.
        format, output, lock: the output format, directory and the directory's lock (after :meth:`prepare`).
        finished: sample index -> rows (None: not known) of every whole file the directory holds.
        pending: the samples of the range still to do.
        run_plan: the frozen ``run_plan.RunPlan`` (after :meth:`prepare`, or the one adopted).
    """

    def __init__(self, settings: Settings, source: BatchSource | None, *, log, loads_model_here: bool = True,
                 batches_held: int = BATCHES_HELD, runner: type | None = None):
        self.settings, self.source, self.log = settings, source, log
        self.loads_model_here, self.batches_held, self.runner = loads_model_here, batches_held, runner
        self.planned: Planned | None = None
        self.memory_check: MemoryCheck | None = None
        self.model_plan: ModelPlan | None = None
        self.format = None
        self.output: OutputDir | None = None
        self.lock: DirectoryLock | None = None  # held from prepare to the end of the run
        self.finished: dict[int, int | None] = {}
        self.pending: Pending | None = None
        self.run_plan: RunPlan | None = None

    def plan(self, **extra) -> None:
        """Everything that can be checked and foreseen before anything is written or loaded
        (``run_plan.plan_run``; ``extra``: what a command adds), in ``plan_lines``. Reads the output
        directory, never writes it."""
        self.hold(plan_run(self.settings, self.source, log=self.log, loads_model_here=self.loads_model_here,
                           batches_held=self.batches_held, **extra))

    def log_plan(self) -> None:
        """Say the plan's lines first, before anything is written or loaded: its details (how a
        setting was chosen, the model's shape, the estimate's basis: ``PLAN_DETAILS``) to the log file
        only; ``hidden-states plan`` prints them all."""
        for line in self.plan_lines:
            self.log(f"debug: {line}" if line.startswith(PLAN_DETAILS) else line)

    def hold(self, planned: Planned) -> None:
        self.planned = planned
        self.memory_check = planned.memory_check
        self.model_plan = planned.model

    def prepare(self) -> None:
        """The output directory, what it already holds, what is left; the run's plan."""
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
            **identity,
            "settings": settings.record(),
        }
        self.run_plan = RunPlan(dataclasses.replace(settings), self.model_plan, self.source.tag, config, self.runner)
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
        self.pending = Pending(self.input, settings, self.finished)
        todo, exact = self.pending.todo()
        done = sum(1 for index in self.finished if settings.in_range(index))
        about = "" if exact else "about "
        self.log(f"debug: {about}{todo + done} samples in range, {done} already finished, {about}{todo} to extract")

    def unlock(self) -> None:
        """Let the output directory's lock go (taken in :meth:`prepare`), once the run is over."""
        if self.lock is not None:
            self.lock.release()

    @classmethod
    def adopt(cls, plan: RunPlan, *, log) -> PreparedRun:
        """The run of ``plan``, which another process planned and prepared (a Ray replica's): its
        format and output directory (tagged ``plan.tag``) as the plan says; no batch source: the
        driver hands the batches out."""
        prepared = cls(plan.settings, None, log=log, runner=plan.runner)
        prepared.run_plan = plan
        prepared.model_plan = plan.model
        prepared.format = formats.create(prepared.format_name, Path(plan.settings.output_dir), prepared.layers,
                                         log=log, state_dtype=plan.settings.state_dtype)
        prepared.output = OutputDir(prepared.format, tag=plan.tag)
        return prepared

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
