"""Conversations kept in the engine, turn by turn (``generate``'s loop, on one process and in each
Ray replica): ``--batch-size`` conversations at once, each user turn answered as its turn comes (the
conversation's next prompt submitted as soon as its reply is in, while the others' still run), each
reply's rows streamed into its region as the engine generates (``VllmEngineBackend.answer``); a
conversation whose every turn is answered is tokenized as ``extract`` tokenizes conversations
(``--format``'s layout), each row matched with its reply (``regeneration.row_source``) and prefilled
under that reply's cache salt: vLLM computes only what its prefix cache lacks, the rest is the
reply's (``VllmEngineBackend.row_states``); its rows go to the background writer as soon as their
states are in, and the next conversation takes its place in the engine.

A reply's file (speculators-0.5, the backend's layers in its order) is begun while the reply is
generated: the writer hands it out (``BackgroundWriter.sink``), the backend streams the reply's rows
into it, and the writer finishes it with the row's states (``BackgroundWriter.write``).
The loop never sees the format.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait

from .. import fp8_states
from ..certify.certifier import write_certified
from ..inputs import conversations
from ..backends import Reply, Sampling
from ..errors import InputError
from ..inputs.streams import Sample
from ..progress import Progress
from ..inputs.tokenization import ChatTokenizer
from .lines import InOrder, regenerated_line
from .regeneration import TOO_LONG, Kept, Regeneration, Tally, row_source


class ContinuousRegeneration:
    """``generate``'s loop on ``model`` (``run.model_here.ModelHere``: its backend and writer).

    Args:
        chat: the chat template's tokenizer (prompts, and the rows of a regenerated conversation).
        streams: whether a reply's file is written while it is generated.
        interrupted: () -> whether a signal asked the run to stop (no conversation is started then).
        progress: the run's progress (None in a Ray replica: the driver keeps it).

    Attributes:
        tally: what regeneration did (``regeneration.Tally``); a Ray replica takes a new one per batch.
    """

    def __init__(self, model, chat: ChatTokenizer, sampling: Sampling, settings, summary, *,
                 streams: bool, interrupted: Callable[[], bool] = lambda: False, progress: Progress | None = None):
        self.backend, self.writer, self.layer_order = model.backend, model.writer, model.layer_order
        # None: rows written uncertified (the load said why); else each reply asks for the engine's
        # logprobs with its tokens, which certify its training row before it is written
        self.certifier = getattr(model, "certifier", None)
        self.chat, self.sampling, self.settings, self.summary = chat, sampling, settings, summary
        self.streams, self._interrupted, self.progress = streams, interrupted, progress
        self.tally = Tally()

    def run(self, todo, window: int, write_lines) -> list[int]:
        """Keep ``--batch-size`` conversations in the engine: each user turn answered as its turn comes
        (the conversation's next prompt submitted as soon as its reply is in), each conversation's rows
        prefilled as soon as its last reply is in and handed to the writer as soon as they are, and the
        next conversation of ``todo`` started in its place. No conversation waits for another's longer
        reply, and the engine never waits for the rows of a batch. The lines go to ``write_lines`` in
        input order (a conversation's once those before it are written or skipped). After Ctrl-C no
        conversation is started; those in the engine finish. Returns the sample indices handed to the
        writer."""
        backend, written = self.backend, []
        reused, in_place, one_pass = backend.reply_rows_reused, backend.rows_in_place, backend.rows_from_replies
        waiting = iter(todo)
        asked: dict[Future, tuple[Regeneration, list[int]]] = {}  # a reply's request -> its conversation
        rowed: dict[Future, tuple[Regeneration, list[int], list[Sample]]] = {}  # rows' states -> their conversation
        lines = InOrder([regen.index for regen, _ in todo], write_lines)
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
            self.tally.one_pass_rows += backend.rows_from_replies - one_pass
            self.tally.replying_seconds += last_reply - started
            self.tally.row_states_seconds += time.monotonic() - last_reply
        return written

    def _go_on(self, regen: Regeneration, indices: list[int], asked: dict, rowed: dict) -> bool:
        """Submit ``regen``'s next prompt; once every turn is answered, its rows. Returns whether the
        conversation is over without rows (skipped: a prompt too long)."""
        ids = self._next_prompt_ids(regen)
        if ids is not None:
            asked[self.backend.answer(ids, self.sampling, stream=self._stream_for(regen, indices),
                                      certified=self.certified)] = (regen, indices)
            return False
        if regen.kept.skip is not None or not regen.replies:
            self.backend.release_replies(regen.replies)
            return True
        samples, rows, sources = self._rows_of(regen, indices)
        rowed[self.backend.row_states(rows, sources, certified=self.certified)] = (regen, indices, samples)
        return False

    @property
    def certified(self) -> bool:
        return self.certifier is not None

    def _stream_for(self, regen: Regeneration, indices: list[int]):
        """The file of ``regen``'s next reply's row (a row per reply: its sample is the reply's number
        among the conversation's), handed out by the writer for its rows to go to as they land (a
        sink); None: not streamed."""
        return self.writer.sink(indices[len(regen.replies)]) if self.streams else None

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
        """The rows' states to the writer, a conversation's rows certified first in one pass (a row that
        fails stops the run there, the rows before it written); returns their tokens."""
        witnessed = states if self.certified else [(layers, None) for layers in states]  # (layers, witness)
        write_certified(self.certifier, [(sample, fp8_states.pick(layers, self.layer_order), witness)
                                         for sample, (layers, witness) in zip(samples, witnessed, strict=True)],
                        self._write_row)
        return sum(len(sample.input_ids) for sample in samples)

    def _write_row(self, sample: Sample, layers: list, extra: dict | None) -> None:
        """One row to the writer (``extra``: its certificate's tensors), counted."""
        streamed = self.writer.write(sample, layers, extra)
        if streamed is not None:
            self.tally.streamed += 1
            self.tally.streamed_rows += min(streamed.kept, streamed.rows)
        self.summary.extracted += 1
        self.summary.tokens += len(sample.input_ids)
        self.summary.computed_tokens += len(sample.input_ids)
