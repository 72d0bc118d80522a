"""A loop of our own on vLLM's engine, with a capture in its workers: no generator, nothing per batch.

The ``speculators`` backend runs the generator's loop, which drives vLLM one call at a time: every
call ends with all of its states copied out before the next begins (overlapped two at a time, still
a pause at each end, and at batch 32 a whole call's files to write after the last forward). Here
vLLM's own engine (``vllm.LLM``'s ``LLMEngine``: its scheduler, its async scheduling, its engine-core
process) runs continuously, and the states stream:

* each request gets a region of a shared segment (``RegionPool``) when it is submitted; the worker
  (``engine_capture.StreamingStates``) copies the request's rows there as each step computes them;
* the rows come from speculators 0.3/0.4's capture where it is installed (``speculators_capture``:
  the shim's adapters stay exercised), else from the extractor's own (``own_capture``: hooks on vLLM's
  decoder layers); ``VLLM_COMPAT_ENGINE_CAPTURE`` (``own`` / ``speculators``) chooses one outright;
* a request that the engine reports finished has all its states in its region already: the batch
  it belongs to resolves with tensors that *are* those regions (one per layer, no copy), which the
  extraction hands to the writer, and the region returns to the pool when the last of them is gone;
* the feed (``engine_feed.EngineFeed``) keeps the engine fed: the next batch's requests are in the
  engine while the previous batch's last ones still run, so the GPU does not wait between batches.

With shared prefixes (the default; ``--no-shared-prefix`` turns it off) vLLM's prefix cache is on:
a request whose first blocks another request of its batch computed runs only past them, and its
first rows are copied from that request's region before the batch resolves (``cached_rows``; each
batch under a cache salt of its own, so that its requests share blocks only with one another).

Correctness guards, before any tensor leaves the backend: the engine's prompt ids must be the
submitted ones; the region's row count must be the prompt's length (never stale rows); and the token
id the worker stored beside every row, from the same forward row as its states, must be the prompt's
token at that position (never another request's rows). A request failing one fails its batch.

``hidden-states generate``'s replies and their training rows (``backends.Replying``) are the work of
``engine_replies.EngineReplies``, which the backend composes and hands the prompts and rows it
resolves; the backend keeps the regions (``pool``, ``region_bytes``, ``copy_rows``, ``_states``).
"""
from __future__ import annotations

import itertools
import os
from concurrent.futures import Future

from vllm_compat.extractor_api import PRESENT, BackendTouchpoints, Exists, Param

from .. import fp8_states
from ..errors import UsageError
from . import Reply, Sampling, witnessed
from .cached_rows import fill_order
from .engine_base import EngineBackend
from .engine_feed import FEED_TOUCHPOINTS, GIVEN, present

from .engine_replies import EngineReplies, PromptWork, RegionBatch, RowWork, discard_rows_streams
from .shared.graph_store import LAYERS_ENV, report_line
from .region_transport import new_nonce, open_transport, sink_info, stage_slots
from .stage_layers import STAGE_TOUCHPOINTS, executor_keywords, merge_stage_replies, ray_stages, refuse_pipeline
from .shared.regions import REGION, Countdown, RegionPool, layer_start, region_bytes, scales_start

