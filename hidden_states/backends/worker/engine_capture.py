"""Worker side of ``--backend vllm-engine``: a capture's rows streamed per step into regions of a
shared segment that the parent reserved for each request.

Two captures hand their rows here (``StreamingStates._store_captured_states``: one tensor per
layer, the forward's rows in the runner's batch order): speculators' (``speculators_capture``: its
``HiddenStatesWorkerExtension``, whose patched ``forward`` the shim's adapters keep working across
vLLM releases) and the extractor's own (``own_capture``: hooks on vLLM's own decoder layers). What
this module does is the same for both: instead of accumulating on the GPU until someone asks for
them, each request's rows are copied, as soon as the step that computed them has run, into that
request's region of a page-locked ``/dev/shm`` segment shared with the parent.

* A region belongs to one request at a time: the parent names it in the request's sampling
  parameters (``extra_args[REGION]``: offset, the rows it is laid out for, and which of its header's
  counters the request writes), so it reaches this worker with the request, whatever id vLLM gives it
  internally.
* Layout (``regions.layer_start``): a 64-byte header, whose first int64 is the number of prompt rows
  stored so far; the token id of every stored row (int32), taken from the same forward rows as its
  states, which the parent compares with the prompt (a row attributed to the wrong request cannot
  pass); then the layers one after the other, each ``[prompt_len, hidden]`` contiguous: a request's
  layer is one run of bytes, which the parent hands to the writer without a copy. With FP8 states
  (``--state-dtype fp8``) the layers are quantized here, where they were computed (``fp8_states``:
  one scale per row over its layers), and each row's scale is stored after the token ids: half the
  bytes cross to the host.
* Rows go where the scheduler says they belong (``num_computed_tokens``), so chunked prompts and
  prompts recomputed after a preemption land in place (the lowest position stored at again noted at
  ``regions.REWRITTEN``: a copy the parent took of counted rows knows from where to take it again);
  rows past the region's length and rows of requests without a region (warm-up, profiling) are not
  stored. A region is the prompt's length
  for ``extract`` (a decode step's row is past it); ``hidden-states generate`` gives a request the
  prompt plus its most new tokens, and each decode step's row (the token it feeds back, with its
  id) lands at its position: the reply's rows, all but the last sampled token, which no step feeds. A request whose first tokens
  vLLM's prefix cache held starts past them: the header's second int64 says where (the lowest
  position stored at), and the parent fills the rows before it from the request that computed them.
* Under vLLM's pipeline parallelism each stage's TP rank 0 captures the run's layers its stage runs
  (``stage_layers``), each at its slot among the run's layers, with a counter block and token ids of
  its own (``regions.ids_start``: the parent checks each stage's); a stage that runs none installs
  nothing. Every stage sees the same scheduler output, so each places its rows the same way.
* On a GPU the states' copies run on a stream of their own, into pinned memory, after the step's
  forward: they overlap the next step's forward instead of adding to its time. A region's row count is written only once its copies are
  done (:class:`CopiesDone`, a thread waiting on each step's event), and the parent waits for the
  count, so a finished request is never read before its states have landed. The token ids (a few
  bytes per row) are copied on the compute stream, from the runner's input buffer before the next
  step rewrites it. On a CPU every copy is done when it returns, and the count is written at once.
"""
from __future__ import annotations

import contextlib
import logging
import queue
import threading

from vllm_compat.extractor_api import pin_host_memory, scheduled_in_row_order, wrap_method

from ... import fp8_states
from ..shared.region_sink import stored_ranges
from ..shared.regions import FIRST_ROW, HEADER, REGION, REWRITTEN, UNREWRITTEN, ids_start, layer_start, scales_start
from .pool_access import connect, open_pool
from .row_scatter import GATHER_ROWS, GatheredRows

logger = logging.getLogger(__name__)


def note_input_ids(wrapped, model, args, kwargs):
    """Around the capturing forward: keep its input ids and positions, which ``_store_captured_states``
    stores beside the states of the same rows (ids) and checks the runner's batch order with."""
    extension = model._hidden_states_extension
    extension._hidden_states_input_ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
    extension._hidden_states_positions = kwargs["positions"] if "positions" in kwargs else args[1]
    return wrapped(*args, **kwargs)


