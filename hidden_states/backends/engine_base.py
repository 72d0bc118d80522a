"""What the two engine backends (``vllm-engine``, ``vllm-native``) share: a ``vllm.LLM`` built in
this process and kept fed from a thread of its own (``engine_feed``).

:class:`EngineBackend` holds the start-up (the version gate from the backend's declared first
release, ``apply()`` and the adapters the backend requires, the environment, the ``LLM`` keywords
every engine backend passes, the feed), ``submit``, the forward check and ``close``. A backend
subclasses it and writes only what differs, as hooks:

* ``touchpoints``: its declared touch points (module constant ``TOUCHPOINTS``), whose ``first`` gates it;
* :meth:`~EngineBackend.prepare` (before vLLM is touched: refusals, facts for ``data_config.json``),
  :meth:`~EngineBackend.llm_keywords` (what its ``LLM`` adds), :meth:`~EngineBackend.started`
  (after the engine runs: set up the capture, more facts);
* :meth:`~EngineBackend.new_batch` and :meth:`~EngineBackend.params` (a batch and its requests'
  sampling parameters), :meth:`~EngineBackend.finished` and :meth:`~EngineBackend.failed` (a batch
  whose requests all finished, or that never will);
* :meth:`~EngineBackend.extract` and :meth:`~EngineBackend.release` (what ``close`` frees last).
"""
from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import Future

from packaging.version import Version

from vllm_compat import extractor_api

from ..errors import ExtractError
from ..processes import running
from . import ONE_BATCH_AHEAD, Backend, BackendSettings
from .engine_feed import EngineBatch, EngineFeed, step_tokens, steps_of_tokens_ahead


class EngineBackend(Backend):
    """A backend on ``vllm.LLM``'s engine (see the module's docstring for the hooks)."""

    name: str
    touchpoints: extractor_api.BackendTouchpoints
    gate_reason = ""  # what the first release brought, said when an older vLLM is refused

    # vLLM's prefix cache: off, since a cached token gets no forward and so no states; a backend that
    # fills those rows itself (vllm-engine, cached_rows.py) turns it on
    prefix_caching = False
    # vLLM eager: a capture that hooks vLLM's modules runs only when vLLM's forward runs as Python;
    # a backend whose capture is traced into the compiled forward (vllm-engine --cuda-graphs) turns it off
    enforce_eager = True

    def __init__(self, settings: BackendSettings):
        self.settings = settings
        self._llm = None
        self._feed: EngineFeed | None = None
        self.tokens_ahead = ONE_BATCH_AHEAD  # until start() knows the engine's step
        self.tokens_per_submit: int | None = None
        self._engine_processes: list = []  # the processes ``LLM()`` started here (its engine core)

    # -- start
    def start(self) -> dict:
        version = extractor_api.vllm_version()
        first = Version(self.touchpoints.first)  # the audit checks the touch points from there
        if version is None or extractor_api.base(version) < first:
            raise ExtractError(f"--backend {self.name} needs vLLM >= {first}{self.gate_reason}; the installed vLLM "
                               f"is {version}")
        facts = self.prepare(version)
        report = extractor_api.apply()  # the worker-side adapters the capture relies on
        self._check_required(report)
        self._llm, self._engine_processes = new_llm(self.settings, enforce_eager=self.enforce_eager,
                                                    prefix_caching=self.prefix_caching, **self.llm_keywords())
        self.tokens_ahead = steps_of_tokens_ahead(self._llm)
        self.tokens_per_submit = step_tokens(self._llm)
        after = self.started()
        self._feed = EngineFeed(self._llm.llm_engine, self.params, self.finished, self.failed)
        return {"backend": self.name, **facts, "vllm_compat": report.to_dict(), **after}

    def _check_required(self, report) -> None:
        """Refuse to start without an adapter the backend declared it requires: disabled or failed, as
        the shim's own ``Adapter.requires`` counts it missing."""
        off = [r for status in ("disabled", "failed") for r in report.by_status(status)
               if r.id in self.touchpoints.requires]
        if off:
            raise ExtractError(f"--backend {self.name} needs the adapter(s) {', '.join(r.id for r in off)}: "
                               + "; ".join(f"{r.id} {r.reason}" for r in off))

    def prepare(self, version) -> dict:
        """Before ``apply()`` and vLLM: refuse what cannot run; facts for ``data_config.json``."""
        return {}

    def llm_keywords(self) -> dict:
        """The keywords this backend adds to ``vllm.LLM(...)``."""
        return {}

    def started(self) -> dict:
        """After the engine runs, before the feed: set up the capture; facts for ``data_config.json``."""
        return {}

    # -- batches
    def submit(self, batch: list[list[int]]) -> Future:
        """Hand ``batch`` to the engine's feed; its future resolves once all its requests have finished."""
        work = self.new_batch(batch)
        self._feed.put(work)
        return work.future

    def extract(self, batch: list[list[int]]) -> list[list]:
        return self.submit(batch).result()

    def new_batch(self, batch: list[list[int]]) -> EngineBatch:
        return EngineBatch(batch)

    def params(self, work: EngineBatch, position: int):
        """The sampling parameters of the request at ``position`` of ``work``: one output token, greedy
        (it is discarded; a random draw makes vLLM's CPU sampler compile its kernel, seconds a process)."""
        from vllm import SamplingParams

        return SamplingParams(max_tokens=1, temperature=0.0)

    def finished(self, work: EngineBatch) -> None:
        """On the feed's thread: every request of ``work`` has finished; resolve its future."""
        raise NotImplementedError

    def failed(self, work: EngineBatch) -> None:
        """On the feed's thread: ``work`` will not finish; give back what it holds."""

    def engine_alive(self) -> bool:
        """False once a process ``LLM()`` started here (its engine core; vLLM's workers are that
        process's children, and it exits when one dies) has ended. True while they run, and where
        vLLM started none (its engine in this process)."""
        for process in self._engine_processes:
            try:
                if not process.is_alive() or not running(process.pid):
                    return False
            except ValueError:  # closed: vLLM's client closes it once it has ended
                return False
        return True

    def check_forward(self, probe: list[int]) -> list:
        from ..forward_check import verify_forward

        return verify_forward(self._llm.collective_rpc, lambda: self.extract([probe]))

    # -- close
    def close(self) -> None:
        # a feed whose engine died before this (killed; a second Ctrl-C to serve) may wait in its step
        # for good: it is not waited for long
        feed_wait = 30 if self.engine_alive() else 2
        feed, self._feed = self._feed, None
        llm, self._llm = self._llm, None
        if llm is not None:
            shut_down(llm)  # a busy feed's loop stops with the engine
            del llm
        if feed is not None:
            feed.stop(timeout=feed_wait)
        self.release()

    def release(self) -> None:
        """Last in ``close``, once the engine has stopped: free what the backend made."""


