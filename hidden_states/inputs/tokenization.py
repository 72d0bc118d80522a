"""Conversations to training rows: the model's chat template, an assistant-only loss mask taken
from the template itself, truncation, and the token frequencies of what is trained.

Two layouts, as the trainers of ``--format`` prepare them (docs/guides/prepare.md compares them):

``speculators-0.3`` (speculators 0.3/0.4, ``load_and_preprocess_dataset``): one row per
conversation, the whole conversation rendered once. The mask is 1 on every assistant turn's reply:

* where the template has generation markers (``{% generation %}``, answered by
  ``apply_chat_template(..., return_assistant_tokens_mask=True)``), the tokens inside them;
* otherwise, for each assistant turn, the span of the render that the turn's content makes: the
  conversation is rendered again with that turn's content replaced by a placeholder; the text the
  template puts before and after the placeholder, matched against the real render from its start and
  from its end, bounds the reply as the template placed it (trimmed, reasoning stripped or kept, as
  the template does); every token overlapping that span is trained. Templates that rewrite earlier
  turns (Qwen3 drops the reasoning of turns before the last user query) are handled because both
  renders are of the whole conversation.

``speculators-0.5`` (speculators >= 0.5, ``prepare-data``): one row per assistant turn (not the
first message), holding the conversation up to and including that turn, rendered as the model sees
it at that turn (earlier turns rewritten as the template rewrites them). The mask starts at the
boundary between the render of the history with the generation prompt and the render with the
turn: where the latter extends the former, else (a generation prompt that pre-fills ``<think>``)
their common start, provided the history's own render is a prefix of the turn's; otherwise the
conversation is skipped (counted). A turn whose prompt alone fills ``max_seq_len`` is skipped.

Truncation keeps the first ``max_seq_len`` tokens of a row (the trainers' right-side truncation); a
row with no trained token is counted, and dropped for speculators-0.5 as its trainer does. ``text``
rows are tokenized as they are (with the tokenizer's special tokens) and trained on every token.
"""
from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from . import conversations
from .conversations import Conversation, Record
from ..errors import InputError, UsageError
from ..files import atomic_write_bytes
from ..layer_conventions import SPECULATORS_03, SPECULATORS_05

GENERATION_MARKER = re.compile(r"{%-?\s*generation\s*-?%}")
# Stands in for a reply's content to find where the template puts it: no whitespace to trim, no
# markup a template reacts to, characters of Unicode's private use area that no text holds.
PLACEHOLDER = "\ue000hidden-states-reply\ue001"
MARKERS, CONTENT_SPANS, TURN_BOUNDARIES = "generation markers", "content spans", "turn boundaries"


@dataclass(frozen=True)
class Row:
    """One training row: token ids and the loss mask (1 = trained), of equal length."""

    input_ids: list[int]
    loss_mask: list[int]


@dataclass
class Counts:
    """What tokenization did to the input, for the summary line.

    Attributes:
        records: conversations and text rows read.
        rows: rows produced.
        truncated: rows cut to ``max_seq_len``.
        unsupervised: rows with no trained token (dropped for speculators-0.5, kept for 0.3 as
            speculators 0.3/0.4 keep them: sample i is then conversation i).
        skipped: conversations or turns skipped, by reason.
        unknown_roles: turns whose role is none of ``conversations.ROLES``, skipped or taken as
            assistant (``unknown_role_policy``).
        unknown_policy: which of the two.
    """

    records: int = 0
    rows: int = 0
    truncated: int = 0
    unsupervised: int = 0
    skipped: Counter = field(default_factory=Counter)
    unknown_roles: int = 0
    unknown_policy: str = conversations.SKIP

    def line(self, max_seq_len: int) -> str:
        said = [f"{self.records} rows read, {self.rows} training rows"]
        if self.unknown_roles:
            done = "skipped" if self.unknown_policy == conversations.SKIP else "taken as assistant"
            said.append(f"{self.unknown_roles} turns with unknown roles {done} (as the format's trainer does; "
                        f"--strict refuses them)")
        if self.truncated:
            said.append(f"{self.truncated} truncated to --max-seq-len {max_seq_len} (the first {max_seq_len} "
                        f"tokens kept)")
        if self.unsupervised:
            said.append(f"{self.unsupervised} with no trained token")
        said += [f"{n} skipped: {why}" for why, n in sorted(self.skipped.items())]
        return ", ".join(said)


