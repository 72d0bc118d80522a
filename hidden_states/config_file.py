"""``--config FILE``: the flags of ``extract`` and ``plan`` in a TOML file, flags given on the command
line over them.

A key is a flag's long name without the dashes (``batch-size = 8``; ``batch_size`` too); a value is
what the flag takes: a string, a number, a list for ``layer-ids``, true for a switch (``strict =
true``; false leaves it off). The file becomes the flags it stands for, put before the command
line's, so argparse itself lets a later flag win and checks every value as it checks a typed one;
this module refuses, naming the file and the key, what is not such a flag or not such a value.
"""
from __future__ import annotations

import argparse
import tomllib
from pathlib import Path

from .errors import UsageError

FLAG = "--config"


def config_path(argv: list[str]) -> str | None:
    """The ``--config`` given in ``argv`` (``--config F`` or ``--config=F``), if any."""
    for i, arg in enumerate(argv):
        if arg == FLAG and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(FLAG + "="):
            return arg.split("=", 1)[1]
    return None


def flags_from(path: str, parser: argparse.ArgumentParser) -> list[str]:
    """The flags ``path`` stands for, each checked against ``parser`` (the subcommand's)."""
    try:
        table = tomllib.loads(Path(path).read_text())
    except OSError as exc:
        raise UsageError(f"{FLAG} {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"{FLAG} {path}: not TOML ({exc})") from None
    actions = {option: action for action in parser._actions for option in action.option_strings}
    flags: list[str] = []
    for key, value in table.items():
        option = "--" + key.replace("_", "-")
        action = actions.get(option)
        if action is None or option in (FLAG, "--help", "-h"):
            known = sorted(o[2:] for o in actions if o.startswith("--") and o not in (FLAG, "--help"))
            raise UsageError(f"{path}: '{key}' is not a setting (known: {', '.join(known)})")
        flags += _flag(path, key, option, action, value)
    return flags


def _flag(path: str, key: str, option: str, action: argparse.Action, value) -> list[str]:
    """``option`` with ``value`` as the command line would give it, ``value`` checked as argparse would."""
    if action.nargs == 0:  # a switch
        if not isinstance(value, bool):
            raise UsageError(f"{path}: {key} = {value!r}: true or false")
        return [option] if value else []
    values = value if isinstance(value, list) else [value]
    if isinstance(value, list) and action.nargs not in ("+", "*"):
        raise UsageError(f"{path}: {key} = {value!r}: one value, not a list")
    if isinstance(value, (dict, bool)) or any(isinstance(v, (dict, list, bool)) for v in values):
        raise UsageError(f"{path}: {key} = {value!r}: not a value {option} takes")
    texts = [str(v) for v in values]
    for text in texts:
        try:
            checked = action.type(text) if action.type else text
        except (argparse.ArgumentTypeError, ValueError, TypeError) as exc:
            raise UsageError(f"{path}: {key} = {value!r}: {exc}") from None
        if action.choices is not None and checked not in action.choices:
            raise UsageError(f"{path}: {key} = {value!r}: one of {', '.join(map(str, action.choices))}")
    return [option, *texts]
