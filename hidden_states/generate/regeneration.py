"""Conversations regenerated as speculators 0.9's ``regenerate-responses`` does, and their training
rows matched with the replies whose states they reuse (``hidden-states generate``;
docs/guides/generate.md, "On-policy rows in one pass").

What is kept of an input conversation: its system and user turns, in order; its assistant turns are
dropped, each user turn is answered again, the conversation so far (replies regenerated for the
earlier turns included) rendered with the generation prompt. A conversation with tool turns is
skipped (speculators 0.9 splices cached tool results into regenerated tool calls, which needs a
tool-call parser).

The training rows are the regenerated conversation tokenized as ``extract`` tokenizes conversations
(``tokenization.ChatTokenizer``: ``--format``'s layout, the assistant-only mask). Each row takes its
first states from the latest reply whose prompt it begins with (:func:`row_source`: a per-turn row's
own turn, a whole conversation's last reply); a row that does not begin with those ids (the template trims the reply,
strips reasoning, moves special tokens) is *re-rendered*: its differing tail is prefilled again.
"""
from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

from ..inputs.conversations import Conversation
from ..files import atomic_write_bytes
from ..inputs.tokenization import common_prefix


@dataclass(frozen=True)
class Kept:
    """What is regenerated of one input conversation: ``turns`` (system and user messages, in order),
    ``tools``, and why it is skipped instead (``skip``: a reason, for the summary)."""

    turns: list[dict]
    tools: list | None = None
    skip: str | None = None

    @property
    def replies(self) -> int:
        """Replies it will get: one per user turn."""
        return sum(1 for turn in self.turns if turn["role"] == "user")


TOOL_TURNS = "conversations with tool turns (not regenerated: cached tool results are not spliced)"
NO_USER_TURN = "conversations without a user turn"
TOO_LONG = "conversations whose prompt plus --max-new-tokens exceeds --max-seq-len"


def kept(chat: Conversation) -> Kept:
    """The turns to regenerate ``chat`` from: its system and user turns (an empty user turn is dropped,
    as speculators 0.9 drops it)."""
    if any(message["role"] == "tool" or message.get("tool_calls") for message in chat.messages):
        return Kept([], chat.tools, TOOL_TURNS)
    turns = [{"role": m["role"], "content": m["content"]} for m in chat.messages
             if m["role"] in ("system", "user") and m["content"]]
    if not any(turn["role"] == "user" for turn in turns):
        return Kept([], chat.tools, NO_USER_TURN)
    return Kept(turns, chat.tools)


@dataclass
class Regeneration:
    """One conversation being regenerated: :meth:`next_prompt` gives the messages to answer next
    (None once every user turn is answered), :meth:`answered` takes the reply."""

    index: int  # the conversation's place in the input (0-based)
    where: str
    line: int
    kept: Kept
    messages: list[dict] = field(default_factory=list)
    replies: list = field(default_factory=list)  # backend replies (``backends.Reply``), in turn order
    _next: int = 0

    def next_prompt(self) -> list[dict] | None:
        turns = self.kept.turns
        while self._next < len(turns):
            turn = turns[self._next]
            self._next += 1
            self.messages.append(dict(turn))
            if turn["role"] == "user":
                return list(self.messages)
        return None

    def answered(self, reply) -> None:
        self.messages.append({"role": "assistant", "content": reply.text})
        self.replies.append(reply)


@dataclass(frozen=True)
class RowSource:
    """Where a training row's first states come from: reply number ``reply``, whose region holds the
    row's first ``reused`` rows (ids shared and stored); ``rerendered``: the row does not begin with
    the reply's prompt + generated ids."""

    reply: int
    reused: int
    rerendered: bool


def row_source(row: list[int], replies: list) -> RowSource:
    """The reply of ``replies`` (``.prompt``, ``.ids``: prompt + generated; ``.stored``: rows its region
    holds) a row takes its first states from: the latest whose prompt the row begins with. A per-turn
    row (``speculators-0.5``) begins with its own turn's prompt and never with a later one's, which
    holds the reply the row ends with and the next user turn; this holds when the template renders
    the reply otherwise than it was generated too (then a later prompt can share more of the row's
    start than the row's own reply does). A whole-conversation row begins with every prompt: the last
    reply's. Where the row begins with no prompt (a template rendering earlier turns otherwise than
    their prompts did), the reply sharing the most of its start, the earlier on a tie."""
    shared = [common_prefix(row, reply.ids) for reply in replies]
    begun = [number for number, reply in enumerate(replies) if shared[number] >= len(reply.prompt)]
    best = begun[-1] if begun else max(range(len(replies)), key=lambda number: (shared[number], -number))
    reply = replies[best]
    # a row cut short by --max-seq-len within the reply still begins with it
    rerendered = shared[best] < min(len(reply.ids), len(row))
    return RowSource(best, min(shared[best], reply.stored), rerendered)