@dataclass(frozen=True)
class ChatSettings:
    """How conversations in the input are tokenized: the model whose tokenizer and chat template
    are used, the trainer's layout (``--format``), ``--max-seq-len``."""

    model_path: str
    layout: str
    max_seq_len: int
    trust_remote_code: bool = False
    strict: bool = False

    @property
    def unknown_role_default(self) -> str:
        """What a turn with an unknown role becomes without ``--strict`` (which refuses it): the
        layout's trainer's way (``unknown_role_policy``)."""
        return unknown_role_policy(self.layout)

    def tokenizer(self) -> "ChatTokenizer":
        return ChatTokenizer(load_tokenizer(self.model_path, self.trust_remote_code), self.layout, self.max_seq_len,
                             self.strict)


def unknown_role_policy(layout: str) -> str:
    """What ``layout``'s trainer makes of a turn whose role is none of ``conversations.ROLES``:
    speculators 0.3/0.4 skip it, speculators 0.9 takes it as assistant (``conversations.SKIP``,
    ``conversations.AS_ASSISTANT``; the sources are cited there)."""
    return conversations.SKIP if layout == SPECULATORS_03 else conversations.AS_ASSISTANT


def load_tokenizer(model_path: str, trust_remote_code: bool = False):
    """The model's own tokenizer, from its directory (offline)."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise UsageError("tokenizing conversations needs the 'transformers' package") from None
    try:
        return AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    except Exception as exc:  # transformers raises OSError, ValueError, ... for a directory without one
        raise UsageError(f"--model-path {model_path}: no tokenizer could be loaded ({type(exc).__name__}: "
                         f"{str(exc).splitlines()[0] if str(exc) else 'no message'})") from None


def common_prefix(a, b) -> int:
    """How many first items (characters, token ids) ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def reply_span(full: str, probe: str) -> tuple[int, int] | None:
    """Where a reply sits in ``full``, a conversation's render, given ``probe``, the render with
    that reply's content replaced by ``PLACEHOLDER``: after as much of the text the template puts
    before the placeholder as ``full`` shares, and before as much of the text it puts after it.
    None if the template does not show the reply (no placeholder in ``probe``)."""
    at = probe.find(PLACEHOLDER)
    if at < 0:
        return None
    before, after = probe[:at], probe[at + len(PLACEHOLDER):]
    start = common_prefix(full, before)
    end = min(common_prefix(full[::-1], after[::-1]), len(full) - start)
    return start, len(full) - end


