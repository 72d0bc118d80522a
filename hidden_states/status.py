"""``hidden-states status OUT``: what an output directory holds, across every writer that wrote it
(a single run, static shards, data-parallel replicas). Reads only; removes nothing."""
from __future__ import annotations

import os
from pathlib import Path

from .output import formats
from .errors import InputError
from .inputs.identity import SHORT, describe_input, recorded, same_input
from .inputs.streams import InputStream
from .output.directory import OutputDir
from .output.lock import holder
from .output.names import CONFIG, LEDGERS, format_name
from .files import TEMP_PREFIX, read_json
from .generate.regeneration import REGENERATED_FILES
from .inputs.tokenization import ChatSettings


def _ranges(indices: list[int], shown: int = 8) -> str:
    """``[1, 2, 3, 7]`` -> ``"1-3, 7"``; at most ``shown`` ranges, then how many more."""
    spans: list[list[int]] = []
    for index in indices:
        if spans and index == spans[-1][1] + 1:
            spans[-1][1] = index
        else:
            spans.append([index, index])
    text = ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in spans[:shown])
    return text + (f" and {len(spans) - shown} more ranges" if len(spans) > shown else "")


def status(path: str | Path) -> str:
    directory = Path(path)
    config_path = directory / CONFIG
    config = read_json(config_path, what="not an extraction's output directory")
    # the format's own folder of sample files (speculators-0.5 keeps them in hidden_states/)
    whole, cut_short = OutputDir(formats.create(format_name(config), directory)).sample_files()
    temporary = sum(1 for entry in os.scandir(directory) if entry.name.startswith(TEMP_PREFIX))
    stored_as = (config.get("format") or {}).get("state_dtype", "model")
    lines = [f"{directory}: {len(whole)} sample files whole"
             + (" (FP8 states with per-token scales: train with --hidden-states-backend fp8)"
                if stored_as == "fp8" else "")
             + (f", {len(cut_short)} cut short (redone by a rerun): {_ranges(sorted(cut_short))}" if cut_short else "")
             + (f", {temporary} temporary files (a writer running now, or one that died)" if temporary else "")]
    converted = config.get("converted_from")
    if converted:
        lines.append(f"converted from {converted.get('directory')} ({converted.get('format')}) at {converted.get('at')}")
    running = holder(directory)
    if running:
        lines.append(f"{running} is writing into it now")
    recorded_input, tokenization = recorded(config)
    lines.append(f"made from {describe_input(recorded_input)}, "
                 + ", ".join(f"{key} {str(value)[:SHORT] if key.endswith('sha256') else value}"
                             for key, value in sorted(tokenization.items()) if value is not None)
                 + (f"; the run stopped at {recorded_input['stopped_at']['where']} (a bad row)"
                    if recorded_input.get("stopped_at") else ""))
    source = recorded_input.get("resolved")
    if source and Path(source).exists():
        lines.append(_count(source, config, recorded_input, tokenization, whole))
    elif source:
        lines.append(f"input {source}: not found here, so what is missing is unknown")
    for ledger in sorted(directory.glob(LEDGERS)):
        with ledger.open("rb") as handle:
            count = sum(1 for line in handle if line.strip())
        lines.append(f"  {ledger.name}: {count} files written")
    # generate's conversations as regenerated: a single run's file, each static shard's own
    for regenerated in sorted(directory.glob(REGENERATED_FILES)):
        with regenerated.open("rb") as handle:
            count = sum(1 for line in handle if line.strip())
        lines.append(f"  {regenerated.name}: {count} conversations")
    return "\n".join(lines)


def rows_layout(config: dict, tokenization: dict) -> str:
    """The layout the extraction made its rows in (one per conversation, or one per reply): the one it
    recorded, which ``convert`` keeps (it converts the files, not their rows); for a directory
    recorded before that, the converted source's format, else the directory's own."""
    return (tokenization.get("layout") or (config.get("converted_from") or {}).get("format")
            or format_name(config))


def _count(source: str, config: dict, recorded_input: dict, tokenization: dict, whole: set[int]) -> str:
    """The input's samples and which have no file: counted as the run tokenized them (conversations:
    its model's template, the rows' layout and length from the config), up to a bad row if one stops it."""
    chat = ChatSettings(config["model"], rows_layout(config, tokenization), config["max_seq_len"]) \
        if "model" in config and "max_seq_len" in config else None
    stream = InputStream(source, chat=chat, digest=recorded_input.get("sha256") is not None)
    total, stopped = 0, ""
    try:
        for _ in stream:
            if total == 0 and stream.digest:
                now, _ = stream.identity(config["max_seq_len"])
                if not same_input(recorded_input, now):
                    return (f"input {source}: changed since the extraction (now {describe_input(now)}), so what is "
                            f"missing is unknown")
            total += 1
    except InputError as exc:
        stopped = f" before {exc}, where it stops"
    missing = [index for index in range(total) if index not in whole]
    return f"input {source}: {total} samples{stopped}; " + (
        f"{len(missing)} not finished: {_ranges(missing)}" if missing else "every one finished")
