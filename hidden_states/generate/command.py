"""One ``hidden-states generate`` run: extract's plan and prepare (``run.prepared.PreparedRun``: the
same settings, model, layers, output directory, with the sampling settings added to the identity:
a rerun with other sampling is another extraction, resume otherwise), the same lifecycle
(``run.lifecycle.Lifecycle``: ``--backend vllm-engine`` only, the replies' rows are in its regions),
and a loop of its own over conversations, not samples: ``continuous.ContinuousRegeneration`` here,
or batches of whole conversations handed to Ray replicas (``on_ray.ConversationBatches``).

Sample indices: conversation ``i`` is sample ``i`` (``speculators-0.3``, one row per conversation);
with ``speculators-0.5`` (a row per reply) a conversation's rows are numbered on from the replies of
the conversations before it, counted in the input (one per user turn of each conversation regenerated;
none for one skipped for its tool turns) before anything is generated: so a conversation's numbers
depend on the input alone, never on which process or replica runs what. A conversation is finished
when every one of its rows' files is whole and its line is in ``regenerated.jsonl`` (``lines.py``).

A static shard (``--shard I/N``) regenerates every ``N``-th batch of conversations
(``ShardBatches.owns`` on conversation numbers) with its own ledger and its own
``regenerated.<tag>.jsonl``.
"""
from __future__ import annotations

import dataclasses
import os
import time

from ..inputs import conversations
from ..backends import Sampling
from ..plan.batches import BatchSource, batch_source
from ..errors import InputError, PreflightError, UsageError
from ..inputs.streams import trained_token_counts
from ..layer_conventions import SPECULATORS_05
from ..progress import Progress, log_to_stderr
from ..replicas.driver import RayReplicas, on_ray
from ..run.lifecycle import Lifecycle
from ..run.model_here import ModelHere
from ..run.prepared import PreparedRun
from ..run.summary import Summary
from ..plan.run_plan import RunPlan
from ..settings import Settings
from ..inputs.tokenization import ChatSettings, ChatTokenizer, save_token_frequencies, unknown_role_policy
from .continuous import ContinuousRegeneration
from .fit import Fit, prompt_room
from .lines import RegeneratedLines
from .on_ray import ConversationBatches
from .regeneration import Regeneration, Tally, kept, regenerated_name

BACKEND = "vllm-engine"
STREAM_ENV = "VLLM_COMPAT_STREAM_FILES"  # 0: speculators-0.5 files written when their rows are done (to compare)
BATCHES_HELD = 4  # a batch's replies and its rows at once, besides what extract holds

# why generate refuses vLLM's own path (found building it: docs/guides/generate.md, "On-policy rows in one pass")
NATIVE_REPLIES = ("under vLLM's extract_hidden_states, greedy replies of requests sharing the engine part from the "
                  "model's own greedy output: they would not be its answers")