def order_by_rows(order, tokens, starts, prompts, input_ids: list[int], positions: list[int]) -> list[str]:
    """``order`` (the runner's batch order) if the forward's rows hold its requests' tokens in that
    order; else the order in which they do hold them, found from each request's token ids and first
    position. Raises if the rows cannot be told apart.

    Why: the runner's batch order is what vLLM says, the forward's rows are what ran; where they
    disagree (it happened once, CHANGELOG.md), only the rows' own token ids and positions say whose
    rows they are."""
    def chunk(request_id):
        """The ids of its rows this step: its prompt's; a decode row's (a generated token, fed back:
        ``hidden-states generate``) is not known here, None, and matches any id."""
        start, count = starts[request_id], tokens[request_id]
        known = prompts[request_id][start:start + count]
        return known + [None] * (count - len(known))

    def holds(expected, rows) -> bool:
        return len(expected) == len(rows) and all(e is None or e == got for e, got in zip(expected, rows))

    if holds([t for r in order for t in chunk(r)], input_ids[:sum(tokens[r] for r in order)]):
        return order
    found, row, left = [], 0, list(order)
    while left:
        here = [r for r in left if positions[row] == starts[r] and holds(chunk(r), input_ids[row:row + tokens[r]])]
        if len(here) > 1:  # a prompt's rows that match say more than a decode row, which matches any id
            known = {r: sum(t is not None for t in chunk(r)) for r in here}
            here = [r for r in here if known[r] == max(known.values())]
        if len(here) != 1:
            raise RuntimeError(f"hidden-states vllm-engine capture: the forward's rows from {row} on hold "
                               f"{'none' if not here else 'more than one'} of the scheduled requests {left}")
        found.append(here[0])
        left.remove(here[0])
        row += tokens[here[0]]
    logger.warning("hidden-states vllm-engine capture: the runner's batch order %s is not its forward's rows' "
                   "order %s; rows attributed by their tokens (per request: tokens this step, first position: %s)",
                   order, found, {r: (tokens[r], starts[r]) for r in order})
    return found


def step_starts(scheduler_output) -> dict[str, int]:
    """Request id -> the prompt position of its first row in this step."""
    starts = {new.req_id: new.num_computed_tokens for new in scheduler_output.scheduled_new_reqs}
    cached = scheduler_output.scheduled_cached_reqs
    starts.update(zip(cached.req_ids, cached.num_computed_tokens))
    return starts


def note_step(wrapped, worker, args, kwargs):
    """Around ``execute_model``: learn the new requests' regions and where this step's rows go."""
    import torch

    scheduler_output = kwargs["scheduler_output"] if "scheduler_output" in kwargs else args[0]
    for request_id in scheduler_output.finished_req_ids:
        worker._hidden_states_regions.pop(request_id, None)
        worker._hidden_states_prompts.pop(request_id, None)
        worker._hidden_states_first.pop(request_id, None)
        worker._hidden_states_ends.pop(request_id, None)
    for new in scheduler_output.scheduled_new_reqs:
        extra = getattr(new.sampling_params, "extra_args", None) or {}
        if REGION in extra:
            offset, length, *counters = extra[REGION]
            worker._hidden_states_regions[new.req_id] = (offset, length, counters[0] if counters else 0)
            if worker._hidden_states_sender is not None and not (counters and counters[0]):
                # a private copy of the pool (another host): no parent zeroed this stage's block in it
                block = offset + worker._hidden_states_block * HEADER
                worker._hidden_states_host[block:block + 40].view(torch.int64).copy_(
                    torch.tensor([0, 0, 0, 0, UNREWRITTEN]))
            worker._hidden_states_prompts[new.req_id] = list(new.prompt_token_ids)
    worker._hidden_states_step = (dict(scheduler_output.num_scheduled_tokens), step_starts(scheduler_output))
    try:
        result = wrapped(*args, **kwargs)
        worker._hidden_states_step_ran()
        return result
    finally:
        worker._hidden_states_step = None