class ChatTokenizer:
    """Tokenizes conversations with the model's chat template for one trainer's layout.

    Args:
        tokenizer: the model's tokenizer (a transformers fast tokenizer: the content-span mask needs
            its offsets).
        layout: ``speculators-0.3`` or ``speculators-0.5`` (``--format``).
        max_seq_len: rows are cut to this many tokens.
        strict: refuse a row longer than ``max_seq_len`` instead (``--strict``), and a turn whose role
            is none of ``conversations.ROLES`` (else ``unknown_role_policy``).

    Attributes:
        method: how masks are computed (``MARKERS``, ``CONTENT_SPANS`` or ``TURN_BOUNDARIES``).
        counts: :class:`Counts` so far.
    """

    def __init__(self, tokenizer, layout: str, max_seq_len: int, strict: bool = False):
        if layout not in (SPECULATORS_03, SPECULATORS_05):
            raise UsageError(f"--format {layout}: conversations are tokenized for speculators-0.3 or speculators-0.5")
        self.tokenizer = tokenizer
        self.layout = layout
        self.per_turn = layout == SPECULATORS_05
        self.max_seq_len = max_seq_len
        self.strict = strict
        self.unknown_roles = conversations.REFUSE if strict else unknown_role_policy(layout)
        self.counts = Counts(unknown_policy=self.unknown_roles)
        self._method: str | None = None

    @property
    def method(self) -> str:
        if self._method is None:
            if self.per_turn:
                self._method = TURN_BOUNDARIES
            else:
                self._method = MARKERS if self._has_markers() else CONTENT_SPANS
        return self._method

    def _has_markers(self) -> bool:
        """Whether the template marks assistant replies for ``return_assistant_tokens_mask``: it
        has a generation block and a one-reply conversation gets a non-empty mask from it."""
        template = self.tokenizer.chat_template
        if not isinstance(template, str) or not GENERATION_MARKER.search(template):
            return False
        probe = self.tokenizer.apply_chat_template([{"role": "assistant", "content": "test"}], tokenize=True,
                                                   return_assistant_tokens_mask=True, return_dict=True)
        return any(probe.get("assistant_masks") or [])

    def rows(self, record: Record, kind: str) -> list[Row]:
        """The training rows of one ``sharegpt``, ``messages`` or ``text`` record (an InputError
        names the record where the template refuses it)."""
        self.counts.records += 1
        if kind == conversations.TEXT:
            ids = self.tokenizer(conversations.text(record))["input_ids"]
            made = [(ids, [1] * len(ids))]
        else:
            chat = conversations.conversation(record, kind, self.unknown_roles)
            self.counts.unknown_roles += chat.unknown_roles
            if getattr(self.tokenizer, "chat_template", None) is None:
                raise InputError(f"{record.where}: a conversation, but the model's tokenizer has no chat template")
            try:
                made = self._boundary_rows(chat) if self.per_turn else [self._whole_row(chat)]
            except InputError:
                raise
            except Exception as exc:  # a template raises whatever its author chose (TemplateError, ...)
                raise InputError(f"{record.where}: the chat template refuses this conversation "
                                 f"({type(exc).__name__}: {exc})") from None
        kept = []
        for ids, mask in made:
            if len(ids) > self.max_seq_len:
                if self.strict:
                    raise InputError(f"{record.where}: {len(ids)} tokens with the chat template, more than "
                                     f"--max-seq-len {self.max_seq_len} (--strict refuses it)")
                self.counts.truncated += 1
                ids, mask = ids[: self.max_seq_len], mask[: self.max_seq_len]
            if not any(mask):
                self.counts.unsupervised += 1
                if self.per_turn:  # speculators >= 0.5 drops such a row; 0.3/0.4 keep it
                    continue
            kept.append(Row(list(ids), list(mask)))
        self.counts.rows += len(kept)
        return kept

    def summary(self) -> str:
        """One line: how the rows were made and what was cut or dropped."""
        return (f"conversations tokenized with the model's chat template for {self.layout} (mask from "
                f"{self.method}): {self.counts.line(self.max_seq_len)}")

    def prompt_ids(self, messages: list[dict], tools=None) -> list[int]:
        """``messages`` rendered with the generation prompt, as ids: what the model answers next."""
        return self._ids(self._render(messages, tools, generation_prompt=True))

    def _render(self, messages: list[dict], tools, generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                  add_generation_prompt=generation_prompt)

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _whole_row(self, chat: Conversation) -> tuple[list[int], list[int]]:
        """speculators-0.3: the conversation in one row, every assistant reply trained."""
        if self.method == MARKERS:
            encoded = self.tokenizer.apply_chat_template(chat.messages, tools=chat.tools, tokenize=True,
                                                         add_generation_prompt=False,
                                                         return_assistant_tokens_mask=True, return_dict=True)
            return list(encoded["input_ids"]), list(encoded["assistant_masks"])
        full = self._render(chat.messages, chat.tools)
        encoded = self.tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
        offsets = encoded["offset_mapping"]
        mask = [0] * len(offsets)
        for number, message in enumerate(chat.messages):
            if message["role"] != "assistant" or not message["content"]:
                continue
            probe = [*chat.messages[:number], {**message, "content": PLACEHOLDER}, *chat.messages[number + 1:]]
            span = reply_span(full, self._render(probe, chat.tools))
            if span is None:
                self.counts.skipped["replies the template does not show (left untrained)"] += 1
                continue
            start, end = span
            for position, (first, last) in enumerate(offsets):
                if last > start and first < end:
                    mask[position] = 1
        return list(encoded["input_ids"]), mask

    def _boundary_rows(self, chat: Conversation) -> list[tuple[list[int], list[int]]]:
        """speculators-0.5: one row per assistant turn, masked from its render boundary."""
        made = []
        messages, limit = chat.messages, self.max_seq_len
        for turn, message in enumerate(messages):
            if message["role"] != "assistant" or turn == 0:
                continue
            prompt = self._ids(self._render(messages[:turn], chat.tools, generation_prompt=True))[:limit]
            if len(prompt) >= limit:
                self.counts.skipped["a turn whose prompt alone fills --max-seq-len"] += 1
                continue
            full = self._ids(self._render(messages[: turn + 1], chat.tools))
            if full[: len(prompt)] == prompt:
                boundary = len(prompt)
            else:  # a generation prompt the reply does not continue (a pre-filled <think>)
                boundary = common_prefix(prompt, full)
                history = self._ids(self._render(messages[:turn], chat.tools))
                if full[: len(history)] != history or boundary < len(history):
                    self.counts.skipped["conversations whose template rewrites the history at a turn"] += 1
                    return []
            made.append((full, [0] * boundary + [1] * (len(full) - boundary)))
        return made


