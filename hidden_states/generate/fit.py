"""Whether each conversation's prompts fit ``--max-seq-len`` with room for ``--max-new-tokens``,
known before anything is generated.

A turn is answered only if its prompt plus ``--max-new-tokens`` fits ``--max-seq-len``; otherwise its
conversation is skipped (counted; ``--strict`` stops the run). A conversation's first prompt is known
before the run: one that cannot fit certainly fails, and the plan refuses the run, naming the
``--max-seq-len`` that fits (nothing is generated to be thrown away). A later prompt carries the
replies to the turns before it, up to ``--max-new-tokens`` each, which are only known once generated:
such a conversation *may* be skipped; the plan counts them and names the ``--max-seq-len`` that fits
all of them whatever the replies' lengths.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import UsageError
from .regeneration import Kept


@dataclass(frozen=True)
class PromptRoom:
    """One conversation's prompts, as tokens: the first prompt's, and the last prompt's with every
    earlier reply empty (its system and user turns and the template's frame of each reply)."""

    where: str
    replies: int
    first: int
    last_without_replies: int

    def certain_need(self, max_new_tokens: int) -> int:
        """The ``--max-seq-len`` its first turn needs."""
        return self.first + max_new_tokens

    def worst_need(self, max_new_tokens: int) -> int:
        """The ``--max-seq-len`` its last turn needs when every earlier reply is ``max_new_tokens`` long."""
        return self.last_without_replies + self.replies * max_new_tokens


def prompt_room(chat, where: str, what: Kept) -> PromptRoom:
    """``what``'s prompts measured with ``chat`` (a ``tokenization.ChatTokenizer``)."""
    users = [number for number, turn in enumerate(what.turns) if turn["role"] == "user"]
    first = chat.prompt_ids(what.turns[:users[0] + 1], what.tools)
    if len(users) == 1:
        return PromptRoom(where, 1, len(first), len(first))
    last: list[dict] = []
    for number, turn in enumerate(what.turns[:users[-1] + 1]):
        last.append(dict(turn))
        if turn["role"] == "user" and number != users[-1]:
            last.append({"role": "assistant", "content": ""})  # the reply's place: its frame, no words
    return PromptRoom(where, len(users), len(first), len(chat.prompt_ids(last, what.tools)))


@dataclass
class Fit:
    """The prompts of the conversations to regenerate against ``--max-seq-len``/``--max-new-tokens``."""

    max_seq_len: int
    max_new_tokens: int
    rooms: list[PromptRoom] = field(default_factory=list)

    def add(self, room: PromptRoom) -> None:
        self.rooms.append(room)

    def refuse_certain(self) -> None:
        """Refuse (exit 2, one line) when a first prompt plus ``--max-new-tokens`` cannot fit."""
        over = [room for room in self.rooms if room.certain_need(self.max_new_tokens) > self.max_seq_len]
        if not over:
            return
        need = max(room.certain_need(self.max_new_tokens) for room in over)
        longest = max(room.first for room in over)
        more = f" and {len(over) - 1} more" if len(over) > 1 else ""
        raise UsageError(
            f"{over[0].where}{more} ({len(over)} of {len(self.rooms)} conversations): a first prompt (up to {longest} "
            f"tokens) plus --max-new-tokens {self.max_new_tokens} exceeds --max-seq-len {self.max_seq_len}, so it "
            f"could never be answered: --max-seq-len {need} fits them"
            + (f" (or --max-new-tokens {self.max_seq_len - longest})" if longest < self.max_seq_len else "")
            + ", or leave them out of the input")

    def may_skip_line(self) -> str | None:
        """The plan's line on multi-turn conversations whose later turns may not fit (None: all fit)."""
        over = [room for room in self.rooms if room.worst_need(self.max_new_tokens) > self.max_seq_len]
        if not over:
            return None
        need = max(room.worst_need(self.max_new_tokens) for room in self.rooms)
        multi = sum(1 for room in self.rooms if room.replies > 1)
        return (f"multi-turn: {len(over)} of {multi} multi-turn conversations may be skipped after generating (a "
                f"later turn carries the earlier replies, up to --max-new-tokens {self.max_new_tokens} each, and "
                f"must fit --max-seq-len {self.max_seq_len}); --max-seq-len {need} fits all of them")