class Generation:
    """One ``hidden-states generate`` run (see the module's docstring).

    Attributes:
        prepared: the plan and the output directory (``run.prepared.PreparedRun``).
        summary, tally: what the run did; what regeneration did.
    """

    def __init__(self, settings: Settings, sampling: Sampling, *, log=None, source: BatchSource | None = None):
        self.settings, self.sampling = settings, sampling
        self.log = log or log_to_stderr
        self.source = source or batch_source(settings)
        self.summary = Summary()
        self.tally = Tally()
        self.on_ray = on_ray(settings)
        self.prepared = PreparedRun(settings, self.source, log=self.log, loads_model_here=not self.on_ray,
                                    batches_held=BATCHES_HELD, runner=Generation)
        self.lifecycle = Lifecycle(self.prepared, self.summary, log=self.log, unfinished=self.unfinished)
        self.lines: RegeneratedLines | None = None
        self.chat: ChatTokenizer | None = None
        self._all: list[tuple[int, list[int]]] = []  # (conversation, its sample indices) of the range
        self._conversations = 0  # in the input, once read
        self._read: list = []  # (conversation, where, line, what is kept of it, its sample indices) in range
        self._kind: ConversationBatches | None = None

    @classmethod
    def executing(cls, plan: RunPlan, *, log=None) -> GenerateReplica:
        """What a Ray replica runs of ``plan`` (the sampling is in its config's identity)."""
        return GenerateReplica(plan, log=log or log_to_stderr)

    # -- plan: extract's, with the sampling checked and in the identity
    def plan(self) -> None:
        settings, sampling = self.settings, self.sampling
        given = "--backend"
        if settings.backend is None:  # generate's one backend: nothing to choose
            settings.backend, given = BACKEND, "the one generate runs on"
        if settings.backend != BACKEND:
            why = NATIVE_REPLIES if settings.backend == "vllm-native" else "the replies' rows are kept in its regions"
            raise UsageError(f"--backend {settings.backend}: generate runs on --backend {BACKEND} ({why})")
        if sampling.temperature < 0:
            raise UsageError(f"--temperature {sampling.temperature}: must be at least 0 (0: greedy)")
        if not 0 < sampling.top_p <= 1:
            raise UsageError(f"--top-p {sampling.top_p}: must be more than 0 and at most 1")
        if sampling.max_new_tokens >= settings.max_seq_len:
            raise UsageError(f"--max-new-tokens {sampling.max_new_tokens}: must be below --max-seq-len "
                             f"{settings.max_seq_len} (a prompt and its reply make one row)")
        # as ``extract`` would read them the input may hold no sample at all: with speculators-0.5 (a
        # row per assistant turn) prompts with no reply yet make none, and their rows are the
        # regenerated replies'. The sampling joins the run's identity: a rerun with other sampling is
        # another extraction. The stream the plan opens is the one the conversations are read from
        prepared = self.prepared
        prepared.plan(identity={"generation": dataclasses.asdict(sampling)}, samples_optional=True, keep_records=True,
                      backend_given=given)
        first = prepared.input.first_record()
        if first is None:
            raise PreflightError(f"{settings.prepared_data}: no conversations")
        if conversations.kind_of(first) not in (conversations.SHAREGPT, conversations.MESSAGES):
            raise InputError(f"{first.where}: a {conversations.kind_of(first)} row; generate regenerates "
                             f"conversations (ShareGPT 'conversations' or OpenAI 'messages')")
        fit = self._read_conversations()
        fit.refuse_certain()  # before anything is written or generated
        prepared.hold(dataclasses.replace(prepared.planned, lines=[
            *prepared.planned.lines, f"regeneration: every user turn answered again ({describe(sampling)}); the "
                                     f"time above is the rows' prefill alone",
            *filter(None, [fit.may_skip_line()])]))
        self.summary.layer_ids = prepared.format_layer_ids

    # -- run
    def run(self) -> Summary:
        prepared = self.prepared
        try:
            self.plan()
            prepared.log_plan()
            prepared.prepare()
            self.lines = RegeneratedLines(prepared.output.path, self.source.tag, log=self.log)
            self.lines.keep_finished(prepared.finished)
            todo = list(self._conversations_to_do())
            if not todo:
                prepared.output.finish(prepared.finished)
                self.lines.merge_shards(prepared.finished)
                self.write_token_frequencies()
                return self.summary
            if self.on_ray:
                self._kind = ConversationBatches(self.lines, self.tally)
                runner = RayReplicas(prepared, self.summary, self._kind, log=self.log, unfinished=self.unfinished)
            else:
                runner = ModelHere(prepared, self.summary, log=self.log, batches_held=BATCHES_HELD)
            summary = self.lifecycle.run(runner, lambda: self.generate(runner, todo), then=lambda: self.finish(runner))
            self.write_token_frequencies()
            return summary
        finally:
            prepared.unlock()

    def generate(self, runner, todo) -> None:
        """Regenerate ``todo``: here, ``--batch-size`` conversations at a time in the engine, the next
        one started as soon as one is done; on Ray, batches of them handed to the replicas."""
        settings, lifecycle = self.settings, self.lifecycle
        self.log("generating")
        lifecycle.started = time.monotonic()
        progress = Progress(len(todo), log=self.log, exact=True, interval=settings.progress_interval)
        lifecycle.interrupt.extracting = True
        self.lines.open()
        if self.on_ray:
            runner.progress = progress
            for start in range(0, len(todo), settings.batch_size):
                runner.hand_out(todo[start:start + settings.batch_size])
                if lifecycle.interrupted():
                    break
        else:
            runner.open_writer()
            loop = ContinuousRegeneration(runner, self.chat, self.sampling, settings,
                                          self.summary, streams=streams_files(runner, self.prepared),
                                          interrupted=lifecycle.interrupted, progress=progress)
            loop.tally = self.tally
            loop.run(todo, settings.batch_size, lambda lines: self.lines.when_whole(lines, runner.writer.stats.lengths))
        if lifecycle.interrupt.requested is not None:
            self.summary.interrupted = lifecycle.interrupt.requested
        progress.close()

    def finish(self, runner) -> None:
        """After the lifecycle's end of run: the lines still held written (those whose files are
        whole), the lines' file closed and put in order (a shard's merged), what regeneration did said."""
        if self.lines is None or not self.lines.opened:
            return
        if self._kind is not None:
            self._kind.flush(runner)
        else:
            self.lines.write_whole(self.prepared.finished, give_up=True)
        self.lines.close(self.prepared.finished)
        # what this run finished: the samples of the conversations it wrote the line of (every file
        # whole), as extracted, finished and not extracted count them
        self.summary.extracted = sum(len(indices) for number, indices in self._all if number in self.lines.lined_now)
        self.log(self.tally.line(self.tally.reused, self.summary.tokens - self.tally.reused))

    def write_token_frequencies(self) -> None:
        """``token_freq.pt`` in the output directory where the format's trainer reads it
        (speculators-0.5; ``OutputDir.token_frequencies``) once every conversation of the input is
        done (the whole input in range, none left): the trained tokens of ``regenerated.jsonl``'s
        rows, counted as ``prepare`` counts that file (the rows the trainer reads are the regenerated
        ones). A shard, a partial range or a run that stopped leaves it as it is; a speculators-0.3
        run writes none."""
        settings, prepared = self.settings, self.prepared
        path = prepared.output.token_frequencies
        whole = settings.start_index == 0 and (settings.end_index is None or settings.end_index >= self._conversations)
        if path is None or not whole or self.source.tag is not None or self.unfinished()[0]:
            return
        counts = trained_token_counts(chat_settings(prepared), prepared.output.path / regenerated_name(None),
                                      tokenizer=prepared.input.tokenizer)
        save_token_frequencies(dict(counts), path)

    def unfinished(self) -> tuple[int, bool]:
        """(samples of the conversations of the range, or the shard's share, not done: a file missing,
        or the line), counted as the summary counts what is extracted and finished."""
        done, lined = set(self.prepared.finished), self.lines.with_lines if self.lines is not None else set()
        return sum(len(indices) for number, indices in self._all if not set(indices) <= done or number not in lined), True

    def _read_conversations(self) -> Fit:
        """Read the whole input once (the plan's stream, from its first row; its conversations checked
        as they are read) into what is kept of each conversation and its sample indices, and measure
        the prompts of those this run regenerates against ``--max-seq-len``."""
        settings, prepared = self.settings, self.prepared
        per_reply = prepared.format_name == SPECULATORS_05
        owns = self.source.owns
        # a turn with an unknown role is context, never regenerated: skipped or kept as an assistant
        # turn as extract tokenizes it (the kept turns are the system and user ones); --strict refuses it
        unknown_roles = conversations.REFUSE if settings.strict else unknown_role_policy(prepared.format_name)
        self.chat = prepared.input.tokenizer or chat_settings(prepared).tokenizer()  # loaded once, for every use
        fit = Fit(settings.max_seq_len, self.sampling.max_new_tokens)
        self._read, base = [], 0
        for number, record in enumerate(prepared.input.records()):
            self._conversations = number + 1
            kind = conversations.kind_of(record)
            if kind not in (conversations.SHAREGPT, conversations.MESSAGES):
                raise InputError(f"{record.where}: a {kind} row; generate regenerates conversations (ShareGPT "
                                 f"'conversations' or OpenAI 'messages')")
            what = kept(conversations.conversation(record, kind, unknown_roles))
            indices = list(range(base, base + what.replies)) if per_reply else [number]
            base += what.replies
            if not settings.in_range(number) or not owns(number, settings.start_index, settings.batch_size):
                continue  # out of range, or another shard's
            self._read.append((number, record.where, record.line, what, indices))
            if not what.skip:
                fit.add(prompt_room(self.chat, record.where, what))
        return fit

    def _conversations_to_do(self):
        """(Regeneration, its sample indices) of each conversation read in range not finished yet; the
        skipped ones counted."""
        prepared = self.prepared
        self._all = []
        finished, lined = set(prepared.finished), self.lines.with_lines
        for number, where, line, what, indices in self._read:
            if what.skip:
                self.tally.skip(what.skip)
                continue
            self._all.append((number, indices))
            # done: every row's file whole and the conversation's line kept (a run that stopped between
            # them regenerates it)
            if set(indices) <= finished and number in lined:
                self.summary.skipped += len(indices)
                continue
            yield Regeneration(number, where, line, what), indices


