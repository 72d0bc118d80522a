"""Training samples, streamed (never loaded whole but for a JSON array), each validated where it is read.

The input is any container ``conversations.open_source`` reads (JSONL, a JSON array, Parquet, a
dataset directory saved with ``datasets.Dataset.save_to_disk``), holding one kind of row:

* tokenized: ``{"input_ids": [...], "loss_mask": [...]}`` (``loss_mask`` optional), what
  speculators' preprocessing and ``hidden-states prepare`` produce, taken as they are;
* conversations (ShareGPT ``conversations``, OpenAI ``messages``) or ``text``, tokenized here with
  the model's chat template for the trainer's layout (``tokenization.ChatTokenizer``).

Sample ``i`` is the ``i``-th sample of the source (0-based; with ``--format speculators-0.5`` a
conversation gives one sample per assistant turn); the output format names its file by ``i``
(``data_{i}.pt``), which is what makes a rerun skip finished work.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from . import conversations, identity
from ..errors import InputError
from .tokenization import ChatSettings, ChatTokenizer, count_trained, tokenized_rows


@dataclass(frozen=True)
class Sample:
    index: int
    line: int  # 1-based line in the JSONL file; row + 1 for a dataset directory
    input_ids: list[int]
    loss_mask: list[int] | None

    @property
    def where(self) -> str:
        return f"line {self.line}"


def _int_list(value, what: str, where: str) -> list[int]:
    if hasattr(value, "tolist"):
        value = value.tolist()
    if not isinstance(value, list):
        raise InputError(f"{where}: {what} must be a list of integers, got {type(value).__name__}")
    for position, item in enumerate(value):
        if isinstance(item, bool) or not isinstance(item, int):
            raise InputError(f"{where}: {what}[{position}] is {item!r}, not an integer")
    return value


def validate(record, where: str, index: int, line: int, vocab_size: int | None) -> Sample:
    """A checked :class:`Sample` from one parsed record, or InputError naming ``where``."""
    if not isinstance(record, dict):
        raise InputError(f"{where}: expected a JSON object with 'input_ids', got {type(record).__name__}")
    if "input_ids" not in record:
        raise InputError(f"{where}: no 'input_ids' (keys: {', '.join(sorted(record)) or 'none'})")
    ids = _int_list(record["input_ids"], "input_ids", where)
    if not ids:
        raise InputError(f"{where}: empty sample (input_ids is [])")
    if vocab_size is not None:
        for position, token in enumerate(ids):
            if not 0 <= token < vocab_size:
                raise InputError(f"{where}: input_ids[{position}] = {token} is outside the model's vocabulary "
                                 f"[0, {vocab_size})")
    mask = record.get("loss_mask")
    if mask is not None:
        mask = _int_list(mask, "loss_mask", where)
        if len(mask) != len(ids):
            raise InputError(f"{where}: loss_mask has {len(mask)} entries for {len(ids)} input_ids")
    return Sample(index, line, ids, mask)


class InputStream:
    """The input, opened once and read once, in order, validated as it is read.

    :meth:`peek` reads the first samples ahead (what the preflight checks before the model loads);
    iterating hands them out again, then reads on from where the peek stopped. How many samples the
    input holds is learned while streaming (:meth:`expected_samples`): a container that knows its
    row count says it (exact while every row has made one sample); a JSONL file's count is
    estimated from the bytes read so far, and exact at its end.

    Args:
        path: the input (any container ``conversations.open_source`` reads).
        vocab_size: token ids must be below it (None: not checked).
        chat: how conversations are tokenized; None: only tokenized rows are accepted.
        digest: hash the input's bytes when it is opened (``identity``), before its rows are read.
        keep_records: keep the rows the samples read so far came from, for :meth:`records`.
        tokenizer: the ``ChatTokenizer`` to tokenize conversations with (None: loaded from ``chat``
            at the first conversation).

    Attributes:
        path: the file or dataset directory.
        samples_read: samples read so far (peeked ones included).
        bytes_read: bytes of the JSONL file read so far (0 for a dataset directory).
        tokenizer: the ``ChatTokenizer`` once a conversation was met (its ``counts`` say what it did).
        token_counts: how often each token id of the conversations' samples read so far is trained
            (``tokenization.count_trained``: what ``prepare`` writes to ``token_freq.pt``); finished
            samples a rerun passes over are read, so counted, too.
    """

    def __init__(self, path: str | Path, vocab_size: int | None = None, chat: ChatSettings | None = None,
                 digest: bool = False, keep_records: bool = False, tokenizer: ChatTokenizer | None = None):
        self.path = Path(path)
        self.vocab_size = vocab_size
        self.chat = chat
        self.digest = digest
        self.tokenizer: ChatTokenizer | None = None
        self._given_tokenizer = tokenizer
        self._kept: list[conversations.Record] | None = [] if keep_records else None
        self.samples_read = 0
        self.token_counts: Counter = Counter()
        self._source: conversations.RecordSource | None = None
        self._rows: Iterator[conversations.Record] | None = None  # the source's rows (kept as read, if asked)
        self._ended = False
        self._peeked: list[Sample] = []
        self._reader: Iterator[Sample] | None = None
        self._sample_end = 0  # bytes of a JSONL file up to the end of the last row that made a sample
        self._counted: int | None = None  # the samples a JSONL file of tokenized rows holds, once counted

    @property
    def ended(self) -> bool:
        """Whether every row of the input was read."""
        return self._ended

    @property
    def bytes_read(self) -> int:
        return self._source.bytes_read if self._source is not None else 0

    @property
    def line(self) -> int:
        """The line (or row) read last: where a bad row stopped the stream."""
        return self._source.line if self._source is not None else 0

    def identity(self, max_seq_len: int) -> tuple[dict, dict]:
        """The ``input`` and ``tokenization`` records of this input (``identity``), once opened with
        ``digest``: whether its rows are conversations is known from the first one read."""
        self._open()
        return (identity.input_record(self.path, self._source),
                identity.tokenization_record(max_seq_len, self.chat if self.tokenizer is not None else None))

    def peek(self, count: int) -> list[Sample]:
        """The first ``count`` samples (fewer if the input is shorter), read now and handed out again
        by iteration."""
        reader = self._open()
        while len(self._peeked) < count:
            sample = next(reader, None)
            if sample is None:
                break
            self._peeked.append(sample)
        return list(self._peeked)

    def __iter__(self) -> Iterator[Sample]:
        reader = self._open()
        while self._peeked:
            yield self._peeked.pop(0)
        yield from reader

    def expected_samples(self) -> tuple[int, bool]:
        """(samples in the input, whether that number is exact): exact at the end of the input, and
        for a container that knows its row count while every row has made one sample; else the
        samples read plus the rows (or bytes of a JSONL file) left at the rate of those read."""
        source = self._source
        if self._ended or source is None or not self.samples_read:
            return self.samples_read, self._ended
        if source.rows is not None:
            rows_read = source.line  # a container that knows its row count numbers its rows from 1
            if self.samples_read == rows_read:
                return source.rows, True
            left = max(source.rows - rows_read, 0) * self.samples_read / rows_read
        elif source.size and source.bytes_read:
            left = max(source.size - source.bytes_read, 0) * self.samples_read / source.bytes_read
        else:
            return self.samples_read, False
        return self.samples_read + round(left), False

    def counted_samples(self) -> tuple[int, bool]:
        """:meth:`expected_samples`, exact for a JSONL file of tokenized rows too (one sample a
        non-blank line): its lines not read yet are counted, without parsing them (once; a line
        that would not parse counts as the sample it is meant to be)."""
        total, exact = self.expected_samples()
        source = self._source
        if exact or source is None or source.container != "jsonl" or self.tokenizer is not None \
                or not self.samples_read:
            return total, exact
        if self._counted is None:
            rest = 0
            with open(self.path, "rb") as handle:
                handle.seek(self._sample_end)
                for raw in handle:
                    rest += bool(raw.strip())
            self._counted = self.samples_read + rest
        return self._counted, True

    def first_record(self) -> conversations.Record | None:
        """The input's first row (None: it has none), of a stream made with ``keep_records``."""
        self.peek(1)  # up to the first sample: the first row is read, and kept
        return self._kept[0] if self._kept else None

    def records(self) -> Iterator[conversations.Record]:
        """Every row of the input, from its first, read once: the rows the samples read so far came
        from (kept: the stream was made with ``keep_records``), then the rest from the same handle.
        The stream's samples end where this begins (``generate`` peeks at samples, then reads its
        conversations as rows)."""
        if self._kept is None:
            raise RuntimeError("records() needs an InputStream made with keep_records=True")
        self._open()
        kept, self._kept = self._kept, None
        yield from kept
        yield from self._rows

    def _open(self) -> Iterator[Sample]:
        if self._reader is None:
            self._source = conversations.open_source(self.path, self.digest)
            self._rows = self._keeping(iter(self._source)) if self._kept is not None else iter(self._source)
            self._reader = self._samples(self._source)
        return self._reader

    def _keeping(self, records: Iterator[conversations.Record]) -> Iterator[conversations.Record]:
        for record in records:
            if self._kept is not None:  # until records() takes them over
                self._kept.append(record)
            yield record

    def _tokenizer(self) -> ChatTokenizer:
        if self._given_tokenizer is not None:
            self.tokenizer = self._given_tokenizer
            return self.tokenizer
        if self.chat is None:
            raise InputError(f"{self.path}: conversations, which need the model's tokenizer to become samples "
                             f"(hidden-states prepare or extract tokenize them)")
        self.tokenizer = self.chat.tokenizer()
        return self.tokenizer

    def _samples(self, source: conversations.RecordSource) -> Iterator[Sample]:
        for record, _, ids, mask in tokenized_rows(self._rows, self._tokenizer):
            sample = validate({"input_ids": ids, "loss_mask": mask}, record.where, self.samples_read, record.line,
                              self.vocab_size)
            if self.tokenizer is not None:
                count_trained(self.token_counts, sample.input_ids, sample.loss_mask)
            self.samples_read += 1
            self._sample_end = source.bytes_read
            yield sample
        self._ended = True


def trained_token_counts(chat: ChatSettings, data: str | Path, tokenizer: ChatTokenizer | None = None) -> Counter:
    """How often each token id is trained over the rows of ``data`` (conversations tokenized with
    ``chat``, or ``tokenizer`` where one is loaded already; tokenized rows as they are, every token
    trained without a mask): what ``prepare`` writes to ``token_freq.pt``."""
    counts: Counter = Counter()
    for sample in InputStream(data, chat=chat, tokenizer=tokenizer):
        count_trained(counts, sample.input_ids,
                      sample.loss_mask if sample.loss_mask is not None else [1] * len(sample.input_ids))
    return counts
