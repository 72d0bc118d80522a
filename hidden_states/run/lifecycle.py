"""One run's life once its output directory is prepared, the same for ``extract`` and ``generate``:
the model loaded (here, ``model_here.ModelHere``, or on Ray replicas, ``replicas.RayReplicas``: a
*runner*, with ``load()``, ``finish(started)`` and ``report_failures()``), the command's loop, and the end of the run
(the runner finished, the format's end-of-run files written), with vLLM's processes watched and
signals heard meanwhile.

A failure that comes with the death of one of vLLM's processes (a worker the kernel's OOM killer
ended, say) is reported as :class:`ProcessDied`, naming the process and how it ended
(``processes.Children``), where vLLM's own error names neither. A run that stops early (a signal,
bad input past the preflight's samples, a dead worker, a lost replica) says what it left undone
and what to do, the same way for every cause.
"""
from __future__ import annotations

import sys
from collections.abc import Callable

from .. import processes
from ..certify.certifier import CertificateFailed
from ..errors import ExtractError, InputError, OutputError
from ..files import atomic_write_json, read_json
from ..inputs.identity import stop_record
from ..interrupts import Interrupt
from ..output.names import CONFIG
from ..processes import EXIT_WAIT, ProcessDied
from .prepared import PreparedRun
from .summary import Summary, next_step


class Lifecycle:
    """Load, loop, finish for ``prepared``'s run, counting into ``summary``.

    Args:
        unfinished: () -> (samples of the range, or this process's share, that no file holds; whether
            exact): what a run that stopped early says it left.

    Attributes:
        interrupt: the signals' handler while the model is loaded (``interrupts.Interrupt``).
        started: when the loop began (the rate counts from there); the loop sets it.
    """

    def __init__(self, prepared: PreparedRun, summary: Summary, *, log, unfinished: Callable[[], tuple[int, bool]]):
        self.prepared, self.summary, self.log, self.unfinished = prepared, summary, log, unfinished
        self.interrupt: Interrupt | None = None
        self.children: processes.Children | None = None  # vLLM's processes, while the model is loaded
        self.started: float | None = None

    def run(self, runner, work: Callable[[], None], *, then: Callable[[], None] | None = None) -> Summary:
        """Load the model (``runner.load()``), run ``work()``, finish (``runner.finish``, the format's
        end-of-run files, then ``then()``); a run that stopped early says so (its summary, what to
        do) before the error goes on."""
        try:
            with processes.contained() as self.children, Interrupt(self.log) as self.interrupt:
                try:
                    runner.load()
                    work()
                except Exception as exc:
                    if isinstance(exc, InputError):
                        self.record_stop(exc)
                    died = self.process_died(exc)
                    if died is None:
                        raise
                    raise died from exc
                finally:
                    try:
                        self.finish(runner)
                    finally:
                        if then is not None:
                            then()
                    runner.report_failures()  # work the runner gave up, counted once the run's end is written
        except BaseException as exc:  # the caller gets the error, not the summary: it is said here
            self.ended_early(exc)
            self.log(self.summary.line())
            self.log(self.summary.next_step)
            raise
        if self.summary.interrupted is not None:
            self.ended_early(None)
        return self.summary

    def interrupted(self) -> bool:
        """A signal asked the run to stop (after the work in flight)."""
        return self.interrupt is not None and self.interrupt.requested is not None

    def finish(self, runner) -> None:
        """The runner's end (its files drained, vLLM shut down), then the format's end-of-run files.
        Runs after a failure too: a second error from a disk that already failed the run is not
        reported again."""
        failing = sys.exc_info()[1]
        prepared = self.prepared
        try:
            runner.finish(self.started)
        finally:
            failing = failing or sys.exc_info()[1]
            if prepared.run_plan.tag is not None:  # other shards wrote too: the index lists theirs as well
                prepared.finished = prepared.output.finished()
            try:
                prepared.output.finish(prepared.finished)
            except OutputError:
                # when the disk that failed the run fails this too, the first file it refused is
                # the one reported (once); a rerun rewrites the format's index files from the files
                if failing is None:
                    raise

    def record_stop(self, error: InputError) -> None:
        """Note in ``data_config.json`` the bad row that stopped the run (and the rows before it,
        ``identity.stop_record``): the rerun on the input corrected there continues this extraction,
        and ``status`` says where it stopped."""
        path, stream = self.prepared.output.path / CONFIG, self.prepared.input
        try:
            config = read_json(path)
            where = str(error).split(": ", 1)[0]
            config["input"] = {**config["input"], "stopped_at": stop_record(stream.path, stream.line, where)}
            atomic_write_json(path, config)
        except (ExtractError, OSError) as exc:  # the bad row is what the run reports
            self.log(f"where the input stopped the run is not recorded: {exc}")

    def ended_early(self, failure: BaseException | None) -> None:
        """The summary of a run that stopped before its range was done (``failure``: what stopped it;
        None: a signal, after the batch in flight): every sample of the range no file holds, and what
        to do."""
        self.summary.stopped = True
        self.summary.unfinished, self.summary.unfinished_exact = self.unfinished()
        self.summary.next_step = next_step(failure)

    def process_died(self, failure: Exception) -> ProcessDied | None:
        """When ``failure`` came with the death of one of vLLM's processes (vLLM's own error then
        says little: "cancelled", "EngineCore encountered an issue"), the error that names it."""
        # the extractor's own clear errors (a full disk, bad input, a row its certificate refuses): no
        # process died, and waiting EXIT_WAIT for one would only delay the line that says so
        if isinstance(failure, (ExtractError, CertificateFailed)):
            return None
        stopped = f"{type(failure).__name__}: {str(failure).rstrip('.') or '(no message)'}"
        return processes.death(self.children, f". The run stopped on it: {stopped}. Finished samples are kept: "
                                              f"rerun the same command to resume", wait=EXIT_WAIT)