class GenerateReplica:
    """What a Ray replica runs of a generation's plan: conversations regenerated on the model here."""

    def __init__(self, plan: RunPlan, *, log):
        self.prepared = PreparedRun.adopt(plan, log=log)
        self.summary = Summary(layer_ids=self.prepared.format_layer_ids)
        self.model = ModelHere(self.prepared, self.summary, log=log, batches_held=BATCHES_HELD)
        self.sampling = Sampling(**plan.config["generation"])
        self.loop: ContinuousRegeneration | None = None

    def start(self) -> None:
        """Load the model, open the writer, load the chat template's tokenizer."""
        self.model.load()
        self.model.open_writer()
        self.loop = ContinuousRegeneration(self.model, chat_settings(self.prepared).tokenizer(),
                                           self.sampling, self.prepared.run_plan.settings, self.summary,
                                           streams=streams_files(self.model, self.prepared))

    def replica_batch(self, batch, skip: frozenset[int]) -> dict:
        """One batch of whole conversations, all of it in the engine at once (each starts afresh from
        what is kept of it, so a batch run again is run whole: ``skip`` is always empty); returns the
        lines, the sample indices handed to the writer and the batch's counts for the driver."""
        summary, loop = self.summary, self.loop
        before = (summary.extracted, summary.tokens, summary.computed_tokens)
        loop.tally = Tally()
        lines: list[dict] = []
        rows = loop.run(batch, len(batch), lines.extend)
        return {"lines": lines, "rows": rows, "tally": dataclasses.asdict(loop.tally),
                "extracted": summary.extracted - before[0], "tokens": summary.tokens - before[1],
                "computed_tokens": summary.computed_tokens - before[2]}


