"""The run's plan: the model's (``planner.plan_model``) and what ``extract`` and ``generate`` add to
it before anything is written or loaded: the input's first samples, the output directory read
against the run's identity, the samples left, the disk they need, the host memory of
``vllm-engine``'s states in flight, the run's time (:func:`plan_run`, :class:`Planned`: the lines
``hidden-states plan`` prints); and :class:`RunPlan`, what the plan and the output directory's
preparation decided, frozen, for every process that executes the run (a single run, a static
shard, each Ray replica). ``serve`` has no input and no output directory: it calls the planner alone.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

from .. import backends, extras, layer_conventions
from ..output import formats
from ..errors import OutputError, PreflightError
from ..inputs.streams import InputStream
from ..inputs.tokenization import ChatSettings
from ..output.directory import OutputDir
from ..output.lock import holder
from ..settings import Settings
from ..sizes import human_size
from . import planner
from .batches import BatchSource, Pending
from .estimates import TimeEstimate, estimate_time, rate_for
from .planner import BATCHES_HELD, MemoryCheck, ModelPlan
from .preflight import MemoryEstimate, estimate_memory
from .run_checks import check_disk, check_first_samples, estimate_tokens


@dataclass(frozen=True)
class RunPlan:
    """What the plan and the output directory's preparation decided, for every process that executes
    the run: a single run, each Ray replica (``replicas/``), each static shard. Made once, never
    changed (a replica gets its own with :meth:`for_replica`); it crosses to Ray's actors pickled.
    The extraction that made it or executes it reads the model's plan and the config from it.

    Attributes:
        settings: the run's settings, every default applied (a copy: the caller's object may change),
            as the plan checked them: a process executing the plan (a Ray replica) does not check them
            again (``--cuda-graphs`` where it cannot run: ``refuse_cuda_graphs``, in :func:`plan_model`).
        model: the model, the format and the layers (:class:`ModelPlan`).
        tag: the ledger's tag (``done.<tag>.jsonl``: a shard's, a replica's); None: ``done.jsonl``.
        config: ``data_config.json`` before the backend's own facts (read, never changed).
        runner: the class a Ray replica executes it with (its ``executing``: extract's
            or generate's); None: ``Extraction``.
    """

    settings: Settings
    model: ModelPlan
    tag: str | None
    config: dict
    runner: type | None = None

    def for_replica(self, replica_id: int) -> RunPlan:
        """The plan of Ray replica ``replica_id``: its own ledger (a static shard's replicas carry the
        shard's tag too, so two sharded Ray runs never share one)."""
        tag = f"{self.tag}.replica-{replica_id}" if self.tag else f"replica-{replica_id}"
        return dataclasses.replace(self, tag=tag)

    def backend_settings(self, batches_held: int = BATCHES_HELD) -> backends.BackendSettings:
        return self.model.backend_settings(self.settings, batches_held)


@dataclass(frozen=True)
class Remaining:
    """What the plan found left to do.

    Attributes:
        samples: samples of the range no file holds (every shard's); ``exact``: counted, not estimated.
        tokens: their tokens, as extracted; ``tokens_exact``: counted (the whole input was read ahead).
        share: of ``samples``, about how many this process runs (a shard's share; all of them otherwise).
        finished: samples the output directory holds already.
    """

    samples: int
    exact: bool
    tokens: int
    tokens_exact: bool
    share: int
    finished: int

    def said(self) -> str:
        """The samples the disk estimate is for, as the plan's disk line names them."""
        count = f"{'' if self.exact else 'about '}{self.samples:,} sample{'' if self.samples == 1 else 's'}"
        return f"{count} left in range" + (f" ({self.finished:,} already finished)" if self.finished else "")


@dataclass(frozen=True)
class Planned:
    """What :func:`plan_run` found, before anything is written or loaded.

    Attributes:
        model: the :class:`ModelPlan`.
        lines: what the plan found, said before anything is written or loaded (``hidden-states plan``).
        input: the input stream, its first samples read ahead (the loop reads on from there).
        identity: model, layer ids, input, tokenization (``identity.py``) and what the caller added.
        remaining: the range's samples left to do (the output directory read).
        memory_check: the check against this host's devices; None: not run here (the replicas run it).
        time_estimate: the run's time; None: not estimated.
    """

    model: ModelPlan
    lines: list[str]
    input: InputStream
    identity: dict
    remaining: Remaining
    memory_check: MemoryCheck | None
    time_estimate: TimeEstimate | None


def plan_run(settings: Settings, source: BatchSource, *, log, loads_model_here: bool = True,
             batches_held: int = BATCHES_HELD, identity: dict | None = None,
             samples_optional: bool = False, keep_records: bool = False, backend_given: str = "--backend") -> Planned:
    """Everything that can be checked and foreseen of a run before anything is written or loaded
    (the module's docstring); the memory on this host's devices only if it ``loads_model_here`` (else
    each replica checks its own as it loads). Reads the output directory, never writes it.

    Args:
        source: the replica mode (its ledger tag; its share of the samples left).
        batches_held: the batches' worth of sequences whose states the run holds at once.
        identity: what the caller adds to the run's identity (``generate``: its sampling).
        samples_optional: an input with no sample to extract is not refused (``generate``: prompts
            with no reply yet make none; their rows are the regenerated replies').
        keep_records: the input stream keeps its rows for ``InputStream.records`` (``generate`` reads
            its conversations from the stream the plan opened).
        backend_given: how the backend was given, said in the plan's first line where the settings
            name one (None there: chosen here, ``planner.choose_backend``).
    """
    audits = planner.AuditsHere()  # the choice's audits, the audit line's too: each made once
    chosen = planner.choose_backend(settings, backend_given, audits)
    model, lines = planner.plan_model(settings, log)
    lines = [chosen, *lines]
    facts, layer_ids = model.facts, model.layers.ids
    if model.format_name == layer_conventions.SPECULATORS_05:
        extras.require("datasets", f"--format {model.format_name} (its dataset index, which the trainer reads)",
                       PreflightError)
    chat = ChatSettings(settings.model_path, model.format_name, settings.max_seq_len, settings.trust_remote_code,
                        settings.strict)
    stream = InputStream(settings.prepared_data, facts.vocab_size, chat, digest=True, keep_records=keep_records)
    if not samples_optional or stream.peek(1):  # read ahead and validated (their length too, with --strict)
        check_first_samples(stream, settings.max_seq_len if settings.strict else None)
    input_source, tokenization = stream.identity(settings.max_seq_len)
    run_identity = {"model": facts.path, "layer_ids": list(model.format_layer_ids),
                    "state_dtype": settings.state_dtype, "input": input_source, "tokenization": tokenization,
                    **(identity or {})}
    finished_before = check_output_dir(settings, model, run_identity, source.tag, log)
    remaining = count_remaining(settings, stream, finished_before, source)
    memory = estimate_memory(facts, settings.tp_size, settings.batch_size, settings.max_seq_len,
                             settings.pp_size)
    memory_check = None
    if loads_model_here:  # asking the device imports vLLM (seconds)
        memory_check = planner.check_memory_here(settings, facts, memory)
        lines += memory_check.lines
        if settings.backend == "vllm-engine":
            lines.append(planner.states_in_flight_line(settings, model, batches_held))
    elif memory is not None:
        lines.append(f"memory: {memory.line()}; each replica checks it against its own node's devices as it loads")
    disk = check_disk(existing_parent(Path(settings.output_dir)), remaining.tokens, facts, layer_ids,
                      settings.state_dtype)
    lines.append(f"disk: about {human_size(disk)} of hidden states for the {remaining.said()}"
                 if disk else "disk: not estimated (the input's size per token is not known)"
                 if remaining.samples else "disk: nothing to write (no sample left in range)")
    if settings.backend in backends.BACKENDS:  # a test's fake drives no vLLM
        lines.append(audits.line(settings.backend))
    device = memory_check.device if memory_check is not None else None
    if device is None and memory is not None and settings.backend in backends.BACKENDS:
        device = planner.device_name_here()  # a Ray driver's plan: the replicas check the memory
    release = installed_release() if settings.backend in backends.BACKENDS else None
    work_lines, time_estimate = work_and_time(settings, remaining, finished_before, memory, device, source.tag,
                                              release)
    return Planned(model, lines + work_lines, stream, run_identity, remaining, memory_check, time_estimate)


def check_output_dir(settings: Settings, model: ModelPlan, identity: dict, tag: str | None, log) -> set[int]:
    """What can be told of the output directory without writing: not a file, in a writable folder,
    not another extraction's (``identity``); the samples already finished in it."""
    path = Path(settings.output_dir)
    if path.exists() and not path.is_dir():
        raise OutputError(f"--output-dir {path}: is a file, not a directory")
    parent = existing_parent(path)
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        why = "writable" if parent.is_dir() else "a directory"
        raise OutputError(f"--output-dir {path}: cannot be made ({parent} is not {why})")
    if not path.is_dir():
        return set()
    running = holder(path, tag)
    if running:
        raise OutputError(f"--output-dir {path}: {running} is writing into it; wait for it to end, or use "
                          f"another --output-dir")
    output = OutputDir(formats.create(model.format_name, path, model.layers, log=log,
                                      state_dtype=settings.state_dtype), layouts=formats.readers(path))
    if output.check(identity, settings.start_over) is not None:
        return set()  # another extraction, which this run replaces (prepare): nothing of it counts
    return output.sample_files()[0]


def count_remaining(settings: Settings, stream: InputStream, finished: set[int], source: BatchSource) -> Remaining:
    """The samples of the run's range that no file holds yet (the output directory read, not
    changed) and their tokens: what the disk must still take (every shard's, which all write into
    the directory) and what this process runs."""
    todo, exact = Pending(stream, settings, finished).todo(count=True)
    if stream.expected_samples()[1]:  # the whole input was read: count
        tokens = sum(min(len(s.input_ids), settings.max_seq_len) for s in stream.peek(0)
                     if settings.in_range(s.index) and s.index not in finished)
        tokens_exact = True
    else:  # the samples to do at the first samples' mean length
        tokens, tokens_exact = estimate_tokens(stream, settings.max_seq_len, todo), False
    return Remaining(todo, exact, tokens, tokens_exact, source.expected(todo), len(finished))


def installed_release() -> str | None:
    """The installed vLLM's release (``0.17.0`` for ``0.17.0+cpu``), read without importing it."""
    from vllm_compat.extractor_api import base, vllm_version

    version = vllm_version()
    return str(base(version)) if version is not None else None


def work_and_time(settings: Settings, remaining: Remaining, finished: set[int], memory: MemoryEstimate | None,
                  device: str | None, tag: str | None, release: str | None = None
                  ) -> tuple[list[str], TimeEstimate | None]:
    """The samples in range and still to do (the output directory read, not changed), their tokens
    and the run's time on ``device`` with vLLM ``release`` (None: any measured release): the lines,
    the estimate."""
    todo, exact = remaining.share, remaining.exact and remaining.share == remaining.samples
    tokens = remaining.tokens if todo == remaining.samples else round(remaining.tokens * todo
                                                                       / max(remaining.samples, 1))
    about = "" if exact else "about "
    lines = [f"samples: {about}{todo:,} to extract{' by this shard' if tag else ''}"
             + (f", {len(finished)} already finished in {settings.output_dir}" if finished else "")]
    rate, basis = rate_for(device, settings.backend, release)
    if rate is None:
        return lines + [f"time: not estimated ({basis})"], None
    if memory is None:
        return lines + ["time: not estimated (the model's size is read from .safetensors files)"], None
    estimate = estimate_time(rate, basis, tokens, remaining.tokens_exact and todo == remaining.samples,
                             memory.token_parameters, memory.weights, settings.tp_size, settings.data_parallel_size)
    return lines + estimate.lines(), estimate


def existing_parent(path: Path) -> Path:
    """``path``, or the nearest folder above it that exists (where it will be made)."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path