def new_llm(settings: BackendSettings, *, enforce_eager: bool, prefix_caching: bool, **keywords) -> tuple:
    """A ``vllm.LLM`` in this process on ``settings``' model, as every engine backend builds it (room for
    a row of ``max_seq_len`` tokens and the one it samples), and the processes it started here (its
    engine core); ``keywords``: what the caller adds."""
    in_process_llm_environment(enforce_eager)
    from vllm import LLM

    before = set(multiprocessing.active_children())
    if settings.pp_size > 1:  # vLLM's stages, each a process of its own (one host: its multiprocessing executor)
        keywords = {"pipeline_parallel_size": settings.pp_size, **keywords}
    llm = LLM(model=settings.model_path, tensor_parallel_size=settings.tp_size, max_model_len=settings.max_seq_len + 1,
              gpu_memory_utilization=settings.gpu_memory_utilization, enforce_eager=enforce_eager,
              enable_prefix_caching=prefix_caching, trust_remote_code=settings.trust_remote_code, **keywords)
    return llm, [p for p in multiprocessing.active_children() if p not in before]


NO_COMPILE_ENV = "TORCHDYNAMO_DISABLE"  # torch.compile() returns the function itself (read at torch's import)


def in_process_llm_environment(enforce_eager: bool = True) -> None:
    """What a backend that builds a ``vllm.LLM`` in this process sets first (unless set outside)."""
    if enforce_eager and os.environ.get(NO_COMPILE_ENV) is None:
        if extractor_api.vllm_device_type() == "cpu":
            # An eager engine compiles no model, but vLLM's CPU sampler still torch.compile()s two small
            # helpers (a sampled token's rank among the logprobs, which certificates ask for; a random
            # draw): about 10 s of each engine process's first step on a small host, most of it
            # Inductor building and loading a test program per vector instruction set, to speed up a
            # comparison and a sum. Without the compile they run as written: the same values.
            os.environ[NO_COMPILE_ENV] = "1"
    # vLLM forks its engine core unless told otherwise, and a fork after anything in this process
    # asked CUDA (a library import, a probe) cannot use CUDA: spawn, as the generators' workers do.
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    # The forward check hands the workers functions (hidden_states.forward_check) through
    # LLM.collective_rpc; vLLM's engine-core channel (a local child process) carries callables
    # only with its pickle fallback, which its own engine child reads from this variable.
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")


def shut_down(llm) -> None:
    """Stop a ``vllm.LLM``'s engine core (and its workers) now, not whenever it is collected."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()
