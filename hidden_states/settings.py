"""The extractor's settings and their defaults: the one place each default is defined.

The CLI (``cli/``) and the presets (``presets.py``) read their defaults from :class:`Settings`;
a library caller gets the same values by leaving a field out. Each command gets what it uses:
:class:`ModelSettings` (the model and how it runs) for ``serve``, with :class:`ServeSettings` (the
HTTP side); :class:`Settings` (the model's settings and the run's input, output and range) for
``extract``, ``generate`` and ``plan``.
"""
from __future__ import annotations

import os
from dataclasses import KW_ONLY, dataclass, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (a run's settings hold a Shard, made by shards.py: no code of it is needed here)
    from .shards import Shard


@dataclass
class ModelSettings:
    """The model and how it runs: what every command that loads it uses (``extract``, ``generate``,
    ``serve``). Every field but ``model_path`` is given by name.

    Attributes:
        model_path: the model's directory (a hub id resolved to its snapshot: ``model_ids.resolve``).
        batch_size: sequences per backend call.
        max_seq_len: longer samples are truncated (or refused with ``Settings.strict``).
        tp_size: tensor parallel size.
        pp_size: pipeline parallel size: the decoder layers split into this many stages, each on
            ``tp_size`` devices (``plan/pipeline.py``); a replica needs ``tp_size * pp_size`` devices.
        gpu_memory_utilization: share of device memory vLLM may use.
        layer_ids: layers to capture (speculators 0.3/0.4 convention); None: speculators' default.
        trust_remote_code: allow a model (and its tokenizer) that needs remote code.
        backend: ``backends.BACKENDS``; None: chosen per environment when the run is planned
            (``backends.choose``: ``vllm-engine`` wherever its audit passes, else the generator), and
            written here then; format: ``formats.FORMATS``, None: what the installed
            speculators trains on (``layer_conventions.default_format``).
        state_dtype: how states are stored (``fp8_states.STATE_DTYPES``): ``model``, as the model
            computes them; ``fp8``, float8_e4m3fn with one scale per token (speculators-0.5 only).
        writer_threads: threads writing files; None: the backend's own number
            (``BACKEND_DEFAULTS``), else ``BACKEND_DEPENDENT``'s.
        max_writer_threads: threads the writer may grow to while the run waits on it; None: the
            backend's own number, else half the cores, at most ``WRITER_THREADS_CAP``.
        forward_check: self-test the model's kernels after the load.
        certificates: certify each row before it is written (``certify``): the engine's logprobs at a
            few of its positions against its written last-layer state; a row that fails stops the run.
        overlap: run the next batch's forward while this batch's states are copied out of vLLM
            (the ``speculators`` backend; ``backends/overlap.py``); False: one batch at a time.
        share_prefixes: a row that is an exact prefix of another row of its batch is written from
            that row's states, not extracted (``prefixes.py``); False: every row extracted whole.
        cuda_graphs: run vLLM's compiled forward and CUDA graphs, the capture's copies inside them
            (``--backend vllm-engine`` only: ``backends/worker/graph_capture.py``); False: vLLM runs eager.
    """

    model_path: str
    _: KW_ONLY
    batch_size: int = 4
    max_seq_len: int = 2048
    tp_size: int = 1
    pp_size: int = 1
    gpu_memory_utilization: float = 0.80
    layer_ids: list[int] | None = None
    trust_remote_code: bool = False
    backend: str | None = None
    format: str | None = None
    state_dtype: str = "model"
    writer_threads: int | None = None
    max_writer_threads: int | None = None
    forward_check: bool = True
    certificates: bool = True
    overlap: bool = True
    share_prefixes: bool = True
    cuda_graphs: bool = False

    def __post_init__(self):
        for name in BACKEND_DEPENDENT:
            if getattr(self, name) is None:
                setattr(self, name, default(name, self.backend))
        if self.max_writer_threads is None:
            self.max_writer_threads = BACKEND_DEFAULTS.get(self.backend or AUTO_BACKENDS[0], {}).get(
                "max_writer_threads", max(1, min(WRITER_THREADS_CAP, (os.cpu_count() or 2) // 2)))
        self.max_writer_threads = max(self.max_writer_threads, self.writer_threads)

    @classmethod
    def tuned(cls, backend: str | None, preset: dict | None = None, given: dict | None = None, **fields_):
        """Settings whose tunables come, in this order of precedence, from ``given`` (the flags),
        else ``backend``'s own default, else ``preset``, else the field's default."""
        # the backend's own defaults are applied where a library caller's are (__post_init__): the
        # preset's value of such a setting is left out, so that the backend's comes in its place
        own = BACKEND_DEFAULTS.get(backend or AUTO_BACKENDS[0], {})
        kept = {name: value for name, value in (preset or {}).items() if name not in own}
        return cls(backend=backend, **{**kept, **(given or {})}, **fields_)


@dataclass
class Settings(ModelSettings):
    """One extraction (``extract``, ``generate``, ``plan``): the model's settings, and what to read,
    where to write, which samples, how the run is spread. Every field after ``model_path``,
    ``prepared_data`` and ``output_dir`` is given by name.

    Attributes:
        prepared_data: the input; output_dir: where the sample files go.
        max_samples, start_index: the range of sample indices to extract.
        strict: refuse a sample longer than ``max_seq_len`` (and, for conversations, a turn whose role
            is unknown) instead of truncating it.
        writer_queue: samples allowed to wait for the disk before the loop blocks.
        progress_interval: seconds between progress lines when stderr is not a terminal.
        shard: this process's static shard (``shards.Shard``); None: every sample.
        data_parallel_size: replicas of the model, each a Ray actor (``replicas/``); 1: this process.
        ray_address: the Ray cluster the replicas run on (``auto``, ``host:port``); None: a local one.
        start_over: replace another extraction the output directory holds, finished samples and
            all (its files are removed); without it such a directory is refused.
        config_file: the TOML file the CLI read settings from (flags over it; ``config_file.py``);
            recorded with the rest in ``data_config.json``.
    """

    prepared_data: str
    output_dir: str
    _: KW_ONLY
    max_samples: int | None = None
    start_index: int = 0
    strict: bool = False
    writer_queue: int = 64
    progress_interval: float = 10.0
    shard: Shard | None = None
    data_parallel_size: int = 1
    ray_address: str | None = None
    start_over: bool = False
    config_file: str | None = None

    @property
    def end_index(self) -> int | None:
        """The end of the range of sample indices (exclusive): ``start_index + max_samples``; None: the
        input's end."""
        return self.start_index + self.max_samples if self.max_samples is not None else None

    def in_range(self, index: int) -> bool:
        """Whether the sample (or conversation) at ``index`` of the input is in the range this run
        extracts, finished or not: ``start_index <= index < end_index``."""
        end = self.end_index
        return index >= self.start_index and (end is None or index < end)

    def record(self) -> dict:
        """Every setting as the run used it (defaults applied), the model's and the run's, for
        ``data_config.json``."""
        record = {f.name: getattr(self, f.name) for f in fields(self)}
        record["shard"] = f"{self.shard.index}/{self.shard.count}" if self.shard is not None else None
        return record


# Settings whose default a backend may set (the field says None): their default for the others.
BACKEND_DEPENDENT: dict[str, object] = {"writer_threads": 2}

# A backend's own defaults: a caller leaving the field out gets them (over a preset's values, under
# the flags: Settings.tuned). Each is a setting whose field says None, filled by Settings.__post_init__.
BACKEND_DEFAULTS: dict[str, dict] = {
    # vLLM's connector saves every state on the host's CPUs and memory, inside the engine step or on
    # threads of its own, so whatever else writes slows the engine down: one writer thread keeps up
    # with the rate its states arrive at, and the files queued at the end are drained by more
    # (measured: docs/performance.md, "The extractor's defaults").
    "vllm-native": {"writer_threads": 1, "max_writer_threads": 1},
}

# The most writer threads a run grows to by default (the other half of the cores and more stay with
# vLLM's processes, the parent's copies, the engine loop).
WRITER_THREADS_CAP = 8


# The backends a run that names none may run on (``backends.choose``): their own defaults are the same,
# so a setting's default holds before the plan has chosen one of them.
AUTO_BACKENDS = ("vllm-engine", "speculators")


def default(name: str, backend: str | None = None):
    """The default of the setting ``name``; for a backend-dependent one, ``backend``'s (None: the
    backend chosen per environment, whichever of ``AUTO_BACKENDS`` it is)."""
    if name in BACKEND_DEPENDENT:
        return BACKEND_DEFAULTS.get(backend or AUTO_BACKENDS[0], {}).get(name, BACKEND_DEPENDENT[name])
    for field in fields(Settings):
        if field.name == name:
            return field.default
    raise KeyError(name)


# `hidden-states serve`'s defaults for the extractor's settings, under a preset's and the flags: a
# server gathers many clients' rows into one submit, and its region pool (3 batches and the writers'
# rows, ``planner.ModelPlan.backend_settings``) is what it can hold before requests wait.
SERVE_DEFAULTS: dict = {"batch_size": 32, "writer_threads": 4}


@dataclass
class ServeSettings:
    """What ``hidden-states serve`` adds to the extractor's settings: the HTTP side.

    Attributes:
        host, port: where it listens.
        served_model_name: the id ``/v1/models`` lists (the trainer's ``--verifier-name-or-path``);
            None: ``model_ids.served_name`` of ``--model-path`` (a hub id as given, a directory's
            name, never its path).
        states_dir: where the states' files go until the client collects them; None: the user's
            private default (``serve.state_files.default_directory``).
        api_key: the key every request but ``/health`` must carry (``Authorization: Bearer KEY``, or
            HTTP Basic with KEY as the password); None: none asked.
        keep_alive_timeout: seconds a connection may stay idle, or stall mid-request, before the
            server closes it.
        max_connections: connections open at once; one more takes the place of one idle between
            requests, else is answered 503 and closed.
        sweep_after: seconds a file may wait for its client before it is removed.
        gather_window: seconds the gatherer waits for more rows after the first of a batch.
        engine_tokens: the most tokens of requests in the engine at once (the rest wait in the
            server's queue); None: ``ENGINE_STEPS_HELD`` of the engine's steps; 0: no limit but the
            backend's regions.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    states_dir: str | None = None
    sweep_after: float = 600.0
    gather_window: float = 0.005
    engine_tokens: int | None = None
    api_key: str | None = None
    keep_alive_timeout: float = 5.0  # what `vllm serve` (uvicorn) closes idle connections after
    max_connections: int = 512


# engine steps of tokens `hidden-states serve` keeps in vLLM's engine: about what `extract` keeps
# there at its best (a batch of 32 rows of 2,048 and three steps ahead); more only wait in vLLM's
# scheduler (docs/reports/2026-12-04-serve-vs-vllm-serve.md, "`hidden-states serve` against `vllm serve`")
ENGINE_STEPS_HELD = 8