_OUTPUT = "vllm.v1.core.sched.output"
# What this backend touches in vLLM, from its first release, and the adapter it cannot run without:
# the worker (engine_capture) reads the forward's row order through the shim's batch order, which
# under Model Runner V2 only the v2_batch_order adapter notes. The audit and the preflight read it here.
TOUCHPOINTS = BackendTouchpoints("0.11.0", tuple([
    *FEED_TOUCHPOINTS,
    # the region of each request travels to the worker in its sampling parameters; the parent
    # compares each finished request's prompt with the one it submitted
    *present("vllm.sampling_params:SamplingParams", "extra_args"),
    (Param("vllm.outputs:RequestOutput.__init__", "prompt_token_ids"), GIVEN),
    *witnessed.WITNESS_TOUCHPOINTS,  # a certified row's witness
    # LLM(worker_extension_cls=...) reaches EngineArgs; collective_rpc(method, args=...) the workers
    *present("vllm.engine.arg_utils:EngineArgs", "worker_extension_cls"),
    (Param("vllm.entrypoints.llm:LLM.collective_rpc", "args"), GIVEN),
    # the worker (worker/engine_capture.py): execute_model's scheduler output says whose rows go where
    (Param("vllm.v1.worker.gpu_worker:Worker.execute_model", "scheduler_output"), GIVEN),
    # --cuda-graphs (worker/graph_capture.py): the copies go onto the model as Worker.load_model returns, before
    # vLLM's first forward compiles it (wrapped on the class, which the CPU worker loads through)
    *present("vllm.v1.worker.gpu_worker:Worker", "load_model"),
    *present(f"{_OUTPUT}:SchedulerOutput", "scheduled_new_reqs", "scheduled_cached_reqs",
             "num_scheduled_tokens", "finished_req_ids"),
    *present(f"{_OUTPUT}:NewRequestData", "req_id", "prompt_token_ids", "sampling_params",
             "num_computed_tokens"),
    *present(f"{_OUTPUT}:CachedRequestData", "req_ids", "num_computed_tokens"),
    (Exists("vllm.distributed:get_tp_group"), frozenset({PRESENT})),
    *STAGE_TOUCHPOINTS,  # each pipeline stage captures its own layers; their executor (stage_layers)
    # the own capture (worker/own_capture.py) hooks the decoder layers and wraps the decoder stack's forward,
    # whose input ids and positions both captures' rows are checked with (vLLM's Llama stands for the
    # decoder models: a stack's `layers` and `start_layer`/`end_layer` are set in __init__, which the
    # end-to-end runs prove)
    *[(Param("vllm.model_executor.models.llama:LlamaModel.forward", name), GIVEN)
      for name in ("input_ids", "positions")],
]), requires=("v2_batch_order",))
ROWS_TIMEOUT = 30.0  # seconds a finished request's rows may take to land in its region
# The worker side, named to vLLM (worker_extension_cls): its workers import it, this process need not.
OWN, SPECULATORS = "own", "speculators"
EXTENSIONS = {SPECULATORS: f"{__package__}.worker.speculators_capture.StreamingCapture",
              OWN: f"{__package__}.worker.own_capture.OwnStreamingCapture"}
# --cuda-graphs: the own capture, its copies traced into vLLM's compiled forward (worker/graph_capture.py)
GRAPH_EXTENSION = f"{__package__}.worker.graph_capture.GraphStreamingCapture"
CAPTURE_ENV = "VLLM_COMPAT_ENGINE_CAPTURE"  # own or speculators; unset: speculators' where 0.3/0.4 is installed


def chosen_capture(environ=os.environ) -> tuple[str, str]:
    """(which capture the workers run, why): ``CAPTURE_ENV`` where set, else speculators' when an
    in-process speculators release (0.3/0.4) is installed, else the extractor's own."""
    from vllm_compat.extractor_api import IN_PROCESS_SPECULATORS, speculators_version

    from . import in_process_generator

    installed = speculators_version()
    has_capture = installed is not None and in_process_generator(installed)
    asked = environ.get(CAPTURE_ENV, "")
    if asked:
        if asked not in EXTENSIONS:
            raise UsageError(f"{CAPTURE_ENV}={asked}: expected {' or '.join(EXTENSIONS)}")
        if asked == SPECULATORS and not has_capture:
            raise UsageError(f"{CAPTURE_ENV}={asked}: speculators' capture needs speculators {IN_PROCESS_SPECULATORS}, "
                             f"{f'found {installed}' if installed else 'it is not installed'}")
        return asked, f"{CAPTURE_ENV}={asked}"
    if has_capture:
        return SPECULATORS, f"speculators {installed} is installed"
    return OWN, f"speculators {installed} has no in-process capture" if installed else "speculators is not installed"


def refuse_cuda_graphs(backend: str, environ=os.environ) -> None:
    """``--cuda-graphs`` where it cannot run: another backend than this one, or speculators' capture
    asked for (its capture is a patched forward, not traced into vLLM's compiled one). The plan checks
    it (``planner.plan_model``), once: a run's plan (``RunPlan``) holds only settings that passed,
    and the backend, in whichever process executes the plan (a Ray replica's), does not ask again."""
    if backend != "vllm-engine":
        raise UsageError(f"--cuda-graphs: needs --backend vllm-engine (its own capture is the one traced into vLLM's "
                         f"compiled forward), not --backend {backend}")
    if environ.get(CAPTURE_ENV) == SPECULATORS:
        raise UsageError(f"--cuda-graphs: runs the extractor's own capture, not speculators' "
                         f"({CAPTURE_ENV}={SPECULATORS}): unset {CAPTURE_ENV} or set it to {OWN}")


def needs_speculators() -> bool:  # this backend runs speculators' capture here: the preflight audits its generator
    return chosen_capture()[0] == SPECULATORS


