"""``vllm-engine``'s side of ``hidden-states generate`` (:class:`~hidden_states.backends.Replying`):
replies, then the states of their training rows (docs/guides/generate.md, "On-policy rows in one pass").

A prompt to answer is a request of its own (:class:`PromptWork`) whose region holds the rows of its
prompt and of every generated token a step fed back; a reply's training row is then prefilled under
the reply's cache salt (:class:`RowWork`), vLLM computing only what its prefix cache does not hold,
the rows before it copied from the reply's region or, for a row that goes on from its whole reply,
prefilled in that region itself. :class:`EngineReplies` does this on the regions of the backend that
composes it (``vllm_engine.VllmEngineBackend``), which hands it the prompts and rows it resolves.
"""
from __future__ import annotations

from collections import Counter
from concurrent.futures import Future

from ..certify.witness import TOP, Witness, reply_witness, row_witness
from ..inputs.tokenization import common_prefix
from . import Reply, Sampling
from .engine_feed import EngineBatch
from .shared.regions import SECOND, layer_start
from .reply_streams import ReplyStreams, Sink

# rows a reply's region holds past its prompt and its most new tokens: room for what the chat template
# puts after the reply (an end-of-turn token, a newline), so that its training row fits where it is
ROW_TAIL = 32


class RegionBatch(EngineBatch):
    def __init__(self, ids: list[list[int]], offsets: list[int], cache_salt: str | None = None):
        super().__init__(ids, cache_salt)
        self.offsets = offsets  # each sequence's region
        self.lengths = [len(one) for one in ids]  # each region's rows (its layout's length)
        self.counters = [0] * len(ids)  # which of its region's counters each request writes (regions.SECOND)

    def counts_at(self, position: int) -> int:
        """Where the counters of the request at ``position`` are (its rows stored, its first row)."""
        return self.offsets[position] + self.counters[position]


class PromptWork(RegionBatch):
    """A prompt to answer, a batch of its own, so that its reply resolves as soon as it is done,
    whatever else the engine runs. Its region holds the prompt, up to ``max_new_tokens`` rows more
    (the decode steps') and ``ROW_TAIL`` for its training row's end, under a cache salt of its own."""

    def __init__(self, ids: list[int], offset: int, sampling: Sampling, salt: str, certified: bool = False):
        super().__init__([ids], [offset], salt)
        self.sampling = sampling
        self.certified = certified  # asks for the engine's logprobs with each token (its rows' witness)
        self.lengths = [len(ids) + sampling.max_new_tokens + ROW_TAIL]


class RowWork(RegionBatch):
    """Training rows prefilled under their replies' cache salts: vLLM computes only what its prefix
    cache does not hold. A row that goes on from its whole reply is prefilled in the reply's region
    (``in_place``: its rows before are there already, its own counters say how far it got); another
    has a region of its own, the rows before copied into it from the reply's."""

    def __init__(self, ids, offsets, sources: list[Reply], in_place: list[bool], streams: list,
                 certified: bool = False):
        super().__init__(ids, offsets)
        self.sources = sources
        self.certified = certified  # resolves to (layers, Witness) per row
        self.copied = [0] * len(ids)  # each row's first rows that are its reply's (the rest its prefill's)
        self.in_place = in_place
        self.streams = streams  # an in-place row's reply's stream (reply_streams), told which rows it keeps
        self.lengths = [source.capacity if here else len(row) for row, source, here in zip(ids, sources, in_place)]
        self.counters = [SECOND if here else 0 for here in in_place]

    def salt(self, position: int) -> str:
        return self.sources[position].salt


