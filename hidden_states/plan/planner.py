"""The planner: what a run can check and foresee of the model before anything is written or loaded.
``extract``, ``generate`` and ``serve`` call it; ``run_plan`` adds the input and the output directory.

* :func:`plan_model` (no input, no output directory: ``serve`` calls it alone): the settings'
  bounds, the environment, the model's config, the format, the layer ids, tensor parallelism;
* :func:`check_memory_here`: the memory the model needs per rank against this host's devices and,
  on vLLM's CPU backend, the KV cache it will be given; :func:`audit_line`: the vllm-compat audit;
  :func:`states_in_flight_line`: the host memory of ``vllm-engine``'s states in flight;
* :func:`load_model`: the model loaded as planned, for every command that runs it here (``extract``
  and ``generate`` through ``run.model_here``, each Ray replica, ``serve``): vLLM's CPU KV cache sized
  as the memory check said, the backend started, the forward check of its kernels;
* ``run_plan.plan_run``: all of the above but the load, the input's first samples, the output directory read
  against the run's identity, the samples left, the disk they need, the run's time; and
  ``run_plan.RunPlan``, the immutable plan every process executing the run follows.
"""
from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from .. import backends, layer_conventions
from ..errors import PreflightError, UsageError
from ..forward_check import check_forward
from ..output import formats
from ..settings import ModelSettings, Settings
from ..sizes import human_size
from .pipeline import check_one_host, check_pipeline_parallel, gpus_here, pipeline_line
from .preflight import (CPU_KV_CACHE_ENV, DeviceBudget, MemoryEstimate, ModelFacts, check_environment, check_layer_ids,
                        check_memory, check_states_in_flight, check_tensor_parallel, check_vllm, cpu_kv_cache_space,
                        device_budget, estimate_memory, model_facts)

# The batches' worth of sequences whose states a run holds at once: the batch awaited, the writer's
# queue, slack (RunPlan.backend_settings); generate holds a batch's replies besides (its own number).
BATCHES_HELD = 3


@dataclass(frozen=True)
class ModelPlan:
    """What :func:`plan_model` decided of the model and the states taken from it.

    Attributes:
        facts: the model's config facts.
        format_name, format_layer_ids: the output format and the layer ids as its trainer counts them.
        layers: the layers the backend captures, as the extractor counts them.
    """

    facts: ModelFacts
    format_name: str
    format_layer_ids: tuple[int, ...]
    layers: formats.Layers

    def backend_settings(self, settings: ModelSettings, batches_held: int = BATCHES_HELD) -> backends.BackendSettings:
        """What the backend gets: the settings it shares with the run, by name, and the layers it
        captures (each once, in the model's order); ``batches_held``: the batches' worth of
        sequences whose states the run holds at once."""
        shared = {f.name: getattr(settings, f.name) for f in dataclasses.fields(backends.BackendSettings)
                  if hasattr(settings, f.name) and f.name != "layer_ids"}
        # the batch awaited, the writer's queue and its one file per thread, slack (the tokens a
        # backend keeps ahead, known once its engine runs, it adds itself)
        return backends.BackendSettings(**shared, layer_ids=sorted(set(self.layers.ids)),
                                        sequences_in_flight=batches_held * settings.batch_size
                                        + settings.max_writer_threads, num_layers=self.facts.num_layers)

    def layer_order(self, backend_settings: backends.BackendSettings) -> list[int]:
        """Where each listed layer is among those the backend captures: the files list them as asked."""
        return [backend_settings.layer_ids.index(layer) for layer in self.layers.ids]


@dataclass(frozen=True)
class MemoryCheck:
    """What :func:`check_memory_here` found.

    Attributes:
        lines: what it says (the plan's lines).
        device: the device vLLM runs on here (``vllm_compat.host.device_name``); None: not asked, or
            only vLLM's runtime could tell.
        cpu_kv_cache: GiB for ``CPU_KV_CACHE_ENV``, set before the load; None: leave it as it is.
    """

    lines: list[str]
    device: str | None = None
    cpu_kv_cache: int | None = None