def graph_capture_environment(layer_ids: list[int], environ=os.environ) -> None:
    """What vLLM's workers need, before the engine starts, to run ``--cuda-graphs``' capture: the
    layers (the copies go onto the model at its load, before any call reaches the workers), and
    vLLM's compile cache off. Why off: vLLM loads a cached compiled forward (its AOT artifact and
    inductor's) by a hash of its configuration, not of the hooks on the modules, so an artifact
    compiled without the copies (a plain vLLM run of the same model and settings) would be loaded
    and run, its buffers never written: the rows would be stale or zero, silently."""
    environ[LAYERS_ENV] = ",".join(str(layer) for layer in sorted(set(layer_ids)))
    environ["VLLM_DISABLE_COMPILE_CACHE"] = "1"


class VllmEngineBackend(EngineBackend):
    name = "vllm-engine"
    touchpoints = TOUCHPOINTS
    certifies = True

    def __init__(self, settings):
        super().__init__(settings)
        self.prefix_caching = settings.share_prefixes
        self._salts = itertools.count()
        self.cached_tokens = 0  # prompt tokens vLLM's prefix cache held, their rows copied from another request
        self.pool: RegionPool | None = None
        self.sink = None  # the region sink of stages on other hosts (region_transport)
        # hidden-states generate's side (backends.Replying): replies, then their training rows, on these regions
        self.replies = EngineReplies(self)
        self._layout: dict | None = None
        self.scales = False  # FP8 states: quantized in the worker, a scale per row after the token ids
        self.blocks = 1  # capturing pipeline stages: a counter block and a token-id array each in every region
        self.rows_timeout = ROWS_TIMEOUT
        self.capture = SPECULATORS
        self.enforce_eager = not settings.cuda_graphs

    def prepare(self, version) -> dict:
        """Choose the capture (before ``apply()``: speculators' needs its adapters armed). With
        ``cuda_graphs`` the own capture, whatever ``CAPTURE_ENV`` says: the run's plan refused the
        conflict (``refuse_cuda_graphs``, once), and its settings reach every process that runs it.
        Pipeline stages: the own capture, what cannot run with them refused (``refuse_pipeline``)."""
        refuse_pipeline(self.settings, os.environ.get(CAPTURE_ENV, ""), SPECULATORS)
        if self.settings.cuda_graphs:
            self.capture = OWN
            graph_capture_environment(self.settings.layer_ids)
            return {"capture": OWN, "capture_chosen_because": "--cuda-graphs (its copies inside vLLM's compiled "
                                                              "forward and CUDA graphs)"}
        self.capture, why = (OWN, f"--pp-size {self.settings.pp_size}") if self.settings.pp_size > 1 else chosen_capture()
        return {"capture": self.capture, "capture_chosen_because": why}

    def llm_keywords(self) -> dict:
        return {"worker_extension_cls": GRAPH_EXTENSION if self.settings.cuda_graphs else EXTENSIONS[self.capture],
                **executor_keywords(self.settings)}

    def started(self) -> dict:
        """Install the capture in the workers and map them the region pool."""
        import torch

        settings = self.settings
        replies = self._llm.collective_rpc("_hidden_states_stream_setup",
                                           args=(settings.layer_ids, settings.state_dtype))
        self._layout, stages = merge_stage_replies(replies, settings.layer_ids)  # one reply per pipeline stage
        self.blocks, self.scales = len(stages), bool(self._layout.get("scales"))
        self.prefix_hit_tokens = (self._layout.get("prefix_hit_tokens") or 1) if self.prefix_caching else 1
        self.row_bytes = self._layout["hidden_size"] * getattr(torch, self._layout["dtype"]).itemsize
        self.pool = RegionPool(self.pool_bytes(), align=self.row_bytes, stages=tuple(stages), nonce=new_nonce())
        self.sink, transport = open_transport(self.pool, stage_slots(replies, settings.layer_ids, stages),
                                              self.row_bytes, self.scales, on_ray=ray_stages(settings))
        pinned = next(r for r in self._llm.collective_rpc("_hidden_states_stream_to",
                                                          args=(self.pool.path, stages, transport)) if r is not None)
        where = os.path.dirname(self.pool.path)  # /dev/shm, else the temporary directory (regions_root)
        self.pool.unlink()  # the worker and this process hold it mapped: no name left to leak
        return {"states_page_locked": pinned, "states_segment": {"bytes": self.pool.capacity, "in": where},
                "prefix_hit_tokens": self.prefix_hit_tokens, **sink_info(self.sink)}

    def pool_bytes(self) -> int:
        """The held sequences (awaited, queued for the writer), the tokens submitted ahead and, certified,
        as many again: rows wait for their probes, run behind those (witnessed.py)."""
        ahead = self.tokens_ahead * (2 if self.settings.certificates else 1)
        return self.settings.sequences_in_flight * self.region_bytes(self.settings.max_seq_len) + self.region_bytes(ahead)

    def region_bytes(self, length: int) -> int:
        return region_bytes(length, len(self.settings.layer_ids), self.row_bytes, self.scales, self.blocks)

    def new_batch(self, batch: list[list[int]]) -> RegionBatch:
        """Reserve each sequence's region (waits while the writer still holds too many states)."""
        self.check_feed()
        offsets = [self.pool.reserve(self.region_bytes(len(ids)), timeout=600.0) for ids in batch]
        return RegionBatch(batch, offsets, f"hs-{next(self._salts)}" if self.prefix_caching else None)

    def extract(self, batch: list[list[int]]) -> list[list]:
        """``submit`` for callers that keep what they get: copies (FP8 dequantized), regions back at once."""
        return [[fp8_states.dequantize(layer.unsqueeze(1), layers.scales)[:, 0] for layer in layers]
                if isinstance(layers, fp8_states.Quantized) else [layer.clone() for layer in layers]
                for layers in self.submit(batch).result()]

    # -- hidden-states generate (backends.Replying): the reply side's, on this backend's regions
    def answer(self, prompt: list[int], sampling: Sampling, stream=None, certified: bool = False) -> Future:
        return self.replies.answer(prompt, sampling, stream, certified)

    def row_states(self, rows: list[list[int]], sources: list[Reply], certified: bool = False) -> Future:
        return self.replies.row_states(rows, sources, certified)

    def release_replies(self, replies: list[Reply]) -> None:
        self.replies.release_replies(replies)

    # the reply side's counters (``Replying``), read where they grow
    reply_rows_reused = property(lambda self: self.replies.reply_rows_reused)
    rows_from_replies = property(lambda self: self.replies.rows_from_replies)
    rows_in_place = property(lambda self: self.replies.rows_in_place)

    # -- what the reply side (EngineReplies) uses beside the regions' pool, row bytes, scales and copy_rows
    @property
    def layer_count(self) -> int:
        return len(self.settings.layer_ids)

    def next_salt(self) -> int:
        return next(self._salts)

    def put(self, work: RegionBatch) -> None:
        self._feed.put(work)

    def check_feed(self) -> None:
        if self._feed.failure is not None:
            raise RuntimeError(f"the engine loop has stopped: {self._feed.failure}") from self._feed.failure

    def submit_certified(self, batch: list[list[int]], probes: list[list[int]]) -> Future:
        work = self.new_batch(batch)
        work.probes = probes
        self._feed.put(work)
        return work.future

    def params(self, work: RegionBatch, position: int):
        from vllm import SamplingParams

        if isinstance(work, witnessed.ProbeBatch):
            return witnessed.params()
        region = {REGION: (work.offsets[position], work.lengths[position], work.counters[position])}
        if isinstance(work, PromptWork):
            return self.replies.params(work, region)
        if work.probes is not None:
            return witnessed.params(region)
        # greedy: the token is discarded, and a random draw makes vLLM's CPU sampler compile its kernel
        return SamplingParams(max_tokens=1, temperature=0.0, extra_args=region)

    def failed(self, work: RegionBatch) -> None:
        if isinstance(work, witnessed.ProbeBatch):
            return  # its states hold their regions (released as they go); its batch hears the error
        for offset in work.offsets:
            self.replies.discard_stream(offset)
            self.pool.release(offset)
        discard_rows_streams(work)

    def finished(self, work: RegionBatch) -> None:
        if isinstance(work, witnessed.ProbeBatch):
            witnessed.finished(work)
            return
        if isinstance(work, PromptWork):
            self.replies.answered(work)
            return
        states: list = []
        try:
            if isinstance(work, RowWork):
                self.replies.fill_from_replies(work)
            elif self.prefix_caching:
                self._fill_cached_rows(work)
            for position in range(len(work.ids)):
                states.append(self._states(work, position))
            # a certified training row's witness: its reply's logprobs (engine_replies)
            witnesses = self.replies.witnesses(work) if isinstance(work, RowWork) and work.certified else None
        except Exception as exc:  # noqa: BLE001 - the batch fails, the loop goes on
            for position in range(len(states), len(work.ids)):  # regions no tensor will release
                self.pool.release(work.offsets[position])
            discard_rows_streams(work)
            states.clear()  # the exception's traceback keeps this frame: its tensors must not keep their regions
            work.future.set_exception(exc)
        else:
            if work.probes is not None:
                witnessed.resolve(work, states, self._feed.put)
            elif witnesses is not None:
                work.future.set_result(list(zip(states, witnesses, strict=True)))
            else:
                work.future.set_result(states)

    def _fill_cached_rows(self, work: RegionBatch) -> None:
        """Copy into each region the first rows vLLM's prefix cache spared its request, from the region
        of the request of the batch that computed them (``cached_rows.fill_order``). A region whose rows
        are not all stored is left to ``_states``, which names it."""
        lengths = [len(ids) for ids in work.ids]
        stored = [self.pool.rows_stored(offset, length, timeout=self.rows_timeout) == length
                  for offset, length in zip(work.offsets, lengths)]
        first = [self.pool.first_row(offset) if whole else 0 for offset, whole in zip(work.offsets, stored)]
        work.cached = first  # a certified batch also probes the last row each took from another (witnessed.py)
        for position, source in fill_order(work.ids, first):
            self.copy_rows(work.offsets[position], lengths[position], work.offsets[source], lengths[source],
                            first[position])
            self.cached_tokens += first[position]

    def copy_rows(self, into: int, into_length: int, source: int, source_length: int, rows: int) -> None:
        """Copy the first ``rows`` rows (every stage's token ids, FP8 scales, every layer) of the region at
        ``source`` (laid out for ``source_length`` rows) into the region at ``into`` (``into_length`` rows)."""
        self.pool.copy_rows(into, into_length, source, source_length, rows, self.row_bytes,
                            len(self.settings.layer_ids), self.scales)

    def _states(self, work: RegionBatch, position: int) -> list:
        """The request's layers as tensors over its region, once its rows are checked; the region is
        released when every one of them has been garbage collected."""
        import torch

        ids, offset, length = work.ids[position], work.offsets[position], work.lengths[position]
        output = work.finished[position]
        if list(output.prompt_token_ids) != ids:
            raise RuntimeError(f"vLLM's request at batch position {position} holds other token ids")
        stored = self.pool.rows_stored(work.counts_at(position), len(ids), timeout=self.rows_timeout)
        if stored != len(ids):
            raise RuntimeError(f"the worker stored {stored} of {len(ids)} rows for batch position {position}")
        wrong = self.pool.ids_disagree(offset, length, ids)
        if wrong is not None:
            raise RuntimeError(f"the states stored for batch position {position} come from other tokens' rows "
                               f"({wrong}): the worker attributed rows to the wrong request")
        dtype, hidden = getattr(torch, self._layout["dtype"]), self._layout["hidden_size"]
        count = len(self.settings.layer_ids)
        # released once no tensor over any of its bytes is left: the writer's rows cut from these included
        release = Countdown(count + (1 if self.scales else 0), self.pool.release, offset)
        layers = [self.pool.view(offset + layer_start(length, index, self.row_bytes, self.scales, self.blocks), dtype,
                                  len(ids) * hidden, on_free=release).view(len(ids), hidden)
                  for index in range(count)]
        if self.scales:
            scales = self.pool.view(offset + scales_start(length, self.blocks), torch.float32, len(ids), on_free=release)
            layers = fp8_states.Quantized(layers, scales.view(-1, 1, 1))
        return layers

    def close(self) -> None:
        """``--cuda-graphs``: first ask the capturing worker whether its copies ran inside vLLM's
        compiled forward (``closing_line``), while the engine still runs."""
        if self.sink is not None:  # the stages' connections end with the engine: not a failure now
            self.sink.close()
        if self.settings.cuda_graphs and self._llm is not None and self.engine_alive():
            try:
                replies = self._llm.collective_rpc("_hidden_states_graph_report")
                self.closing_line = report_line(next((r for r in replies if r is not None), None))
            except Exception as exc:  # noqa: BLE001 - the engine failing at the end: the run's error says why
                self.closing_line = f"warning: --cuda-graphs: the capture's report could not be read ({exc})"
        if self.pool is not None and self.pool.waits:  # the log file's: where the engine may have run dry
            self.closing_line = "\n".join(filter(None, [self.closing_line, "debug: submissions " + self.pool.waited()]))
        super().close()

    def release(self) -> None:
        self.replies.close()
        if self.pool is not None:
            self.pool.close()


BACKEND = VllmEngineBackend
