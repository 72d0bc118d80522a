"""A file written whole or not at all: under a temporary name beside it, then renamed into place, so a
reader (a rerun, the trainer) never meets half a file; and an ``OSError`` said as one line."""
from __future__ import annotations

import errno
import json
import os
from pathlib import Path

from .errors import OutputError

TEMP_PREFIX = ".tmp-"


def atomic_write_bytes(path: Path, data: bytes) -> None:
    atomic_write(path, lambda handle: handle.write(data))


def atomic_write(path: Path, write) -> None:
    """``path`` as ``write(handle)`` writes it, whole or not at all (the file there before kept)."""
    temp = path.with_name(f"{TEMP_PREFIX}{path.name}.{os.getpid()}")
    try:
        with temp.open("wb") as handle:
            write(handle)
        os.replace(temp, path)
    except OSError as exc:
        temp.unlink(missing_ok=True)
        raise OutputError(describe_os_error(exc, path)) from None
    except BaseException:
        temp.unlink(missing_ok=True)
        raise


def atomic_write_json(path: Path, value) -> None:
    atomic_write_bytes(path, (json.dumps(value, indent=2, sort_keys=True) + "\n").encode())


def describe_os_error(exc: OSError, path: Path) -> str:
    if exc.errno == errno.ENOSPC:
        return f"{path}: no space left on device"
    return f"{path}: {exc.strerror or exc}"


def read_json(path: Path, error: type[Exception] = OutputError, what: str = "unreadable", hint: str = "") -> dict:
    """A JSON file the extractor reads (a model's config.json, an output's data_config.json); a
    missing or broken one is ``error`` naming the file: ``{path}: {what} ({why}){hint}``."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise error(f"{path}: {what} ({exc}){hint}") from None