class CopiesDone:
    """Writes regions' row counts once the copies of their rows have finished on the copy stream.
    With a ``sender`` (a stage on another host, ``shared/region_sink``): sends the step's stored bytes,
    then its counters, to the parent instead, from this thread (the forward never waits on the
    network; it waits only while ``SEND_QUEUE`` steps are queued, the sender's back-pressure)."""

    SEND_QUEUE = 64

    def __init__(self, host, sender=None):
        self._host, self._sender = host, sender
        self._queue: queue.Queue = queue.Queue(self.SEND_QUEUE if sender is not None else 0)
        threading.Thread(target=self._run, name="hidden-states-copies-done", daemon=True).start()

    def after(self, event, counts: list[tuple[int, int]], gathered: GatheredRows | None = None, staged=None,
              sent=None) -> None:
        """Once ``event`` has passed (None: done): place the ``gathered`` rows (``staged`` on the host),
        then write the counts (with a sender: send ``sent``, the (ranges, counters) the step stored)."""
        self._queue.put((event, counts, gathered, staged, sent))

    def _run(self) -> None:
        import torch

        while True:
            event, counts, gathered, staged, sent = self._queue.get()
            if event is not None:
                event.synchronize()
            if gathered:
                gathered.place(self._host, staged)
            for offset, count in counts:
                self._host[offset:offset + 8].view(torch.int64)[0] = count
            if self._sender is not None:
                try:
                    self._sender.send(*sent)
                except OSError as exc:  # the parent sees the connection end and names this stage
                    logger.error("hidden-states vllm-engine capture: sending rows to the region sink failed: %s", exc)
                    self._sender = None


def tp_rank() -> int:
    """This worker's tensor-parallel rank (only rank 0 captures: every rank computes the same states)."""
    from vllm.distributed import get_tp_group

    return get_tp_group().rank_in_group


def pp_rank() -> int:
    """This worker's pipeline stage (each stage's TP rank 0 captures the run's layers that stage runs)."""
    from vllm.distributed import get_pp_group

    return get_pp_group().rank_in_group


def stage_layers(stack, layer_ids: list[int]) -> list[int]:
    """The run's layers (sorted) that ``stack`` runs: under vLLM's pipeline parallelism a stage's
    decoder stack holds ``start_layer <= L < end_layer``, every other layer a placeholder."""
    first, end = getattr(stack, "start_layer", 0), getattr(stack, "end_layer", len(stack.layers))
    return [layer for layer in sorted(set(layer_ids)) if first <= layer < end]


def base_model(model):
    """The decoder stack of a model vLLM loaded (the module holding ``layers``), where both captures
    act: a vision-language model's language model, else ``model.model``."""
    if hasattr(model, "get_language_model"):
        return model.get_language_model().model
    if hasattr(model, "model") and hasattr(model.model, "layers"):
        return model.model
    raise RuntimeError(f"hidden-states vllm-engine capture: no decoder stack ('layers') in {type(model).__name__}")


