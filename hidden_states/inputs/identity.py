"""What an output directory's samples were made from, recorded in ``data_config.json`` before the
first sample and compared by every later run into the directory (``output.OutputDir.prepare``).

Two records:

* ``input``: the input as given (``path``) and resolved, its container, its size in bytes and the
  SHA-256 of its bytes (of a saved dataset directory: of its data files, by name, in order). The
  hash is taken through the handle the stream then reads from (``conversations.open_source``), one
  sequential read before the first sample: a rerun compares bytes, not names, so a file replaced
  under the same name is another input and the same file under another name is the same one;
* ``tokenization``: what turns the input's rows into samples: ``max_seq_len`` (truncation), the
  kind of rows, and for conversations the layout (``--format``'s trainer), the hash of the
  tokenizer's files (its vocabulary and chat template) and what a turn with an unknown role becomes
  (``unknown_roles``: skipped or taken as assistant; ``--strict``, which refuses such a turn, makes
  no sample of one and is not recorded).

A run stopped by a bad row records where (``stopped_at``: the row, and the hash of the rows before
it): the rerun with the input corrected after that point continues the same extraction.

A directory written before these records existed names its input only by ``prepared_data`` (the
resolved path) and ``max_seq_len``; those are compared instead.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from .conversations import open_source
from ..errors import InputError
from ..sizes import human_size

SHORT = 12  # hex digits of a hash shown in messages and status
# A checkpoint's files that decide how text becomes tokens (transformers' tokenizer files).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt")


def tokenizer_hash(model_path: str | Path) -> str:
    """The SHA-256 of the model's tokenizer files (each named, then its bytes), those present."""
    digest = hashlib.sha256()
    for name in TOKENIZER_FILES:
        path = Path(model_path) / name
        if path.is_file():
            digest.update(f"{name}\0{path.stat().st_size}\0".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def input_record(given: str | Path, source) -> dict:
    """The ``input`` record of an opened ``conversations.RecordSource`` with its hash taken."""
    record = {"path": str(given), "resolved": str(Path(given).resolve()), "container": source.container,
              "bytes": source.size, "sha256": source.sha256}
    if source.files:
        record["files"] = list(source.files)
    return record


def tokenization_record(max_seq_len: int, chat=None) -> dict:
    """The ``tokenization`` record: tokenized rows are only truncated; conversations are made rows
    with ``chat`` (a ``tokenization.ChatSettings``)."""
    if chat is None:
        return {"rows": "tokenized", "max_seq_len": max_seq_len}
    return {"rows": "conversations", "max_seq_len": max_seq_len, "layout": chat.layout,
            "tokenizer_sha256": tokenizer_hash(chat.model_path), "unknown_roles": chat.unknown_role_default}


def recorded(config: dict) -> tuple[dict, dict]:
    """The ``input`` and ``tokenization`` records of a ``data_config.json``; for one written before
    they existed, what it has: the resolved path and ``max_seq_len``."""
    source = config.get("input") or {"resolved": config.get("prepared_data")}
    tokenization = config.get("tokenization") or {"max_seq_len": config.get("max_seq_len")}
    return source, tokenization


def describe_input(record: dict) -> str:
    """``/data/a.jsonl (1.2 MB, sha256 0123456789ab)``, or the path alone when that is all there is."""
    name = record.get("resolved") or record.get("path") or "an unknown input"
    if record.get("sha256") is None:
        return f"{name} (content not recorded)"
    return f"{name} ({human_size(record['bytes'] or 0)}, sha256 {record['sha256'][:SHORT]})"


def rows_digest(path: str | Path, before_line: int) -> str:
    """The SHA-256 of the rows of ``path`` before line (or row) ``before_line``, each as canonical
    JSON: what a run that stopped at a bad row there made its samples from, whatever the container."""
    digest = hashlib.sha256()
    source = open_source(path)
    rows = iter(source)
    while True:
        try:
            record = next(rows)
        except StopIteration:
            break
        except InputError:
            if source.line >= before_line:  # the bad row itself (a line that is not JSON): not read
                break
            raise
        if record.line >= before_line:
            break
        digest.update(json.dumps(record.value, sort_keys=True, default=str).encode() + b"\n")
    return digest.hexdigest()


def stop_record(path: str | Path, line: int, where: str) -> dict:
    """The ``stopped_at`` entry of a run's ``input`` record when a bad row at ``line`` stopped it."""
    return {"line": line, "where": where, "rows_sha256": rows_digest(path, line)}


def same_input(was: dict, now: dict) -> bool:
    """Whether the input recorded in ``was`` is the one of ``now``: the same bytes; or, where the
    earlier run stopped at a bad row, the same rows before it (the input corrected after it); or,
    where the earlier run recorded no hash, the same path."""
    if was.get("sha256") is None or now.get("sha256") is None:
        return was.get("resolved") == now.get("resolved")
    if (was["sha256"], was.get("bytes")) == (now["sha256"], now.get("bytes")):
        return True
    stop = was.get("stopped_at")
    return stop is not None and rows_digest(now["path"], stop["line"]) == stop["rows_sha256"]


def tokenization_change(was: dict, now: dict) -> str | None:
    """How two ``tokenization`` records differ (``max_seq_len 2048, this run 1024``), compared on
    the keys the earlier one recorded; None: the same."""
    changed = [f"{key} {was[key]!r}, this run {now.get(key)!r}" for key in sorted(was)
               if was[key] is not None and was[key] != now.get(key)]
    return "; ".join(changed) or None


def difference(previous: dict, now: dict) -> str | None:
    """What makes the extraction recorded in ``previous`` (a ``data_config.json``, its ``format``
    given by name) another one than ``now`` (``model``, ``layer_ids``, ``format``, ``state_dtype``,
    ``generation``: the sampling of ``hidden-states generate``, ``input``, ``tokenization``), said in
    one clause; None when it is the same. A record without a state dtype (written before FP8 states,
    or by ``convert``) holds the model's."""
    for key in ("model", "layer_ids", "format", "state_dtype"):
        was = previous.get(key, "model") if key == "state_dtype" else previous.get(key)
        is_now = now.get(key, "model") if key == "state_dtype" else now[key]
        if was != is_now:
            return f"{key} {was!r}, this run {is_now!r}"
    if previous.get("generation") != now.get("generation"):  # hidden-states generate's sampling (None: extract)
        return f"generation {previous.get('generation')!r}, this run {now.get('generation')!r}"
    was_input, was_tokenization = recorded(previous)
    if not same_input(was_input, now["input"]):
        return f"input {describe_input(was_input)}; this run's {describe_input(now['input'])}"
    change = tokenization_change(was_tokenization, now["tokenization"])
    return f"tokenization: {change}" if change else None


