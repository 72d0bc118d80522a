"""vLLM's engine kept fed from a queue of batches, on a thread of its own (``--backend vllm-engine``
and ``--backend vllm-native``).

``LLM.generate`` runs one batch to its end: between two calls the engine empties, and the GPU waits
while the last outputs come back and the next requests go in. Here ``vllm.LLM``'s own engine
(``LLMEngine``: its scheduler and engine-core process) takes requests as they come: the next batch's
requests enter while the last ones of the batch before still run. Each batch is resolved by its
backend once every one of its requests has finished.
"""
from __future__ import annotations

import itertools
import queue
import threading
from concurrent.futures import Future
from typing import Callable

from vllm_compat.extractor_api import OPTIONAL, PRESENT, REQUIRED, Attr, Exists, Param

STOP = object()
ENGINE = "vllm.v1.engine.llm_engine:LLMEngine"
GIVEN = frozenset({REQUIRED, OPTIONAL})  # a parameter we pass: there, whether or not it has a default


def present(target: str, *names: str) -> list:
    """Touch points: the attributes ``names`` of ``target``, expected present."""
    return [(Attr(target, name), frozenset({PRESENT})) for name in names]


# What the feed touches in vLLM (both engine backends declare it among their touch points): requests
# in by keyword, steps out, each request's output told by its id.
FEED_TOUCHPOINTS = [
    *[(Param(f"{ENGINE}.add_request", name), GIVEN) for name in ("request_id", "prompt", "params")],
    *present(ENGINE, "step", "has_unfinished_requests"),
    (Exists("vllm.inputs:TokensPrompt"), frozenset({PRESENT})),
    *present("vllm.sampling_params:SamplingParams", "max_tokens"),
    *[(Param("vllm.outputs:RequestOutput.__init__", name), GIVEN) for name in ("request_id", "finished")],
    # how many tokens make an engine step (the extraction keeps STEPS_AHEAD steps' worth submitted ahead)
    *present("vllm.config.scheduler:SchedulerConfig", "max_num_batched_tokens"),
]


# engine steps of tokens the extraction keeps submitted beyond the batch it waits for: the step
# running, the one vLLM schedules while it runs (async scheduling), and one more: a batch submitted
# while the feed waits on a step enters the engine only when that step ends (two leave steps
# scheduled half full: docs/performance.md, "The extractor's defaults")
STEPS_AHEAD = 3


def step_tokens(llm) -> int:
    """The most tokens one of the engine's steps runs: its scheduler's token budget. The engine
    backends' ``tokens_per_submit``: a group of that size finishes in about one step."""
    return llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens


def steps_of_tokens_ahead(llm) -> int:
    """The engine backends' ``tokens_ahead``: ``STEPS_AHEAD`` of the engine's steps (its scheduler's
    token budget each), whatever the batches' lengths. With pipeline stages vLLM keeps one batch in
    flight per stage (each stage runs another step at once), so the feed keeps one more step ahead
    for each stage past the first: otherwise the later stages would wait for work to be submitted."""
    parallel = getattr(llm.llm_engine.vllm_config, "parallel_config", None)
    stages = getattr(parallel, "pipeline_parallel_size", 1) or 1
    return (STEPS_AHEAD + stages - 1) * step_tokens(llm)


class EngineBatch:
    """A batch of prompts in the engine: its future, and each finished request's output by position."""

    def __init__(self, ids: list[list[int]], cache_salt: str | None = None):
        self.ids = ids
        self.cache_salt = cache_salt  # vLLM's prefix cache shares blocks only among requests of one salt
        self.future: Future = Future()
        self.finished: dict[int, object] = {}  # batch position -> the engine's RequestOutput
        self.failed = False
        self.probes: list[list[int]] | None = None  # a certified batch's: each row's positions to probe
        self.cached: list[int] | None = None  # each row's first position computed (before: vLLM's prefix cache)

    def salt(self, position: int) -> str | None:
        """The cache salt of the request at ``position`` (the batch's; a batch may give each its own)."""
        return self.cache_salt


class EngineFeed:
    """Adds each batch's requests to ``engine`` and steps it on a thread of its own.

    Args:
        engine: a ``vllm.LLM``'s ``llm_engine``.
        params: ``(batch, position) -> SamplingParams`` of that prompt's request.
        finished: called on the feed's thread with a batch whose requests have all finished; it
            resolves the batch's future (or hands that on) and must not block for long.
        failed: called once with a batch that will not finish, before its future fails (to give back
            what the batch holds).
    """

    def __init__(self, engine, params: Callable, finished: Callable[[EngineBatch], None],
                 failed: Callable[[EngineBatch], None] = lambda batch: None, name: str = "hidden-states-engine"):
        self._engine, self._params, self._finished, self._failed = engine, params, finished, failed
        self._incoming: queue.Queue = queue.Queue()
        self._numbers = itertools.count()
        self._failing = threading.Lock()
        self.failure: BaseException | None = None
        self._thread = threading.Thread(target=self._drive, name=name, daemon=True)
        self._thread.start()

    def put(self, batch: EngineBatch) -> None:
        """Queue ``batch`` for the engine; if the loop has stopped, fail it at once (its future
        carries the loop's error, and ``failed`` gives back what the batch holds)."""
        self._incoming.put(batch)
        if self.failure is not None:  # the loop may have stopped after it last looked at the queue
            self.fail(batch, self.failure)

    def fail(self, batch: EngineBatch, exc: BaseException) -> None:
        """Fail a batch the engine will not finish (once, whoever asks)."""
        with self._failing:
            if batch.failed:
                return
            batch.failed = True
        self._failed(batch)
        batch.future.set_exception(exc)

    def stop(self, timeout: float) -> None:
        """Ends an idle loop at once, a busy one when the engine stops; waits up to ``timeout`` s."""
        self._incoming.put(STOP)
        self._thread.join(timeout=timeout)

    def _drive(self) -> None:
        from vllm.inputs import TokensPrompt

        engine = self._engine
        running: dict[str, tuple[EngineBatch, int]] = {}
        try:
            while True:
                batch = self._incoming.get() if not running else self._next_nowait()
                while batch is not None:
                    if batch is STOP:
                        return
                    number = next(self._numbers)
                    for position, ids in enumerate(batch.ids):
                        request_id = f"hs-{number}-{position}"
                        prompt = TokensPrompt(prompt_token_ids=ids)
                        if (salt := batch.salt(position)) is not None:
                            prompt["cache_salt"] = salt
                        # expected before it is added: a batch with a request vLLM refuses is failed with the rest
                        running[request_id] = (batch, position)
                        engine.add_request(request_id=request_id, prompt=prompt, params=self._params(batch, position))
                    batch = self._next_nowait()
                if not engine.has_unfinished_requests():
                    raise RuntimeError(f"vLLM's engine holds none of the {len(running)} requests still expected")
                for output in engine.step():
                    if output.finished and output.request_id in running:
                        batch, position = running.pop(output.request_id)
                        batch.finished[position] = output
                        if len(batch.finished) == len(batch.ids):
                            self._finished(batch)
                        batch = None  # an idle loop holds no batch, nor what its states keep
        except BaseException as exc:  # noqa: BLE001 - every waiting batch hears of it
            self.failure = exc
            for batch, _ in running.values():
                self.fail(batch, exc)
            while (batch := self._next_nowait()) not in (None, STOP):
                self.fail(batch, exc)

    def _next_nowait(self):
        try:
            return self._incoming.get_nowait()
        except queue.Empty:
            return None