def plan_model(settings: ModelSettings, log) -> tuple[ModelPlan, list[str]]:
    """The plan's part that needs no input and no output directory: the settings' bounds, the
    environment (its warnings to ``log``), the model's config, the format and its state dtype, the
    layer ids and their meaning, tensor parallelism; the model's plan and the plan's first lines."""
    if settings.batch_size < 1:
        raise UsageError(f"--batch-size {settings.batch_size}: must be at least 1")
    if settings.max_seq_len < 1:
        raise UsageError(f"--max-seq-len {settings.max_seq_len}: must be at least 1")
    if settings.writer_threads < 1:  # no thread would ever write: files lost, or a hang on a full queue
        raise UsageError(f"--writer-threads {settings.writer_threads}: must be at least 1")
    if settings.cuda_graphs:
        from ..backends.vllm_engine import refuse_cuda_graphs

        refuse_cuda_graphs(settings.backend)
    if settings.backend in backends.BACKENDS:  # a test's fake drives no vLLM
        for line in check_environment():
            log(line)
    facts = model_facts(settings.model_path)
    if facts.remote_code and not settings.trust_remote_code:
        raise UsageError(f"--model-path {settings.model_path}: the model needs remote code (auto_map in "
                         f"config.json); pass --trust-remote-code if you trust it")
    # --layer-ids count as the chosen format's trainer counts; the backends capture in ours
    output_format = settings.format or layer_conventions.default_format()
    if output_format not in formats.FORMATS:
        raise UsageError(f"--format {output_format}: unknown (known: {', '.join(formats.FORMATS)})")
    stored_as = formats.state_dtypes(output_format)
    if settings.state_dtype not in stored_as:
        raise UsageError(f"--state-dtype {settings.state_dtype}: --format {output_format}'s trainer reads "
                         f"{' or '.join(stored_as)} states only (speculators 0.3/0.4 have no FP8 reader); use "
                         f"--format speculators-0.5 (speculators >= 0.9, --hidden-states-backend fp8)")
    given = list(settings.layer_ids) if settings.layer_ids else None
    format_layer_ids = given or layer_conventions.default_ids(output_format, facts.num_layers)
    layer_ids = layer_conventions.to_extractor(output_format, format_layer_ids, facts.num_layers)
    check_layer_ids(layer_ids, facts.num_layers, given=given is not None)
    check_tensor_parallel(facts, settings.tp_size)
    stages = check_pipeline_parallel(facts.num_layers, settings.pp_size)
    if settings.pp_size > 1:
        refuse_pipeline_here(settings)
    model = ModelPlan(facts, output_format, tuple(format_layer_ids),
                      formats.Layers(layer_ids, facts.num_layers, facts.hidden_size))
    chosen = "" if given else " (its trainer's default)"
    return model, [settings_line(settings),
                   f"model: {facts.path} ({facts.num_layers} layers, hidden size {facts.hidden_size})",
                   f"layers: {list(model.format_layer_ids)} for --format {output_format}{chosen}: "
                   f"{layer_conventions.meaning(output_format)}"] + (
                       [pipeline_line(stages, layer_ids)] if settings.pp_size > 1 else [])


def refuse_pipeline_here(settings: ModelSettings) -> None:
    """The backends that cannot run ``--pp-size`` > 1, refused before the load, each with its reason."""
    if settings.backend == "speculators":
        from ..backends.speculators_generator import refuse_pipeline

        refuse_pipeline(settings.pp_size)
    elif settings.backend == "vllm-native":
        from vllm_compat.extractor_api import vllm_device_type, vllm_version

        from ..backends.vllm_native import refuse_pipeline

        refuse_pipeline(settings.model_path, settings.pp_size, vllm_version(), vllm_device_type())
    if getattr(settings, "ray_address", None):
        from vllm_compat.extractor_api import vllm_device_type

        from .ray_stages import refuse_ray_stages

        refuse_ray_stages(settings.pp_size, getattr(settings, "data_parallel_size", 1), vllm_device_type())


