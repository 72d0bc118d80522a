"""``hidden-states generate``: regenerate the input's replies and write the training rows of the
regenerated conversations with the states the generation computed (docs/extractor.md, "On-policy
rows in one pass").

An :class:`~hidden_states.extraction.Extraction` in everything but its loop: the same plan
(settings, model, layers, the output directory read), the same output directory (format, identity
with the sampling settings added: a rerun with other sampling is another extraction, resume
otherwise), load (``--backend vllm-engine`` only: the replies' rows are in its regions) and finish.
The loop reads conversations, not samples:

* ``--batch-size`` conversations are in the engine at once, each regenerated turn by turn
  (``regeneration``), its next turn submitted as soon as its reply is in, while the others' still run;
  each reply's rows streamed into its region as the engine generates (``VllmEngineBackend.answer``);
* a conversation whose every turn is answered is tokenized as ``extract`` tokenizes conversations
  (``--format``'s layout), each row matched with its reply (``regeneration.row_source``) and
  prefilled under that reply's cache salt: vLLM computes only what its prefix cache lacks, the rest
  is the reply's (``VllmEngineBackend.row_states``);
* its rows go to the background writer as soon as their states are in, its line (the conversation as
  regenerated) to ``regenerated.jsonl`` in input order, and the next conversation takes its place in
  the engine (:meth:`Generation.regenerate_continuously`). A Ray replica runs a batch of
  conversations the same way, whole (:meth:`Generation.generate_batch`).

Sample indices: conversation ``i`` is sample ``i`` (``speculators-0.3``, one row per conversation);
with ``speculators-0.5`` (a row per reply) a conversation's rows are numbered on from the replies of
the conversations before it, counted in the input (one per user turn of each conversation regenerated;
none for one skipped for its tool turns) before anything is generated: so a conversation's numbers
depend on the input alone, never on which process or replica runs what. A conversation is finished
when every one of its rows' files is whole; ``regenerated.jsonl`` keeps, at the start of a run, only
the lines of finished conversations.

Scale-out, through ``extract``'s own machinery: a static shard (``--shard I/N``) regenerates every
``N``-th batch of conversations (``ShardBatches.owns`` on conversation numbers) with its own ledger and
its own ``regenerated.<tag>.jsonl`` (``regeneration.merge_shards``); Ray replicas
(``--data-parallel-size``): :class:`RayGeneration`, ``replicas.RayExtraction`` handing out batches of
whole conversations (a conversation's later turns need its earlier replies), each replica running
:meth:`Generation.generate_batch` on its own backend, the driver writing the lines.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, wait

from . import fp8_states
from .backends import Reply, Sampling
from .errors import InputError, OutputError, PreflightError, UsageError
from .extraction import PLAN_DETAILS, Extraction
from .output.formats.speculators_05 import StreamedFile
from .inputs import conversations
from .inputs.streams import Sample, trained_token_counts
from .layer_conventions import SPECULATORS_05
from .progress import Progress
from .regeneration import (TOO_LONG, Kept, Regeneration, Tally, keep_finished_lines, kept, merge_shards,
                           order_lines, regenerated_name, row_source)
from .replicas import Handle, RayExtraction, ReplicaBatch
from .output.names import TOKEN_FREQ
from .plan.run_plan import plan_run
from .inputs.tokenization import ChatSettings, ChatTokenizer, load_tokenizer, save_token_frequencies, unknown_role_policy

BACKEND = "vllm-engine"
STREAM_ENV = "VLLM_COMPAT_STREAM_FILES"  # 0: speculators-0.5 files written when their rows are done (to compare)


# why generate refuses vLLM's own path (found building it: docs/extractor.md, "On-policy rows in one pass")
NATIVE_REPLIES = ("under vLLM's extract_hidden_states, greedy replies of requests sharing the engine part from the "
                  "model's own greedy output: they would not be its answers")


class Generation(Extraction):
    """One ``hidden-states generate`` run (see the module's docstring)."""

    batches_held = 4  # a batch's replies and its rows at once, besides what extract holds

    def __init__(self, settings, sampling: Sampling, **kwargs):
        super().__init__(settings, **kwargs)
        self.sampling = sampling
        self.tally = Tally()
        self.chat: ChatTokenizer | None = None
        self._all: list[tuple[int, list[int]]] = []  # (conversation, its sample indices) of the range
        self._conversations = 0  # in the input, once read
        self._with_lines: set[int] = set()  # conversations whose line a regenerated file holds
        self._lines = None  # the regenerated lines' file this process appends to
        self._awaiting: deque[dict] = deque()  # lines in input order whose rows' files are not all whole yet
        self._lined_now: set[int] = set()  # conversations whose line this run wrote
        self._streams: dict[int, StreamedFile] = {}  # by sample index: its reply's file, begun while generating

    @classmethod
    def executing(cls, plan, *, log=None) -> Generation:
        """A Ray replica's generation of ``plan`` (the sampling is in its config's identity)."""
        generation = cls(plan.settings, Sampling(**plan.config["generation"]), log=log)
        generation._adopt(plan)
        return generation

    @property
    def replica_class(self) -> type:
        return Generation

    # -- plan and prepare: extract's, with the sampling in the identity
    def plan(self) -> None:
        settings = self.settings
        if settings.backend != BACKEND:
            why = NATIVE_REPLIES if settings.backend == "vllm-native" else "the replies' rows are kept in its regions"
            raise UsageError(f"--backend {settings.backend}: generate runs on --backend {BACKEND} ({why})")
        if self.sampling.temperature < 0:
            raise UsageError(f"--temperature {self.sampling.temperature}: must be at least 0 (0: greedy)")
        if not 0 < self.sampling.top_p <= 1:
            raise UsageError(f"--top-p {self.sampling.top_p}: must be more than 0 and at most 1")
        if self.sampling.max_new_tokens >= settings.max_seq_len:
            raise UsageError(f"--max-new-tokens {self.sampling.max_new_tokens}: must be below --max-seq-len "
                             f"{settings.max_seq_len} (a prompt and its reply make one row)")
        first = next(iter(conversations.open_source(settings.prepared_data)), None)
        if first is None:
            raise PreflightError(f"{settings.prepared_data}: no conversations")
        if conversations.kind_of(first) not in (conversations.SHAREGPT, conversations.MESSAGES):
            raise InputError(f"{first.where}: a {conversations.kind_of(first)} row; generate regenerates "
                             f"conversations (ShareGPT 'conversations' or OpenAI 'messages')")
        # the input holds conversations (checked above); as ``extract`` would read them it may hold no
        # sample at all: with speculators-0.5 (a row per assistant turn) prompts with no reply yet make
        # none, and their rows are the regenerated replies'. The sampling joins the run's identity: a
        # rerun with other sampling is another extraction
        planned = plan_run(settings, self.source, log=self.log, loads_model_here=self.loads_model_here,
                           batches_held=self.batches_held, identity={"generation": dataclasses.asdict(self.sampling)},
                           samples_optional=True)
        self.hold(dataclasses.replace(planned, lines=[
            *planned.lines, f"regeneration: every user turn answered again ({self.describe_sampling()}); the time "
                            f"above is the rows' prefill alone"]))

    def describe_sampling(self) -> str:
        s = self.sampling
        return (f"temperature {s.temperature}, top-p {s.top_p}, at most {s.max_new_tokens} new tokens"
                + (f", seed {s.seed}" if s.seed is not None else "") + (", ignoring EOS" if s.ignore_eos else ""))

    # -- run
    def run(self):
        try:
            self.plan()
            for line in self.plan_lines:  # as extract: the plan's details to the log file
                self.log(f"debug: {line}" if line.startswith(PLAN_DETAILS) else line)
            self.prepare()
            self._with_lines = keep_finished_lines(self.output.path, self.source.tag, self.finished)
            todo = list(self._conversations_to_do())
            if not todo:
                self.output.finish(self.finished)
                self._merge_shard_lines()
                self.write_token_frequencies()
                return self.summary
            summary = self.loaded(lambda: self.generate(todo))
            self.write_token_frequencies()
            return summary
        finally:
            self.unlock()

    def write_token_frequencies(self) -> None:
        """``token_freq.pt`` in the output directory once every conversation of the input is done
        (the whole input in range, none left): the trained tokens of ``regenerated.jsonl``'s rows,
        counted as ``prepare`` counts that file (the rows the trainer reads are the regenerated
        ones). A shard, a partial range or a run that stopped leaves it as it is."""
        settings = self.settings
        whole = settings.start_index == 0 and (settings.end_index is None or settings.end_index >= self._conversations)
        if not whole or self.source.tag is not None or self.unfinished()[0]:
            return
        chat = ChatSettings(settings.model_path, self.format_name, settings.max_seq_len, settings.trust_remote_code,
                            settings.strict)
        save_token_frequencies(dict(trained_token_counts(chat, self.output.path / regenerated_name(None))),
                               self.output.path / TOKEN_FREQ)

    def unfinished(self) -> tuple[int, bool]:
        """(samples of the conversations of the range, or the shard's share, not done: a file missing,
        or the line), counted as the summary counts what is extracted and finished."""
        done = set(self.finished)
        return sum(len(indices) for number, indices in self._all
                   if not set(indices) <= done or number not in self._with_lines), True

    def _conversations_to_do(self):
        """(Regeneration, its sample indices) of each conversation in range not finished yet; the
        skipped ones counted. Reads the whole input (conversations, checked as they are read)."""
        settings, per_reply = self.settings, self.format_name == SPECULATORS_05
        owns = self.source.owns
        source = conversations.open_source(self.input.path)
        # a turn with an unknown role is context, never regenerated: skipped or kept as an assistant
        # turn as extract tokenizes it (the kept turns are the system and user ones); --strict refuses it
        unknown_roles = conversations.REFUSE if settings.strict else unknown_role_policy(self.format_name)
        self._all, base = [], 0
        self._conversations = 0
        for number, record in enumerate(source):
            self._conversations = number + 1
            kind = conversations.kind_of(record)
            if kind not in (conversations.SHAREGPT, conversations.MESSAGES):
                raise InputError(f"{record.where}: a {kind} row; generate regenerates conversations (ShareGPT "
                                 f"'conversations' or OpenAI 'messages')")
            what = kept(conversations.conversation(record, kind, unknown_roles))
            indices = list(range(base, base + what.replies)) if per_reply else [number]
            base += what.replies
            if not settings.in_range(number):
                continue
            if not owns(number, settings.start_index, settings.batch_size):  # another shard's
                continue
            if what.skip:
                self.tally.skip(what.skip)
                continue
            self._all.append((number, indices))
            # done: every row's file whole and the conversation's line kept (a run that stopped between
            # them regenerates it)
            if set(indices) <= set(self.finished) and number in self._with_lines:
                self.summary.skipped += len(indices)
                continue
            yield Regeneration(number, record.where, record.line, what), indices

    def generate(self, todo) -> None:
        """Regenerate ``todo``: here, ``--batch-size`` conversations at a time in the engine, the next
        one started as soon as one is done (:meth:`regenerate_continuously`); a Ray driver hands out
        batches of them (:meth:`hand_out`)."""
        settings = self.settings
        self.log("generating")
        self._started = time.monotonic()
        self.open_sink()
        self.progress = Progress(len(todo), log=self.log, exact=True, interval=settings.progress_interval)
        self.interrupt.extracting = True
        self._lines = open(self.output.path / regenerated_name(self.source.tag), "a", encoding="utf-8")
        self.generate_all(todo)
        if self.interrupt.requested is not None:
            self.summary.interrupted = self.interrupt.requested
        self.progress.close()

    def generate_all(self, todo) -> None:
        self.regenerate_continuously(todo, self.settings.batch_size, self.write_when_whole)

    def write_when_whole(self, lines: list[dict]) -> None:
        """Take ``lines`` (in input order) and write, in that order, those whose rows' files are all
        whole (renamed into place and in the ledger): a line never names a file a failing disk did
        not write. One still waiting on its files holds those after it, until :meth:`flush_lines`."""
        self._awaiting.extend(lines)
        self._write_whole_lines(self.writer.stats.lengths)

    def _write_whole_lines(self, whole, give_up: bool = False) -> None:
        """Write the awaiting lines whose files ``whole`` holds, in order, up to the first that waits
        (``give_up``: the run is over: lines whose files were never written are dropped, their
        conversations left to the next run)."""
        ready = []
        while self._awaiting:
            if set(self._awaiting[0]["sample_indices"]) <= whole.keys():
                ready.append(self._awaiting.popleft())
            elif give_up:
                self._awaiting.popleft()
            else:
                break
        if ready:
            self.write_lines(ready)

    def regenerate_continuously(self, todo, window: int, write_lines) -> list[int]:
        """Keep ``--batch-size`` conversations in the engine: each user turn answered as its turn comes
        (the conversation's next prompt submitted as soon as its reply is in), each conversation's rows
        prefilled as soon as its last reply is in and handed to the writer as soon as they are, and the
        next conversation of ``todo`` started in its place. No conversation waits for another's longer
        reply, and the engine never waits for the rows of a batch. The lines go to ``write_lines`` in
        input order (a conversation's once those before it are written or skipped). After Ctrl-C no
        conversation is started; those in the engine finish. Returns the sample indices handed to the
        writer."""
        backend, written = self.backend, []
        reused, in_place = backend.reply_rows_reused, backend.rows_in_place
        waiting = iter(todo)
        asked: dict[Future, tuple[Regeneration, list[int]]] = {}  # a reply's request -> its conversation
        rowed: dict[Future, tuple[Regeneration, list[int], list[Sample]]] = {}  # rows' states -> their conversation
        lines = _InOrder([regen.index for regen, _ in todo], write_lines)
        running = 0
        last_reply = started = time.monotonic()
        try:
            while True:
                while running < window and not self._interrupted():
                    item = next(waiting, None)
                    if item is None:
                        break
                    kept_of, indices = item  # each run of a conversation starts afresh from what is kept of it
                    regen = Regeneration(kept_of.index, kept_of.where, kept_of.line, kept_of.kept)
                    running += 1
                    if self._go_on(regen, indices, asked, rowed):
                        running -= 1
                        lines.skip(regen.index)
                if not asked and not rowed:
                    break
                finished, _ = wait([*rowed, *asked], return_when=FIRST_COMPLETED)
                # rows first: handing them to the writer frees what the engine's next requests need
                for future in sorted((f for f in finished if f in rowed), key=lambda one: rowed[one][0].index):
                    regen, indices, samples = rowed.pop(future)
                    running -= 1
                    try:
                        tokens = self._hand_rows(samples, future.result())
                        written += [sample.index for sample in samples]
                        self.tally.conversations += 1
                        lines.put(regen.index, regenerated_line(regen, indices))
                        if self.progress is not None:  # a Ray replica's driver keeps the progress
                            self.progress.update(1, tokens)
                    finally:
                        backend.release_replies(regen.replies)
                for future in sorted((f for f in finished if f in asked), key=lambda one: asked[one][0].index):
                    regen, indices = asked.pop(future)
                    reply = future.result()
                    last_reply = time.monotonic()
                    regen.answered(reply)
                    self.tally.replies += 1
                    self.tally.generated_tokens += len(reply.generated)
                    if self._go_on(regen, indices, asked, rowed):
                        running -= 1
                        lines.skip(regen.index)
        finally:
            for future in asked:  # replies still running when this fails: given back as they finish
                future.add_done_callback(self._release_reply)
            for future, (regen, _, _) in rowed.items():
                future.add_done_callback(lambda _, replies=regen.replies: backend.release_replies(replies))
            self.tally.reused += backend.reply_rows_reused - reused
            self.tally.in_place += backend.rows_in_place - in_place
            self.tally.replying_seconds += last_reply - started
            self.tally.row_states_seconds += time.monotonic() - last_reply
        return written

    def _interrupted(self) -> bool:
        return self.interrupt is not None and self.interrupt.requested is not None

    def _go_on(self, regen: Regeneration, indices: list[int], asked: dict, rowed: dict) -> bool:
        """Submit ``regen``'s next prompt; once every turn is answered, its rows. Returns whether the
        conversation is over without rows (skipped: a prompt too long)."""
        ids = self._next_prompt_ids(regen)
        if ids is not None:
            asked[self.backend.answer(ids, self.sampling, stream=self._stream_for(regen, indices))] = (regen, indices)
            return False
        if regen.kept.skip is not None or not regen.replies:
            self.backend.release_replies(regen.replies)
            return True
        samples, rows, sources = self._rows_of(regen, indices)
        rowed[self.backend.row_states(rows, sources)] = (regen, indices, samples)
        return False

    def open_sink(self) -> None:
        super().open_sink()
        self.chat = ChatTokenizer(load_tokenizer(self.settings.model_path, self.settings.trust_remote_code),
                                  self.format_name, self.settings.max_seq_len, self.settings.strict)

    def streams_files(self) -> bool:
        """Whether a reply's file is written while it is generated: speculators-0.5's (a row's layers
        side by side, so its rows go out as they come; speculators-0.3 stores each layer whole), when
        the file's layers are the backend's, in its order."""
        captured = len(self.backend.settings.layer_ids)
        return (os.environ.get(STREAM_ENV, "1") != "0" and self.format_name == SPECULATORS_05
                and self._layer_order == list(range(captured)))

    def _stream_for(self, regen: Regeneration, indices: list[int]) -> StreamedFile | None:
        """The file of ``regen``'s next reply's row (a row per reply: its sample is the reply's number
        among the conversation's), begun for its rows to go to as they land; None: not streamed."""
        if not self.streams_files():
            return None
        index = indices[len(regen.replies)]
        try:
            stream = StreamedFile(self.writer.temp_path(index))
        except OSError:  # written whole at the end, where the error, if it stays, is said
            return None
        self._streams[index] = stream
        return stream

    def write_lines(self, lines: list[dict]) -> None:
        for line in lines:
            self._lines.write(json.dumps(line, ensure_ascii=False) + "\n")
            self._with_lines.add(line["index"])
            self._lined_now.add(line["index"])
        self._lines.flush()

    def replica_batch(self, batch, skip: frozenset[int]) -> dict:
        """One batch in a Ray replica: :meth:`generate_batch`; returns the lines, the sample indices
        handed to the writer and the batch's counts (summary and tally) for the driver. ``skip`` is
        always empty: a generation batch runs again whole (``RayGeneration._again``)."""
        summary = self.summary
        before = (summary.extracted, summary.tokens, summary.computed_tokens)
        self.tally = Tally()
        lines, rows = self.generate_batch(batch)
        return {"lines": lines, "rows": rows, "tally": dataclasses.asdict(self.tally),
                "extracted": summary.extracted - before[0], "tokens": summary.tokens - before[1],
                "computed_tokens": summary.computed_tokens - before[2]}

    def generate_batch(self, batch) -> tuple[list[dict], list[int]]:
        """A Ray replica's batch ((Regeneration, sample indices) pairs), all of it in the engine at once
        (:meth:`regenerate_continuously`); returns the conversations' lines and the sample indices
        handed to the writer. Each conversation starts afresh from what is kept of it, so a batch run
        again is run whole."""
        lines: list[dict] = []
        written = self.regenerate_continuously(batch, len(batch), lines.extend)
        return lines, written

    def _next_prompt_ids(self, regen: Regeneration) -> list[int] | None:
        """``regen``'s next prompt, as token ids; None once every turn is answered, or for a prompt
        too long to answer (the conversation skipped, counted; ``--strict`` refuses it)."""
        settings, sampling = self.settings, self.sampling
        messages = regen.next_prompt()
        if messages is None:
            return None
        ids = self.chat.prompt_ids(messages, regen.kept.tools)
        if len(ids) + sampling.max_new_tokens > settings.max_seq_len:
            if settings.strict:
                raise InputError(f"{regen.where}: a prompt of {len(ids)} tokens and --max-new-tokens "
                                 f"{sampling.max_new_tokens} exceed --max-seq-len {settings.max_seq_len} "
                                 f"(--strict refuses it)")
            self.tally.skip(TOO_LONG)
            regen.kept = Kept([], regen.kept.tools, TOO_LONG)
            return None
        return ids

    def _release_reply(self, future: Future) -> None:
        if not future.cancelled() and future.exception() is None:
            self.backend.release_replies([future.result()])

    def _rows_of(self, regen: Regeneration, indices: list[int]) -> tuple[list[Sample], list[list[int]], list[Reply]]:
        """The training rows of ``regen`` (every turn answered) as ``extract`` tokenizes them, each with
        its sample and the reply it takes its first states from."""
        record = conversations.Record(regen.where, regen.line, {"messages": regen.messages, "tools": regen.kept.tools})
        made = self.chat.rows(record, conversations.MESSAGES)
        rows, sources, samples = [], [], []
        for row in made:
            source = row_source(row.input_ids, regen.replies)
            # a per-reply layout numbers rows by their reply; one row per conversation by it
            index = indices[source.reply] if len(indices) > 1 else indices[0]
            samples.append(Sample(index, regen.line, row.input_ids, row.loss_mask))
            rows.append(row.input_ids)
            sources.append(regen.replies[source.reply])
            self.tally.rerendered += source.rerendered
        self.tally.rows += len(made)
        if len({sample.index for sample in samples}) != len(samples):
            raise RuntimeError(f"{regen.where}: two rows of the regenerated conversation match one reply")
        return samples, rows, sources

    def _hand_rows(self, samples: list[Sample], states: list) -> int:
        """The rows' states to the writer; returns their tokens."""
        tokens = 0
        for sample, layers in zip(samples, states, strict=True):
            layers = fp8_states.pick(layers, self._layer_order)
            stream = self._streams.pop(sample.index, None)
            if stream is not None and stream.kept is not None and stream.error is None:
                record = self.format.streamed_record(sample, layers, stream)
                self.tally.streamed += 1
                self.tally.streamed_rows += min(stream.kept, stream.rows)
            else:
                if stream is not None:
                    stream.discard()
                record = self.format.record(sample, layers)
            self.writer.submit(sample.index, record)
            self.summary.extracted += 1
            self.summary.tokens += len(sample.input_ids)
            self.summary.computed_tokens += len(sample.input_ids)
            tokens += len(sample.input_ids)
        return tokens

    def finish(self) -> None:
        """Extract's end of run, then the lines' file closed (a shard's merged into
        ``regenerated.jsonl``) and what regeneration did said."""
        try:
            super().finish()
        finally:
            self.flush_lines()
            if self._lines is not None:
                self._lines.close()
                # a resumed run appends the conversations it redid after later ones kept: the file
                # goes back to input order, each conversation once, whatever stopped the run (a disk
                # too full for that leaves it to the next run's start, which does the same)
                try:
                    order_lines(self.output.path, self.source.tag, self.finished)
                except OutputError as exc:
                    self.log(f"warning: {regenerated_name(self.source.tag)} is left out of input order until the "
                             f"next run: {exc}")
                self._merge_shard_lines()
                # what this run finished: the samples of the conversations it wrote the line of
                # (every file whole), as extracted, finished and not extracted count them
                self.summary.extracted = sum(len(indices) for number, indices in self._all
                                             if number in self._lined_now)
                self.log(self.tally.line(self.tally.reused, self.summary.tokens - self.tally.reused))

    def flush_lines(self) -> None:
        """The lines still held when the run ends, the writer closed: those whose files are whole
        (a Ray driver's: its batches' whose files are confirmed)."""
        self._write_whole_lines(self.finished, give_up=True)

    def _merge_shard_lines(self) -> None:
        if self.source.tag is not None:
            merge_shards(self.output.path, self.finished)


class RayGeneration(RayExtraction, Generation):
    """``generate`` on ``--data-parallel-size`` Ray replicas: ``replicas.RayExtraction`` hands out the
    batches of conversations a single run makes, each replica regenerating them on its own
    ``vllm-engine`` backend (:meth:`Generation.replica_batch`). A batch's lines come back with its call;
    the driver writes them, in hand-out order, once every file the batch wrote is confirmed on disk,
    and counts the batch then: ``regenerated.jsonl``, the summary and the tally are a single run's."""

    def __init__(self, settings, sampling: Sampling, **kwargs):
        super().__init__(settings, sampling=sampling, **kwargs)
        self._returned: dict[int, ReplicaBatch] = {}  # by hand-out number: returned, lines not written yet
        self._next_line = 0  # the batch whose lines are written next

    def generate_all(self, todo) -> None:
        """Batches of ``--batch-size`` conversations, each handed to a replica as one is free (whole
        conversations: a later turn needs the earlier replies); after Ctrl-C none more."""
        for start in range(0, len(todo), self.settings.batch_size):
            self.hand_out(todo[start:start + self.settings.batch_size])
            if self._interrupted():
                break

    def _batch_of(self, conversations_batch) -> ReplicaBatch:
        return ReplicaBatch(conversations_batch, [index for _, indices in conversations_batch for index in indices],
                     ", ".join(f"{indices} ({regen.where})" for regen, indices in conversations_batch))

    def _account(self, handle: Handle, batch: ReplicaBatch, result: dict) -> None:
        batch.result = result
        written = set(result["rows"])
        for index in set(batch.indices) - written:  # a conversation the replica skipped (too long): no file
            handle.unconfirmed.pop(index, None)
        batch.outstanding &= written
        self._returned[batch.number] = batch

    def _progressed(self) -> None:
        """Write the lines of the batches whose files are all on disk, in hand-out order."""
        while self._next_line in self._returned and not self._returned[self._next_line].outstanding:
            self._complete(self._returned.pop(self._next_line))
            self._next_line += 1

    def _complete(self, batch: ReplicaBatch) -> None:
        result = batch.result
        self.write_lines(result["lines"])
        self.tally.add(result["tally"])
        self.summary.extracted += result["extracted"]
        self.summary.tokens += result["tokens"]
        self.summary.computed_tokens += result["computed_tokens"]
        self.progress.update(len(result["lines"]), result["tokens"])

    def _unreturned(self, replica_id: int, failed: ReplicaBatch) -> list[ReplicaBatch]:
        """Its batch that failed and its calls still queued: their lines never came back, whatever
        of their files the replica wrote (its writer drained as it retired)."""
        return [failed, *(batch for rid, batch in self.calls.values() if rid == replica_id and batch.result is None)]

    def _again(self, lost: ReplicaBatch) -> ReplicaBatch | None:
        """A batch of a retired replica: done when its call returned and every file it wrote is whole
        (renamed into place before the death); else run again whole: every conversation regenerated,
        its files rewritten, its line the new run's (no file of a first attempt beside a line of the
        second, whatever the sampling)."""
        if lost.result is not None:
            lost.outstanding = {index for index in lost.outstanding if not self._whole(index)}
            if not lost.outstanding:
                for index in lost.result["rows"]:
                    self.finished.setdefault(index, None)
                return None
        self._returned.pop(lost.number, None)
        return dataclasses.replace(lost, result=None, skip=frozenset())

    def flush_lines(self) -> None:
        """At the end: the lines of every batch whose files are whole, those after a batch given up
        included (the files decide what a rerun redoes: a conversation is done with its line)."""
        self._progressed()
        for number in sorted(self._returned):
            batch = self._returned[number]
            batch.outstanding = {index for index in batch.outstanding if not self._whole(index)}
            if not batch.outstanding:
                self._complete(self._returned.pop(number))


class _InOrder:
    """Hands ``write`` the lines of conversations numbered ``order`` in that order, each as soon as every
    one before it has its line or was skipped."""

    def __init__(self, order: list[int], write):
        self._order, self._write, self._next = order, write, 0
        self._held: dict[int, dict | None] = {}

    def put(self, number: int, line: dict) -> None:
        self._held[number] = line
        self._flush()

    def skip(self, number: int) -> None:
        self._held[number] = None
        self._flush()

    def _flush(self) -> None:
        ready = []
        while self._next < len(self._order) and self._order[self._next] in self._held:
            line = self._held.pop(self._order[self._next])
            if line is not None:
                ready.append(line)
            self._next += 1
        if ready:
            self._write(ready)


def regenerated_line(regen: Regeneration, indices: list[int]) -> dict:
    """A conversation as regenerated: its place in the input, its sample files, its messages, and
    per reply the generated ids and vLLM's finish reason."""
    replies: list[Reply] = regen.replies
    return {"index": regen.index, "source": regen.where, "sample_indices": indices, "messages": regen.messages,
            **({"tools": regen.kept.tools} if regen.kept.tools else {}),
            "generated": [{"token_ids": reply.generated, "finish_reason": reply.finish_reason} for reply in replies]}


def sampling_from(args) -> Sampling:
    """The sampling flags (``cli.py``'s generate command) as :class:`Sampling`."""
    return Sampling(temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.max_new_tokens,
                    seed=args.seed, ignore_eos=args.ignore_eos)

