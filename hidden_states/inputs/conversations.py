"""The input's rows, whatever holds them, and what each row is.

Containers, detected per file (never by the name alone):

* JSONL: one JSON object per line (blank lines skipped, still counted), streamed;
* JSON: one array of objects (the file starts with ``[``), read whole;
* Parquet (the file starts with ``PAR1``), streamed in row groups; needs ``pyarrow``;
* a directory saved with ``datasets.Dataset.save_to_disk``; needs ``datasets``.

Rows, each detected from its keys (tokenized rows and conversations do not mix in one input):

* ``tokenized``: ``{"input_ids": [...], "loss_mask": [...]}`` (what ``inputs.validate`` checks);
* ``sharegpt``: ``{"conversations": [{"from": "human"|"gpt"|"system"|..., "value": ...}]}``;
* ``messages``: OpenAI style ``{"messages": [{"role": ..., "content": ...}], "tools": [...]}``;
* ``text``: ``{"text": "..."}``, plain text trained on every token.

A row of a conversation kind becomes a :class:`Conversation` (roles normalised, reasoning and tool
fields kept) that ``tokenization.ChatTokenizer`` renders with the model's chat template.
Anything else is an ``InputError`` naming the file and line (or row).
"""
from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from .. import extras
from ..errors import InputError

TOKENIZED, SHAREGPT, MESSAGES, TEXT = "tokenized", "sharegpt", "messages", "text"
KEYS = {TOKENIZED: "input_ids", SHAREGPT: "conversations", MESSAGES: "messages", TEXT: "text"}
# Role names of ShareGPT and OpenAI data, and what the chat templates call them.
ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
         "tool": "tool", "function": "tool", "ipython": "tool"}
# What a turn whose role is none of ROLES becomes (real ShareGPT dumps carry "bing", "chatgpt", ...),
# as each format's trainer prepares it: speculators 0.3/0.4 drop the turn with a warning
# (speculators/data_generation/preprocessing.py, _normalize_conversation: "Unknown role ..., skipping
# turn"); speculators 0.9 takes it as an assistant turn (the same function: "Treat unknown roles (e.g.
# model names in on-policy data) as assistant"). REFUSE is --strict's.
SKIP, AS_ASSISTANT, REFUSE = "skip", "assistant", "refuse"
UNKNOWN_ROLE_POLICIES = (SKIP, AS_ASSISTANT, REFUSE)
CHUNK = 1 << 20  # bytes read at a time while an input is hashed