def token_frequencies(rows) -> dict[int, int]:
    """How often each token id is trained (mask 1) over ``rows`` (``input_ids``, ``loss_mask``
    pairs): speculators' ``token_freq.pt``, ids in the order first met (row by row, ascending
    within a row)."""
    counts: Counter = Counter()
    for ids, mask in rows:
        count_trained(counts, ids, mask)
    return dict(counts)


def count_trained(counts: Counter, ids: list[int], mask: list[int]) -> None:
    """Add one row's trained tokens to ``counts`` in :func:`token_frequencies`' order."""
    counts.update(dict(sorted(Counter(t for t, m in zip(ids, mask) if m).items())))


def save_token_frequencies(freq: dict[int, int], path: str | Path) -> None:
    import io

    import torch

    buffer = io.BytesIO()
    torch.save(freq, buffer)
    atomic_write_bytes(Path(path), buffer.getvalue())


def tokenized_rows(source, tokenizer_of) -> Iterator[tuple[Record, str, list[int], list[int] | None]]:
    """(record, kind, input_ids, loss_mask) for every row of ``source`` (a ``RecordSource``),
    conversations tokenized by ``tokenizer_of()`` (called once, at the first conversation).
    ShareGPT, messages and text rows may mix; tokenized rows and conversations may not."""
    first = None
    chat = None
    for record in source:
        kind = conversations.kind_of(record)
        tokenized = kind == conversations.TOKENIZED
        if first is None:
            first = kind
        elif tokenized != (first == conversations.TOKENIZED):
            raise InputError(f"{record.where}: a {kind} row in a file whose first row is {first}: tokenized rows "
                             f"and conversations do not mix in one input")
        if tokenized:
            yield record, kind, record.value.get("input_ids"), record.value.get("loss_mask")
            continue
        if chat is None:
            chat = tokenizer_of()
        for row in chat.rows(record, kind):
            yield record, kind, row.input_ids, row.loss_mask
