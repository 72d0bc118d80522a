"""``hidden-states generate``: regenerate the input's replies and write the training rows of the
regenerated conversations with the states the generation computed (docs/extractor.md, "On-policy
rows in one pass").

An :class:`~hidden_states.extraction.Extraction` in everything but its loop: the same plan
(settings, model, layers, the output directory read), the same output directory (format, identity
with the sampling settings added: a rerun with other sampling is another extraction, resume
otherwise), load (``--backend vllm-engine`` only: the replies' rows are in its regions) and finish.
The loop reads conversations, not samples:

* a batch of ``--batch-size`` conversations is regenerated turn by turn (``regeneration``: every
  conversation's first user turn answered, then the second, ...), each reply's rows streamed into
  its region as the engine generates (``VllmEngineBackend.generate``);
* the regenerated conversations are tokenized as ``extract`` tokenizes conversations (``--format``'s
  layout), each row matched with its reply (``regeneration.row_source``) and prefilled under that
  reply's cache salt: vLLM computes only what its prefix cache lacks, the rest is copied from the
  reply's region (``VllmEngineBackend.row_states``);
* the rows go to the background writer; the conversation, as regenerated, to ``regenerated.jsonl``.

Sample indices: conversation ``i`` is sample ``i`` (``speculators-0.3``, one row per conversation);
with ``speculators-0.5`` (a row per reply) a conversation's rows are numbered on from the replies of
the conversations before it. A conversation is finished when every one of its rows' files is whole;
``regenerated.jsonl`` keeps, at the start of a run, only the lines of finished conversations.
"""
from __future__ import annotations

import dataclasses
import json
import time

from . import conversations, fp8_states
from .backends.vllm_engine import Reply, Sampling
from .errors import InputError, UsageError
from .extraction import PLAN_DETAILS, Extraction
from .inputs import Sample
from .layer_conventions import SPECULATORS_05
from .progress import Progress
from .regeneration import TOO_LONG, Kept, Regeneration, Tally, kept, row_source
from .tokenization import ChatTokenizer, load_tokenizer

REGENERATED = "regenerated.jsonl"
BACKEND = "vllm-engine"