def check_memory_here(settings: ModelSettings, facts: ModelFacts,
                      memory: MemoryEstimate | None = None) -> MemoryCheck:
    """The memory the model needs per rank against this host's devices (refuses what cannot fit)
    and, on vLLM's CPU backend, the KV cache it will be given; ``memory``: the plan's estimate (made
    here when None)."""
    from .cpu_threads import check_thread_binding_here  # here: the served wing's import closure stays as small

    check_thread_binding_here(settings.tp_size, settings.pp_size)
    memory = memory or estimate_memory(facts, settings.tp_size, settings.batch_size, settings.max_seq_len,
                                       settings.pp_size)
    if memory is None:
        return MemoryCheck([f"memory: not estimated ({facts.path} holds no .safetensors files)"])
    budget = device_budget(settings.gpu_memory_utilization)
    device = device_name_here()
    lines = []
    if settings.pp_size > 1 and getattr(settings, "ray_address", None):  # stages over the Ray cluster's GPUs
        from .ray_stages import check_ray_gpus, ray_cluster_gpus

        lines.append(check_ray_gpus(settings.tp_size, settings.pp_size, ray_cluster_gpus(settings.ray_address)))
    elif settings.pp_size > 1 and isinstance(budget, DeviceBudget) and not budget.shared:
        lines += filter(None, [check_one_host(settings.tp_size, settings.pp_size, gpus_here())])
    lines.append(check_memory(settings.model_path, memory, budget))
    cpu_kv_cache = None
    if isinstance(budget, DeviceBudget) and budget.shared:
        # vLLM's CPU backend sizes its KV cache from CPU_KV_CACHE_ENV or else from a share of the
        # host's memory, whatever the model: the estimate's size, unless the variable is set
        chosen = os.environ.get(CPU_KV_CACHE_ENV, "")
        if chosen:
            lines.append(f"KV cache: {CPU_KV_CACHE_ENV}={chosen} GiB per rank, as set in the environment")
        else:
            cpu_kv_cache = cpu_kv_cache_space(memory)
            lines.append(f"KV cache: {CPU_KV_CACHE_ENV}={cpu_kv_cache} GiB per rank, from the estimate "
                         f"({human_size(memory.kv_per_rank)} for one batch, x2, in whole GiB); set the variable to "
                         f"choose another")
    return MemoryCheck(lines, device, cpu_kv_cache)


def states_in_flight_line(settings: ModelSettings, model: ModelPlan, batches_held: int) -> str:
    """The host memory ``vllm-engine``'s states in flight take (:meth:`ModelPlan.backend_settings`'
    sequences, each of up to ``--max-seq-len`` tokens of every captured layer, its token id and,
    FP8, its scale) against the host's available memory."""
    from vllm_compat.extractor_api import host_memory

    facts = model.facts
    fp8 = settings.state_dtype == "fp8"
    token_bytes = (len(set(model.layers.ids)) * facts.hidden_size * (1 if fp8 else facts.dtype_bytes)
                   + 4 + (4 if fp8 else 0))
    return check_states_in_flight(batch_size=settings.batch_size, batches_held=batches_held,
                                  extra_sequences=settings.max_writer_threads, max_seq_len=settings.max_seq_len,
                                  token_bytes=token_bytes, available=host_memory()[0])


def audit_line(backend: str) -> str:
    """The plan's audit line: the vllm-compat audit of the installed vLLM for ``backend`` (problems
    stop the run, ``preflight.check_vllm``)."""
    return "audit: " + check_vllm(backend, backends.touchpoints_of(backend), backends.needs_speculators(backend))


def choose_backend(settings: ModelSettings, given: str = "--backend", audits: AuditsHere | None = None) -> str:
    """The plan's first line: the backend and why. ``settings.backend`` None (the default): chosen
    here (``backends.choose``: what speculators is installed, the device, the audits, kept in
    ``audits`` for the plan's audit line) and written into ``settings``, which the run follows from
    there; else as ``given`` said it."""
    if settings.backend is not None:
        return f"backend: {settings.backend} ({given})"
    from vllm_compat.extractor_api import speculators_version

    name, reason = backends.choose(speculators_version(), device_name_here(), AuditsHere() if audits is None else audits)
    settings.backend = name
    return f"backend: {name} ({reason})"