class StreamingStates:
    """The streaming half of a ``worker_extension_cls`` of the ``vllm-engine`` backend (its methods
    run in every worker; only tensor-parallel rank 0 captures). A capture class comes after it among
    the bases and brings ``_setup_hidden_states_capture(layer_ids)``, which makes every forward of
    the model hand its target layers' rows to ``_store_captured_states``."""

    _hidden_states_fp8 = False  # --state-dtype fp8 (set up by _hidden_states_stream_setup)
    # the forward's token ids and positions read off the decoder stack's forward as it runs (the eager
    # captures); False: the capture keeps them itself (graph_capture: no Python runs in a CUDA graph)
    _hidden_states_ids_from_forward = True
    # where this stage's rows go: the run's slot of each layer it captures (None: all of them, in
    # order), its counter block and token-id array among the region's ``blocks`` (regions.py)
    _hidden_states_slots: list[int] | None = None
    _hidden_states_block, _hidden_states_blocks = 0, 1
    _hidden_states_sender = None  # a stage on another host: its stored bytes go to the parent's region sink

    def _hidden_states_stream_setup(self, layer_ids: list[int], state_dtype: str = "model") -> dict | None:
        """Install the capture of the run's layers this stage runs (none: nothing installed); the
        capturing rank says its stage, those layers and how its rows look (``state_dtype`` ``fp8``:
        quantized, with a scale per row)."""
        wanted = sorted(set(layer_ids))
        local = stage_layers(base_model(self.model_runner.model), wanted)
        self._hidden_states_slots = [wanted.index(layer) for layer in local]
        if local:
            self._setup_hidden_states_capture(local)
        self._hidden_states_fp8 = state_dtype == "fp8"
        if tp_rank() != 0:  # both captures capture on TP rank 0 alone
            return None
        config = self.model_config
        dtype = fp8_states.fp8_dtype() if self._hidden_states_fp8 else config.dtype
        cache = getattr(self, "cache_config", None)  # where prefix-cache hits land: vLLM 0.34's alignment, else blocks
        return {"dtype": str(dtype).removeprefix("torch."), "hidden_size": config.get_hidden_size(),
                "scales": self._hidden_states_fp8, "stage": pp_rank(), "layers": local, "prefix_hit_tokens":
                getattr(cache, "cache_hit_alignment_tokens", None) or getattr(cache, "block_size", None)}

    def _hidden_states_stream_to(self, path: str, stages: list[int] | None = None,
                                 transport: dict | None = None) -> bool | None:
        """Map the parent's region file (page-locked where the model runs on a GPU) and start noting
        each step's requests. ``stages``: the capturing pipeline stages, in the order of their blocks
        in a region (None: this one alone). ``transport``: how to tell the file is this run's pool
        here, and the region sink to send to where it is not (``pool_access``). Returns whether the
        file is page-locked (None: not a capturing rank)."""
        import torch

        if tp_rank() != 0:
            return None
        if stages is not None:
            stage = pp_rank()
            if stage not in stages:  # a stage that runs none of the run's layers
                return None
            self._hidden_states_block, self._hidden_states_blocks = stages.index(stage), len(stages)
        self._hidden_states_mapping, remote = open_pool(path, transport, pp_rank() if stages is not None else 0)
        self._hidden_states_host = torch.frombuffer(self._hidden_states_mapping, dtype=torch.uint8)
        self._hidden_states_sender = (connect(transport, self._hidden_states_block, self._hidden_states_host)
                                      if remote else None)
        self._hidden_states_regions: dict[str, tuple[int, int, int]] = {}  # offset, rows, which counters
        self._hidden_states_step = None
        self._hidden_states_prompts: dict[str, list[int]] = {}
        self._hidden_states_first: dict[str, int] = {}  # request id -> the lowest position stored at
        self._hidden_states_ends: dict[str, int] = {}  # request id -> the end of the rows it stored
        self._hidden_states_input_ids = self._hidden_states_positions = None
        wrap_method(self, "execute_model", note_step)
        if self._hidden_states_ids_from_forward:
            stack = base_model(self.model_runner.model)  # the forward the capture hooked or replaced
            stack._hidden_states_extension = self
            wrap_method(stack, "forward", note_input_ids)
        on_gpu = getattr(self.model_runner, "device", torch.device("cpu")).type == "cuda"
        self._hidden_states_copies = torch.cuda.Stream() if on_gpu else None
        self._hidden_states_done = (CopiesDone(self._hidden_states_host, self._hidden_states_sender)
                                    if on_gpu or remote else None)
        return pin_host_memory(self._hidden_states_host) if on_gpu else False

    def _hidden_states_step_ran(self) -> None:
        """After ``execute_model``, the step's scheduler output still noted: the eager captures have
        stored the step's rows from within its forward already; a capture whose forward runs no
        Python (``graph_capture``) stores them here."""

    def _store_captured_states(self, aux_hidden_states):
        import torch

        if self._hidden_states_step is None:  # a warm-up or profiling forward: no request owns its rows
            return
        tokens, starts = self._hidden_states_step
        order = scheduled_in_row_order(self.model_runner, tokens)
        captured, scheduled = aux_hidden_states[0].shape[0], sum(tokens.values())
        if scheduled > captured:
            raise RuntimeError(f"hidden-states vllm-engine capture: the forward has {captured} rows, the step "
                               f"scheduled {scheduled} tokens")
        input_ids = self._hidden_states_input_ids
        if input_ids is None:
            raise RuntimeError("hidden-states vllm-engine capture: the forward got no input ids (embeddings "
                               "instead?); the rows' owners cannot be checked")
        if input_ids.device.type == "cpu" and all(r in self._hidden_states_prompts for r in order):
            # host tensors: checking the order costs a list comparison (on a GPU it would cost a sync;
            # the parent's check of every stored row's token id guards there)
            order = order_by_rows(order, tokens, starts, self._hidden_states_prompts, input_ids.tolist(),
                                  self._hidden_states_positions.tolist())
        host, row, counts = self._hidden_states_host, 0, []
        stream = self._hidden_states_copies
        if stream is not None:  # the copies wait for the forward, on their own stream
            stream.wait_stream(torch.cuda.current_stream())
            for layer in aux_hidden_states:  # not reused by the allocator before the copy has read it
                layer.record_stream(stream)
        scales = None
        if self._hidden_states_fp8:  # on the copies' stream too: after the forward, beside the next one
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                aux_hidden_states, scales = fp8_states.quantize(aux_hidden_states)
                scales = scales.view(-1)
        hidden = aux_hidden_states[0].shape[1]
        row_bytes = hidden * aux_hidden_states[0].element_size()
        # requests with a few rows this step (decoding): moved together, in one copy per kind
        slots = self._hidden_states_slots or list(range(len(aux_hidden_states)))
        block, blocks = self._hidden_states_block, self._hidden_states_blocks
        gathered = GatheredRows(len(aux_hidden_states), row_bytes, scales is not None, slots, block, blocks)
        regions, first_stored = self._hidden_states_regions, self._hidden_states_first
        ends, mine = self._hidden_states_ends, block * HEADER  # this stage's counter block
        # another host: what this step stores, sent to the parent's sink (bytes first, counters last)
        sent = ([], []) if self._hidden_states_sender is not None else None
        for request_id in order:  # hundreds of decoding requests a step: the least work each
            count = tokens[request_id]
            region, start = regions.get(request_id), starts.get(request_id)
            if region is not None and start is not None:
                offset, length, counters = region
                counters += mine
                take = min(count, length - start)
                if take > 0:
                    stored = first_stored.get(request_id)
                    if stored is None or start < stored:  # the lowest position stored at, in the header
                        first_stored[request_id] = start
                        at = offset + counters + FIRST_ROW
                        host[at:at + 8].view(torch.int64)[0] = start
                    end = ends.get(request_id, 0)
                    if start < end:  # rows counted before, stored again (a preempted request recomputed)
                        again = host[offset + mine + REWRITTEN:offset + mine + REWRITTEN + 8].view(torch.int64)
                        again[0] = min(int(again[0]), start)
                    ends[request_id] = max(end, start + take)
                    if take <= GATHER_ROWS:
                        gathered.add(row, take, offset, length, start)
                    else:
                        self._copy_rows(aux_hidden_states, scales, row, take, offset, length, start, row_bytes)
                    counts.append((offset + counters, start + take))
                    if sent is not None:
                        sent[0].extend((offset, length, at, size) for at, size in stored_ranges(
                            offset, length, start, take, slots, block, blocks, row_bytes, scales is not None))
                        sent[1].extend((offset, length, at, 8) for at in (
                            offset + mine + REWRITTEN, offset + counters + FIRST_ROW, offset + counters))
            row += count
        staged = gathered.stage(aux_hidden_states, input_ids, scales, stream) if gathered else None
        if sent is not None and stream is None:  # another host, on a CPU: the copies are done, the sending is not
            if gathered:
                gathered.place(host, staged)
            if counts:
                self._hidden_states_done.after(None, counts, None, None, sent)
        elif stream is None:
            if gathered:
                gathered.place(host, staged)
            for offset, count in counts:
                host[offset:offset + 8].view(torch.int64)[0] = count
        elif counts:
            done = torch.cuda.Event()
            done.record(stream)
            self._hidden_states_done.after(done, counts, gathered, staged, sent)

    def _copy_rows(self, aux_hidden_states, scales, row: int, take: int, offset: int, length: int, start: int,
                   row_bytes: int) -> None:
        """Rows ``row .. row + take`` of the forward straight into positions ``start ..`` of the
        ``length``-token region at ``offset``: the token ids on the compute stream, the rest on the
        copies' stream."""
        import torch

        host, stream, hidden = self._hidden_states_host, self._hidden_states_copies, aux_hidden_states[0].shape[1]
        slots, block, blocks = self._hidden_states_slots, self._hidden_states_block, self._hidden_states_blocks
        first = offset + ids_start(length, block, blocks) + 4 * start
        host[first:first + 4 * take].view(torch.int32).copy_(self._hidden_states_input_ids[row:row + take],
                                                             non_blocking=True)
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            if scales is not None:
                first = offset + scales_start(length, blocks) + 4 * start
                host[first:first + 4 * take].view(torch.float32).copy_(scales[row:row + take], non_blocking=True)
            for index, layer in enumerate(aux_hidden_states):
                slot = index if slots is None else slots[index]
                first = offset + layer_start(length, slot, row_bytes, scales is not None, blocks) + start * row_bytes
                target = host[first:first + take * row_bytes].view(layer.dtype).view(take, hidden)
                target.copy_(layer[row:row + take], non_blocking=True)