class Generation(Extraction):
    """One ``hidden-states generate`` run (see the module's docstring)."""

    batches_held = 4  # a batch's replies and its rows at once, besides what extract holds

    def __init__(self, settings, sampling: Sampling, *, log=None):
        super().__init__(settings, log=log)
        self.sampling = sampling
        self.tally = Tally()
        self.chat: ChatTokenizer | None = None
        self._all: list[tuple[int, list[int]]] = []  # (conversation, its sample indices) of the range

    # -- plan and prepare: extract's, with the sampling in the identity
    def plan(self) -> None:
        settings = self.settings
        if settings.backend != BACKEND:
            raise UsageError(f"--backend {settings.backend}: generate runs on --backend {BACKEND} (the replies' "
                             f"rows are kept in its regions)")
        if settings.data_parallel_size > 1 or settings.ray_address or settings.shard is not None:
            raise UsageError("generate runs in one process: --data-parallel-size, --ray-address and --shard are "
                             "not supported yet")
        if self.sampling.temperature < 0:
            raise UsageError(f"--temperature {self.sampling.temperature}: must be at least 0 (0: greedy)")
        if not 0 < self.sampling.top_p <= 1:
            raise UsageError(f"--top-p {self.sampling.top_p}: must be more than 0 and at most 1")
        if self.sampling.max_new_tokens >= settings.max_seq_len:
            raise UsageError(f"--max-new-tokens {self.sampling.max_new_tokens}: must be below --max-seq-len "
                             f"{settings.max_seq_len} (a prompt and its reply make one row)")
        first = next(iter(conversations.open_source(settings.prepared_data)), None)
        if first is not None and conversations.kind_of(first) not in (conversations.SHAREGPT, conversations.MESSAGES):
            raise InputError(f"{first.where}: a {conversations.kind_of(first)} row; generate regenerates "
                             f"conversations (ShareGPT 'conversations' or OpenAI 'messages')")
        super().plan()
        self.plan_lines.append(f"regeneration: every user turn answered again ({self.describe_sampling()}); the time "
                               f"above is the rows' prefill alone")

    def describe_sampling(self) -> str:
        s = self.sampling
        return (f"temperature {s.temperature}, top-p {s.top_p}, at most {s.max_new_tokens} new tokens"
                + (f", seed {s.seed}" if s.seed is not None else "") + (", ignoring EOS" if s.ignore_eos else ""))

    def _check_output_dir(self) -> set[int]:
        self.identity["generation"] = dataclasses.asdict(self.sampling)
        return super()._check_output_dir()

    # -- run
    def run(self):
        self.plan()
        for line in self.plan_lines:  # as extract: the plan's details to the log file
            self.log(f"debug: {line}" if line.startswith(PLAN_DETAILS) else line)
        self.prepare()
        self._keep_finished_lines()
        todo = list(self._conversations_to_do())
        if not todo:
            self.output.finish(self.finished)
            return self.summary
        return self.loaded(lambda: self.generate(todo))

    def unfinished(self) -> tuple[int, bool]:
        done = set(self.finished)
        return sum(1 for conv in self._all if not set(conv[1]) <= done), True

    def _conversations_to_do(self):
        """(Regeneration, its sample indices) of each conversation in range not finished yet; the
        skipped ones counted. Reads the whole input (conversations, checked as they are read)."""
        settings, per_reply = self.settings, self.format_name == SPECULATORS_05
        source = conversations.open_source(self.input.path)
        self._all, base = [], 0
        for number, record in enumerate(source):
            kind = conversations.kind_of(record)
            if kind not in (conversations.SHAREGPT, conversations.MESSAGES):
                raise InputError(f"{record.where}: a {kind} row; generate regenerates conversations (ShareGPT "
                                 f"'conversations' or OpenAI 'messages')")
            what = kept(conversations.conversation(record, kind))
            indices = list(range(base, base + what.replies)) if per_reply else [number]
            base += what.replies
            if not settings.in_range(number):
                continue
            if what.skip:
                self.tally.skip(what.skip)
                continue
            self._all.append((number, indices))
            if set(indices) <= set(self.finished):
                self.summary.skipped += 1
                continue
            yield Regeneration(number, record.where, record.line, what), indices

    def generate(self, todo) -> None:
        """Regenerate ``todo`` a batch at a time; hand each batch's rows to the writer."""
        settings = self.settings
        self.chat = ChatTokenizer(load_tokenizer(settings.model_path, settings.trust_remote_code), self.format_name,
                                  settings.max_seq_len, settings.strict)
        self.log("generating")
        self._started = time.monotonic()
        self.open_sink()
        self.progress = Progress(len(todo), log=self.log, exact=True, interval=settings.progress_interval)
        self.interrupt.extracting = True
        with open(self.output.path / REGENERATED, "a", encoding="utf-8") as lines:
            for start in range(0, len(todo), settings.batch_size):
                self._batch(todo[start:start + settings.batch_size], lines)
                if self.interrupt.requested is not None:
                    self.summary.interrupted = self.interrupt.requested
                    break
        self.progress.close()
        reused = self.backend.reply_rows_reused
        self.log(self.tally.line(reused, self.summary.tokens - reused))

    def _batch(self, batch, lines) -> None:
        settings, sampling = self.settings, self.sampling
        active = [regen for regen, _ in batch]
        while active:
            asked, prompts = [], []
            for regen in active:
                messages = regen.next_prompt()
                if messages is None:
                    continue
                ids = self.chat.prompt_ids(messages, regen.kept.tools)
                if len(ids) + sampling.max_new_tokens > settings.max_seq_len:
                    if settings.strict:
                        raise InputError(f"{regen.where}: a prompt of {len(ids)} tokens and --max-new-tokens "
                                         f"{sampling.max_new_tokens} exceed --max-seq-len {settings.max_seq_len} "
                                         f"(--strict refuses it)")
                    self.tally.skip(TOO_LONG)
                    regen.kept = Kept([], regen.kept.tools, TOO_LONG)
                    continue
                asked.append(regen)
                prompts.append(ids)
            if not asked:
                break
            for regen, reply in zip(asked, self.backend.generate(prompts, sampling).result(), strict=True):
                regen.answered(reply)
                self.tally.replies += 1
                self.tally.generated_tokens += len(reply.generated)
            active = asked
        done = [(regen, indices) for regen, indices in batch if regen.kept.skip is None and regen.replies]
        try:
            self._write_rows(done, lines)
        finally:
            self.backend.release_replies([reply for regen, _ in batch for reply in regen.replies])

    def _write_rows(self, done, lines) -> None:
        rows, sources, samples = [], [], []
        for regen, indices in done:
            record = conversations.Record(regen.where, regen.line,
                                          {"messages": regen.messages, "tools": regen.kept.tools})
            made = self.chat.rows(record, conversations.MESSAGES)
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
        states = self.backend.row_states(rows, sources).result() if rows else []
        for sample, layers in zip(samples, states, strict=True):
            layers = fp8_states.pick(layers, self._layer_order)
            self.writer.submit(sample.index, self.format.record(sample, layers))
            self.summary.extracted += 1
            self.summary.tokens += len(sample.input_ids)
            self.summary.computed_tokens += len(sample.input_ids)
        for regen, indices in done:
            lines.write(json.dumps(regenerated_line(regen, indices), ensure_ascii=False) + "\n")
            self.tally.conversations += 1
        lines.flush()
        self.progress.update(len(done), sum(len(ids) for ids in rows))

    def _keep_finished_lines(self) -> None:
        """``regenerated.jsonl`` as left by earlier runs, less the lines of conversations whose rows are
        not all finished (a run that stopped between the line and the files): they are regenerated."""
        path = self.output.path / REGENERATED
        if not path.exists():
            return
        done, kept_lines = set(self.finished), []
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                indices = json.loads(line)["sample_indices"]
            except (ValueError, KeyError, TypeError):
                continue
            if set(indices) <= done:
                kept_lines.append(line)
        path.write_text("".join(line + "\n" for line in kept_lines), encoding="utf-8")


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