class AuditsHere(dict):
    """Backend name -> None where the vllm-compat audit of the installed vLLM passes for it, else what
    it found (:func:`audit_line`'s refusal); each audited once, when first asked."""

    def __init__(self):
        super().__init__()
        self._outcomes: dict[str, str | PreflightError] = {}  # the audit line, or its refusal

    def __missing__(self, name: str) -> str | None:
        try:
            self._outcomes[name] = audit_line(name)
        except PreflightError as exc:
            self._outcomes[name] = exc
        outcome = self._outcomes[name]
        self[name] = str(outcome) if isinstance(outcome, PreflightError) else None
        return self[name]

    def line(self, name: str) -> str:
        """:func:`audit_line` for ``name``, from the audit already made where there was one."""
        self[name]  # noqa: B018 - audits it if not yet asked
        outcome = self._outcomes[name]
        if isinstance(outcome, PreflightError):
            raise outcome
        return outcome


def settings_line(settings: ModelSettings) -> str:
    """The settings a run uses, as flags (every default applied); a run's (:class:`Settings`) with its
    scale-out and its config file, which ``serve``'s model settings have not."""
    run = settings if isinstance(settings, Settings) else None
    return (f"settings: --backend {settings.backend} --batch-size {settings.batch_size} --max-seq-len "
            f"{settings.max_seq_len} --tp-size {settings.tp_size}"
            + (f" --pp-size {settings.pp_size}" if settings.pp_size > 1 else "")
            + f" --gpu-memory-utilization "
            f"{settings.gpu_memory_utilization:g} --writer-threads {settings.writer_threads}"
            + (f" --max-writer-threads {settings.max_writer_threads}"
               if settings.max_writer_threads > settings.writer_threads else "")
            + (f" --data-parallel-size {run.data_parallel_size}" if run and run.data_parallel_size > 1 else "")
            + (f" --state-dtype {settings.state_dtype}" if settings.state_dtype != "model" else "")
            + (" --cuda-graphs" if settings.cuda_graphs else "")
            + (f" --shard {run.shard.index}/{run.shard.count}" if run and run.shard is not None else "")
            + (f" (--config {run.config_file}, flags over it)" if run and run.config_file else ""))


def device_name_here() -> str | None:
    """The device vLLM runs on here, by name (None when only its runtime could tell)."""
    try:
        from vllm_compat.extractor_api import device_name

        return device_name()
    except Exception:  # noqa: BLE001 - advisory, as the memory check's device_budget
        return None


@dataclass
class Loaded:
    """A started backend: ``backend``; ``layer_order``, where each listed layer is among those it
    captures (backends capture each layer once, in the model's order; files list them as asked);
    ``info``, what its start reported (the config records it); ``seconds``, the load's time."""

    backend: backends.Backend
    layer_order: list[int]
    info: dict
    seconds: float


def load_model(settings: ModelSettings, model_plan: ModelPlan, memory_check: MemoryCheck | None, *, log,
               batches_held: int, held: Callable[[backends.Backend], None], expected: str | None = None) -> Loaded:
    """Start ``settings.backend`` on ``model_plan`` (vLLM loads the model), then check its forward
    (``--skip-forward-check`` says it did not). ``expected``: how long the load should take, said
    as it starts. ``held`` gets the backend as soon as it is made, before it starts: whatever fails
    after, the caller closes it (vLLM's processes of a half-done start, or of a failed check, go with
    it). Call on the main thread, inside ``processes.contained()`` (vLLM's processes die
    with this one)."""
    cpu_kv_cache = memory_check.cpu_kv_cache if memory_check is not None else None
    if cpu_kv_cache is not None:  # vLLM reads it in this process, as it builds its config
        os.environ.setdefault(CPU_KV_CACHE_ENV, str(cpu_kv_cache))
    backend_settings = model_plan.backend_settings(settings, batches_held)
    backend = backends.create(settings.backend, backend_settings)
    held(backend)
    layer_order = model_plan.layer_order(backend_settings)
    started = time.monotonic()
    log(f"starting the {settings.backend} backend: vLLM loads the model" + (f" ({expected})" if expected else ""))
    info = backend.start()
    seconds = time.monotonic() - started
    log(f"model loaded in {seconds:.0f} s")
    info = info or {}
    if settings.forward_check:
        log(check_forward(backend, model_plan.facts.vocab_size))
    else:
        log("forward check skipped (--skip-forward-check): the kernels' output is not verified")
    return Loaded(backend, layer_order, info, seconds)