class EngineReplies:
    """Replies and their training rows on the regions of ``engine`` (a ``VllmEngineBackend``: its
    ``pool``, ``region_bytes``, ``row_bytes``, ``scales``, ``blocks``, ``layer_count``, ``rows_timeout``,
    ``check_feed``, ``put``, ``copy_rows`` and ``next_salt``), read when used: its regions are
    mapped once its engine has started."""

    def __init__(self, engine):
        self._engine = engine
        self.reply_rows_reused = 0  # row tokens whose states the reply's region held
        self.rows_from_replies = 0  # training rows with any of them (the others prefilled again whole)
        self.rows_in_place = 0  # training rows prefilled in their reply's region
        self._adopted: set[int] = set()  # replies' regions their training rows took over (released with the rows)
        self.streams: ReplyStreams | None = None  # replies' rows copied to their files as they land

    def answer(self, prompt: list[int], sampling: Sampling, stream: Sink | None = None,
               certified: bool = False) -> Future:
        """Answer ``prompt``, a request of its own: the future resolves to its :class:`Reply` once that
        request has finished, while the engine goes on with the others (and with whatever is
        submitted meanwhile: a conversation's next turn). The reply's region holds the rows of its
        prompt and of every generated token a step fed back (all but the last); it stays reserved
        until :meth:`release_replies`. ``stream``: the rows go there too as they land (token-major,
        ``reply_streams``), until the reply's training row is prefilled; it is told which of them
        that row's states keep (``kept``), or discarded (``discard``) when the row takes a region
        of its own or the reply is given back. ``certified``: the reply carries the engine's logprobs
        with each of its tokens (``Reply.witness``), which certify its training row."""
        engine = self._engine
        engine.check_feed()
        capacity = len(prompt) + sampling.max_new_tokens + ROW_TAIL
        offset = engine.pool.reserve(engine.region_bytes(capacity), timeout=600.0)
        work = PromptWork(prompt, offset, sampling, f"hs-gen-{engine.next_salt()}", certified)
        if stream is not None:
            self._reply_streams().follow(offset, capacity, stream)
        engine.put(work)
        return work.future

    def _reply_streams(self) -> ReplyStreams:
        if self.streams is None:
            engine = self._engine
            self.streams = ReplyStreams(lambda offset: (engine.pool.rows_stored(offset, 0, timeout=0),
                                                        engine.pool.first_row(offset, settled=False)),
                                        self._rows_token_major)
        return self.streams

    def _rows_token_major(self, offset: int, capacity: int, start: int, stop: int):
        """Rows ``start .. stop`` of the region at ``offset`` (laid out for ``capacity``), each row's
        layers one after another: uint8 ``[rows, layers, row bytes]``, a copy."""
        import torch

        engine = self._engine
        row_bytes, size = engine.row_bytes, (stop - start) * engine.row_bytes
        return torch.stack([engine.pool.view(offset + layer_start(capacity, index, row_bytes, engine.scales,
                                                                  engine.blocks)
                                             + start * row_bytes, torch.uint8, size).view(-1, row_bytes)
                            for index in range(engine.layer_count)], dim=1)

    def _stop_stream(self, offset: int):
        return self.streams.stop(offset) if self.streams is not None else None

    def row_states(self, rows: list[list[int]], sources: list[Reply], certified: bool = False) -> Future:
        """The states of ``rows``, each the training row of reply ``sources[i]``'s conversation: as
        ``submit``'s, every row whole (``certified``: with each row's :class:`Witness`, from its
        reply's logprobs, as ``submit_certified``'s). Each row is prefilled under its reply's cache salt (vLLM
        computes what its prefix cache does not hold, at least the last token); the rows before come
        from the reply's region, which must hold them (the same ids, stored).

        A row that begins with its reply's every id, the reply's only row, and fits its region is
        prefilled there: the region is the row's from now on (released with its states, not by
        :meth:`release_replies`), and nothing is copied. Why only such a row: a step that vLLM had
        scheduled for the reply before it finished may still store the reply's last row; that row
        is then this row's own (same token, same ids before it)."""
        engine = self._engine
        engine.check_feed()
        rows_of = Counter(source.offset for source in sources)
        in_place = [rows_of[source.offset] == 1 and source.offset not in self._adopted
                    and len(ids) <= source.capacity and common_prefix(ids, source.ids) == len(source.ids)
                    for ids, source in zip(rows, sources)]
        offsets, streams = [], []
        for ids, source, here in zip(rows, sources, in_place):
            stream = self._stop_stream(source.offset)  # before the row's prefill writes into the region
            if here:
                self._adopted.add(source.offset)
                offsets.append(source.offset)
            else:
                offsets.append(engine.pool.reserve(engine.region_bytes(len(ids)), timeout=600.0))
                if stream is not None:
                    stream.discard()
                    stream = None
            streams.append(stream)
        work = RowWork(rows, offsets, sources, in_place, streams, certified)
        self.rows_in_place += sum(in_place)
        engine.put(work)
        return work.future

    def release_replies(self, replies: list[Reply]) -> None:
        """Give back the replies' regions, but those their training rows took over (released with the rows' states)."""
        for reply in replies:
            if reply.offset in self._adopted:
                self._adopted.discard(reply.offset)
            else:
                self.discard_stream(reply.offset)
                self._engine.pool.release(reply.offset)

    def discard_stream(self, offset: int) -> None:
        stream = self._stop_stream(offset)
        if stream is not None:
            stream.discard()

    def params(self, work: PromptWork, region: dict):
        """A prompt's sampling parameters, its region in ``extra_args``."""
        from vllm import SamplingParams

        sampling = work.sampling
        # vLLM's logprobs are its raw ones (before temperature, top-p, penalties: logprobs_mode's
        # default on every release generate runs, docs/certificates.md): the model's, as a certificate's
        return SamplingParams(temperature=sampling.temperature, top_p=sampling.top_p,
                              max_tokens=sampling.max_new_tokens, seed=sampling.seed,
                              ignore_eos=sampling.ignore_eos, logprobs=TOP if work.certified else None,
                              extra_args=region)

    def answered(self, work: PromptWork) -> None:
        """On the feed's thread: the prompt's request has finished; resolve its reply (or its failure)."""
        try:
            reply = self._reply(work)
        except Exception as exc:  # noqa: BLE001 - the reply fails, the loop goes on
            self._engine.failed(work)
            work.future.set_exception(exc)
        else:
            work.future.set_result(reply)

    def _reply(self, work: PromptWork) -> Reply:
        """The request's reply, once its region holds every row a step fed (checked: the prompt is the
        one submitted, every stored row's token id is the reply's)."""
        pool = self._engine.pool
        prompt, offset, output = work.ids[0], work.offsets[0], work.finished[0]
        if list(output.prompt_token_ids) != prompt:
            raise RuntimeError("vLLM's request for a prompt to answer holds other token ids")
        completion = output.outputs[0]
        ids = prompt + list(completion.token_ids)
        fed = len(ids) - 1  # the last sampled token is fed by no step
        stored = pool.rows_stored(offset, fed, timeout=self._engine.rows_timeout)
        if stored < fed:
            raise RuntimeError(f"the worker stored {stored} of the {fed} rows generation fed for a reply")
        stored = min(stored, len(ids))  # a step async scheduling ran for the last token too
        wrong = pool.ids_disagree(offset, work.lengths[0], ids[:stored])
        if wrong is not None:
            raise RuntimeError(f"the states stored for a reply come from other tokens' rows ({wrong}): the worker "
                               f"attributed rows to the wrong request")
        # read now, before a training row's prefill stores into the region again: a preempted request's rows
        witness = reply_witness(output, len(prompt), pool.rewritten_from(offset)) if work.certified else None
        return Reply(prompt, list(completion.token_ids), completion.text, completion.finish_reason, offset,
                     work.lengths[0], stored, work.cache_salt, witness)

    def fill_from_replies(self, work: RowWork) -> None:
        """Copy into each row's region the rows vLLM's prefix cache spared it, from its reply's region
        (a row prefilled in place has them there)."""
        engine = self._engine
        pool = engine.pool
        for position, (ids, offset, source) in enumerate(zip(work.ids, work.offsets, work.sources)):
            counts = work.counts_at(position)
            if pool.rows_stored(counts, len(ids), timeout=engine.rows_timeout) != len(ids):
                continue  # left to the backend's states, which name it
            first = pool.first_row(counts)
            if first > min(common_prefix(ids, source.ids), source.stored):
                raise RuntimeError(f"vLLM's prefix cache gave row {position} its first {first} tokens, and its reply's "
                                   f"region holds {min(common_prefix(ids, source.ids), source.stored)} of them")
            work.copied[position] = first
            if first and not work.in_place[position]:
                engine.copy_rows(offset, len(ids), source.offset, source.capacity, first)
            if work.streams[position] is not None:  # its rows from the prefill's first on are the row's own
                work.streams[position].kept = min(first, pool.rewritten_from(offset))
            self.reply_rows_reused += first
            self.rows_from_replies += first > 0

    @staticmethod
    def witnesses(work: RowWork) -> list[Witness]:
        """Each certified row's witness: its reply's logprobs at the positions it shares with the reply,
        those past the rows copied from the reply's region counted as another forward's."""
        return [row_witness(source.witness, ids, common_prefix(ids, source.ids), copied)
                for ids, source, copied in zip(work.ids, work.sources, work.copied, strict=True)]

    def close(self) -> None:
        if self.streams is not None:
            self.streams.close()


def discard_rows_streams(work: RegionBatch) -> None:
    """The streams a batch of training rows was to finish, when it fails: their files are not written."""
    if isinstance(work, RowWork):
        for stream in work.streams:
            if stream is not None:
                stream.discard()