@dataclass
class Tally:
    """What regeneration did, for the summary line."""

    conversations: int = 0
    replies: int = 0
    generated_tokens: int = 0
    rows: int = 0
    rerendered: int = 0
    in_place: int = 0  # rows prefilled in their reply's region (nothing copied)
    reused: int = 0  # row tokens whose states their reply's region held (copied, or there already)
    one_pass_rows: int = 0  # rows with any such token (the others prefilled again whole)
    streamed: int = 0  # rows whose file was written while their reply was generated (speculators-0.5)
    streamed_rows: int = 0  # of their tokens, those written then (the rest at the end)
    # wall seconds of a run's two parts: until its last reply was in, then until its last rows were handed out
    replying_seconds: float = 0.0
    row_states_seconds: float = 0.0
    skipped: dict = field(default_factory=dict)  # reason -> conversations

    def skip(self, reason: str, count: int = 1) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + count

    def add(self, other: dict) -> None:
        """Add another tally's counts (``dataclasses.asdict`` of it: a Ray replica's, for a batch)."""
        for name, value in other.items():
            if name == "skipped":
                for reason, count in value.items():
                    self.skip(reason, count)
            else:
                setattr(self, name, getattr(self, name) + value)

    def line(self, reused: int, computed_again: int) -> str:
        """``reused``: row tokens whose states the generation computed; ``computed_again``: the others."""
        said = [f"{self.conversations} conversations regenerated ({self.replies} replies, {self.generated_tokens:,} "
                f"tokens generated)", f"{self.rows} rows, {self.rerendered} re-rendered by the chat template, "
                f"{self.in_place} prefilled in their reply's region"
                + (f", {self.streamed} streamed to their files during generation ({self.streamed_rows:,} "
                   f"token rows written then)" if self.streamed else "") + "; "
                f"{self.one_pass_rows} of {self.rows} rows from the generation's own states (one pass), "
                f"{self.rows - self.one_pass_rows} prefilled again whole; "
                f"{reused:,} row tokens from the generation's states, {computed_again:,} computed again"]
        said += [f"{n} skipped: {why}" for why, n in sorted(self.skipped.items())]
        said += [f"replies {self.replying_seconds:.1f} s, then the rows' states {self.row_states_seconds:.1f} s"]
        return "generate: " + ", ".join(said)


# -- regenerated.jsonl: the conversations as regenerated, one line each

REGENERATED = "regenerated.jsonl"
REGENERATED_PARTS = "regenerated.*.jsonl"  # a static shard's own (regenerated.shard-I-of-N.jsonl)
REGENERATED_FILES = "regenerated*.jsonl"  # both


def regenerated_name(tag: str | None) -> str:
    """The file a run appends its conversations to: ``regenerated.jsonl``; a static shard's own
    ``regenerated.<tag>.jsonl`` (no two processes append to one file)."""
    return f"regenerated.{tag}.jsonl" if tag else REGENERATED


def finished_lines(path: Path, finished: Collection[int]) -> list[tuple[int, str]]:
    """(conversation index, line) of ``path``'s lines whose sample files are all finished, in file
    order; a line cut short or without its indices is left out."""
    kept_lines = []
    for line in path.read_text(encoding="utf-8").splitlines() if path.exists() else ():
        try:
            record = json.loads(line)
            index, indices = record["index"], record["sample_indices"]
        except (ValueError, KeyError, TypeError):
            continue
        if set(indices) <= finished:
            kept_lines.append((index, line))
    return kept_lines


def keep_finished_lines(directory: Path, tag: str | None, finished: Collection[int]) -> set[int]:
    """At the start of a run: its file (:func:`regenerated_name`) less the lines of conversations whose
    rows are not all finished (a run that stopped between a line and its files: they are redone). A
    run that is no shard (one process, or a Ray driver: the only writer then) also folds the shards'
    files into ``regenerated.jsonl`` and removes them. Returns the conversations whose finished line
    any of the files holds."""
    finished = set(finished)
    own = directory / regenerated_name(tag)
    parts = [] if tag else shard_files(directory)
    if not parts:
        order_lines(directory, tag, finished)
    else:
        _write(own, merged_lines(directory, finished))
        for part in parts:
            part.unlink(missing_ok=True)
    return {index for path in [directory / REGENERATED, *shard_files(directory)]
            for index, _ in finished_lines(path, finished)}


def order_lines(directory: Path, tag: str | None, finished: Collection[int]) -> None:
    """Rewrite this run's file (:func:`regenerated_name`) as the lines of finished conversations, in
    input order, one per conversation (the one written last), when it is not that already."""
    path = directory / regenerated_name(tag)
    if not path.exists():
        return
    held = path.read_text(encoding="utf-8").splitlines()
    by_index = dict(finished_lines(path, set(finished)))
    ordered = [by_index[index] for index in sorted(by_index)]
    if ordered != held:
        _write(path, ordered)


def merge_shards(directory: Path, finished: Collection[int]) -> None:
    """At a static shard's end: ``regenerated.jsonl`` made of every finished conversation of it and of
    every shard's file (which stay: the other shards may still append to theirs), so the shard that
    ends last leaves the whole set there, as it leaves the format's index listing every shard's files."""
    _write(directory / REGENERATED, merged_lines(directory, set(finished)))


def shard_files(directory: Path) -> list[Path]:
    """The shards' files, oldest change first."""
    return sorted(directory.glob(REGENERATED_PARTS), key=lambda p: (p.stat().st_mtime_ns, p.name))


def merged_lines(directory: Path, finished: set[int]) -> list[str]:
    """Every finished conversation's line of ``regenerated.jsonl`` and the shards' files, in input
    order, one per conversation (one regenerated twice, by runs that stopped before its files were
    all whole: the line of the file changed last)."""
    by_index: dict[int, str] = {}
    for path in [directory / REGENERATED, *shard_files(directory)]:
        by_index.update(finished_lines(path, finished))
    return [by_index[index] for index in sorted(by_index)]


def _write(path: Path, lines: list[str]) -> None:
    atomic_write_bytes(path, "".join(line + "\n" for line in lines).encode("utf-8"))