def sha256_of(handles) -> str:
    """The SHA-256 of the bytes of ``handles`` (binary files, each read from its start in chunks)."""
    digest = hashlib.sha256()
    for handle in handles:
        for chunk in iter(lambda: handle.read(CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass(frozen=True)
class Record:
    """One row of the input as read: ``where`` names it in messages (``file:line`` or
    ``file row N``), ``line`` is 1-based (the JSONL line, else the row number + 1)."""

    where: str
    line: int
    value: object


@dataclass(frozen=True)
class Conversation:
    """A conversation ready for a chat template: ``messages`` with ``role`` in system, user,
    assistant, tool and a string ``content``; ``tools`` the row's tool definitions, if any."""

    messages: list[dict]
    tools: list | None = None
    unknown_roles: int = 0  # turns whose role is none of ROLES, skipped or taken as assistant


@dataclass
class RecordSource:
    """The rows of one input, read once, in order.

    Attributes:
        path: the file or directory.
        container: ``jsonl``, ``json``, ``parquet`` or ``dataset``.
        size: bytes of the file (of a directory: of its data files, once hashed).
        rows: how many rows it holds, where the container says so up front (JSONL: None).
        sha256: the hash of its bytes (a directory's: of its data files in order), when asked for
            (``open_source(..., digest=True)``); None otherwise.
        files: a dataset directory's data files, those hashed (names in the directory).
        line: the ``Record.line`` of the row read last (or being read: a line that is not JSON).
        bytes_read: bytes of a JSONL file read so far; of a JSON array or Parquet file, its size's
            share of the rows read (they are read whole or by row group); 0 for a directory.
    """

    path: Path
    container: str
    size: int | None = None
    rows: int | None = None
    bytes_read: int = 0
    sha256: str | None = None
    files: list[str] = field(default_factory=list)
    line: int = 0
    _records: Iterator[Record] | None = field(default=None, repr=False)

    def __iter__(self) -> Iterator[Record]:
        return self._records


def open_source(path: str | Path, digest: bool = False) -> RecordSource:
    """The rows of ``path``, its container detected from its content; InputError naming the file
    when it is none of JSONL, JSON, Parquet or a saved dataset directory. With ``digest``, the
    hash of its bytes first (``sha256``): read in chunks through the handle the rows are then read
    from, a dataset directory's data files one by one."""
    path = Path(path)
    if not path.exists():
        raise InputError(f"{path}: no such file or directory")
    if path.is_dir():
        source = RecordSource(path, "dataset")
        if digest:
            _digest_dataset(source)
        source._records = _dataset_rows(source)
        return source
    try:  # opened once: the container is told from its first bytes, then read from the same handle
        handle = path.open("rb")
    except OSError as exc:
        raise InputError(f"{path}: cannot be read ({exc.strerror})") from None
    head = handle.read(4096)
    handle.seek(0)
    size = os.fstat(handle.fileno()).st_size
    sha256 = None
    if digest:
        sha256 = sha256_of([handle])
        handle.seek(0)
    first = head.lstrip()[:1]
    if head.startswith(b"PAR1"):
        source = RecordSource(path, "parquet", size)
        source._records = _parquet_rows(source, handle)
    elif first == b"[":
        source = RecordSource(path, "json", size)
        source._records = _json_rows(source, handle)
    elif first in (b"{", b""):
        source = RecordSource(path, "jsonl", size)
        source._records = _jsonl_rows(source, handle)
    else:
        handle.close()
        raise InputError(f"{path}: not JSONL, a JSON array, Parquet or a saved dataset directory (it starts with "
                         f"{head[:16]!r})")
    source.sha256 = sha256
    return source


def dataset_files(path: Path) -> list[str]:
    """The data files of a dataset directory saved with ``save_to_disk``: those its ``state.json``
    lists, else every ``*.arrow`` file, by name."""
    try:
        listed = [entry["filename"] for entry in json.loads((path / "state.json").read_text())["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError):
        listed = []
    return listed or sorted(p.name for p in path.glob("*.arrow"))


def _digest_dataset(source: RecordSource) -> None:
    source.files = dataset_files(source.path)
    handles = []
    try:
        for name in source.files:
            handles.append((source.path / name).open("rb"))
        source.size = sum(os.fstat(h.fileno()).st_size for h in handles)
        source.sha256 = sha256_of(handles)
    except OSError as exc:
        raise InputError(f"{source.path}: its data file cannot be read ({exc})") from None
    finally:
        for handle in handles:
            handle.close()


def json_problem(exc: json.JSONDecodeError) -> str:
    """What is wrong, placed in the file's line (the decoder counts the newline at its end as a
    line of its own: "line 2 column 1" meant "the line ends too soon")."""
    line = exc.doc.rstrip("\r\n")
    if exc.pos >= len(line):
        return f"{exc.msg} at the end of the line"
    return f"{exc.msg} at column {exc.pos + 1}"


def _jsonl_rows(source: RecordSource, handle) -> Iterator[Record]:
    with handle:
        for line_number, raw in enumerate(handle, start=1):
            source.bytes_read += len(raw)
            source.line = line_number
            if not raw.strip():
                continue
            where = f"{source.path}:{line_number}"
            try:
                value = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise InputError(f"{where}: not valid JSON ({json_problem(exc)})") from None
            except UnicodeDecodeError as exc:
                raise InputError(f"{where}: not UTF-8 (byte {exc.start + 1} of the line)") from None
            yield Record(where, line_number, value)


def _json_rows(source: RecordSource, handle) -> Iterator[Record]:
    try:
        with handle:
            items = json.loads(handle.read())
    except json.JSONDecodeError as exc:
        raise InputError(f"{source.path}:{exc.lineno}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    except UnicodeDecodeError as exc:
        raise InputError(f"{source.path}: not UTF-8 (byte {exc.start + 1} of the file)") from None
    if not isinstance(items, list):
        raise InputError(f"{source.path}: a JSON file must hold one array of rows, not a {type(items).__name__}")
    source.rows = len(items)
    for row, value in enumerate(items):
        source.bytes_read = source.size * (row + 1) // len(items)  # read whole: its share, for estimates
        source.line = row + 1
        yield Record(f"{source.path} item {row}", row + 1, value)


def _parquet_rows(source: RecordSource, handle) -> Iterator[Record]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        handle.close()
        raise InputError(f"{source.path}: reading Parquet needs the 'pyarrow' package: "
                         f"{extras.install_hint('pyarrow')}") from None
    with handle:
        try:
            parquet = pq.ParquetFile(handle)
        except Exception as exc:  # pyarrow raises ArrowInvalid, OSError, ... for a damaged file
            raise InputError(f"{source.path}: not a readable Parquet file ({type(exc).__name__}: {exc})") from None
        source.rows = parquet.metadata.num_rows
        row = 0
        for batch in parquet.iter_batches(batch_size=256):
            for value in batch.to_pylist():
                row += 1
                source.bytes_read = source.size * row // max(source.rows, 1)  # its share, for estimates
                source.line = row
                yield Record(f"{source.path} row {row - 1}", row, value)


def _dataset_rows(source: RecordSource) -> Iterator[Record]:
    try:
        import datasets
    except ImportError:
        raise InputError(f"{source.path}: reading a saved dataset directory needs the 'datasets' package: "
                         f"{extras.install_hint('datasets')}; or pass a JSONL file instead") from None
    try:
        dataset = datasets.load_from_disk(str(source.path))
    except Exception as exc:  # datasets raises several types for a bad directory
        raise InputError(f"{source.path}: not a dataset saved with save_to_disk ({type(exc).__name__}: {exc})") \
            from None
    if isinstance(dataset, datasets.DatasetDict):
        raise InputError(f"{source.path}: a DatasetDict ({', '.join(dataset)}); point at one split's directory")
    source.rows = len(dataset)
    for row, value in enumerate(dataset):
        source.line = row + 1
        yield Record(f"{source.path} row {row}", row + 1, value)


def kind_of(record: Record) -> str:
    """Which kind of row ``record`` is (``KEYS``), or InputError naming it."""
    value = record.value
    if not isinstance(value, dict):
        raise InputError(f"{record.where}: expected a JSON object, got {type(value).__name__}")
    for kind, key in KEYS.items():
        if value.get(key) is not None:
            return kind
    raise InputError(f"{record.where}: neither tokenized ('input_ids') nor a conversation ('conversations', "
                     f"'messages' or 'text') (keys: {', '.join(sorted(value)) or 'none'})")


def _text(content, where: str) -> str:
    """A turn's content as one string: OpenAI content parts of type text are joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise InputError(f"{where}: a content part of type {kind!r}; only text is supported")
        return "".join(texts)
    raise InputError(f"{where}: content is a {type(content).__name__}, not a string")


def conversation(record: Record, kind: str, unknown_roles: str = REFUSE) -> Conversation:
    """The :class:`Conversation` of a ``sharegpt`` or ``messages`` row.

    A turn's role is ``from`` or ``role`` (``ROLES``: ShareGPT's human/gpt are user/assistant,
    function/ipython turns are tool turns); a turn with another role (a string) is dropped
    (``unknown_roles`` ``SKIP``), taken as an assistant turn (``AS_ASSISTANT``) or refused naming the
    file, line and role (``REFUSE``), and counted in ``Conversation.unknown_roles``; its content
    ``value`` or ``content`` (None: empty);
    reasoning from ``reasoning_content`` or ``thinking`` is passed under both names (templates
    read one or the other); ``tool_calls``, ``tool_call_id`` and ``name`` are kept.
    """
    turns = record.value[KEYS[kind]]
    if not isinstance(turns, list) or not turns:
        raise InputError(f"{record.where}: '{KEYS[kind]}' must be a non-empty list of turns")
    if unknown_roles not in UNKNOWN_ROLE_POLICIES:
        raise ValueError(f"unknown_roles {unknown_roles!r} is none of {', '.join(UNKNOWN_ROLE_POLICIES)}")
    messages, unknown = [], 0
    for number, turn in enumerate(turns):
        where = f"{record.where}: turn {number}"
        if not isinstance(turn, dict):
            raise InputError(f"{where} is a {type(turn).__name__}, not an object")
        role = turn.get("from") or turn.get("role")
        if role not in ROLES:
            if not isinstance(role, str) or unknown_roles == REFUSE:
                strict = " (refused by --strict)" if isinstance(role, str) else ""
                raise InputError(f"{where}: role {role!r} is none of {', '.join(ROLES)}{strict}")
            unknown += 1
            if unknown_roles == SKIP:
                continue
        content = turn.get("value")
        message = {"role": ROLES.get(role, "assistant"),
                   "content": _text(content if content else turn.get("content"), where)}
        reasoning = turn.get("reasoning_content") or turn.get("thinking")
        if reasoning:
            message["reasoning_content"] = message["thinking"] = _text(reasoning, where)
        for key in ("tool_calls", "tool_call_id", "name"):
            if turn.get(key):
                message[key] = turn[key]
        messages.append(message)
    tools = record.value.get("tools")
    if isinstance(tools, str) and tools:
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as exc:
            raise InputError(f"{record.where}: 'tools' is a string but not JSON ({exc.msg})") from None
    if tools is not None and not isinstance(tools, list):
        raise InputError(f"{record.where}: 'tools' must be a list of tool definitions")
    if not messages:
        raise InputError(f"{record.where}: no turn left: every turn's role is none of {', '.join(ROLES)} (skipped, as "
                         f"the format's trainer skips them)")
    return Conversation(messages, tools or None, unknown)


def text(record: Record) -> str:
    """The text of a ``text`` row."""
    value = record.value["text"]
    if not isinstance(value, str) or not value:
        raise InputError(f"{record.where}: 'text' must be a non-empty string")
    return value