def chat_settings(prepared: PreparedRun) -> ChatSettings:
    """How the run's conversations are tokenized: the model's chat template, ``--format``'s layout."""
    settings = prepared.run_plan.settings
    return ChatSettings(settings.model_path, prepared.format_name, settings.max_seq_len, settings.trust_remote_code,
                        settings.strict)


def streams_files(model: ModelHere, prepared: PreparedRun) -> bool:
    """Whether a reply's file is written while it is generated: speculators-0.5's (a row's layers
    side by side, so its rows go out as they come; speculators-0.3 stores each layer whole), when
    the file's layers are the backend's, in its order."""
    captured = len(model.backend.settings.layer_ids)
    return (os.environ.get(STREAM_ENV, "1") != "0" and prepared.format_name == SPECULATORS_05
            and model.layer_order == list(range(captured)))


def describe(sampling: Sampling) -> str:
    s = sampling
    return (f"temperature {s.temperature}, top-p {s.top_p}, at most {s.max_new_tokens} new tokens"
            + (f", seed {s.seed}" if s.seed is not None else "") + (", ignoring EOS" if s.ignore_eos else ""))


def sampling_from(args) -> Sampling:
    """The sampling flags (the CLI's generate command) as :class:`Sampling`."""
    return Sampling(temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.max_new_tokens,
                    seed=args.seed, ignore_eos=args.ignore_eos)
