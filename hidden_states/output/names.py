"""The names of what an output directory holds: its config, ledgers, token frequencies, temporary files."""
from __future__ import annotations

from ..files import TEMP_PREFIX


LEDGER = "done.jsonl"
LEDGERS = "done*.jsonl"  # every writer's ledger (see ledger_name)
CONFIG = "data_config.json"
# The trained tokens' frequencies (speculators 0.9 reads <data-path>/token_freq.pt for
# --draft-vocab-size), written by a run that read every row of an input of conversations, in the
# layouts whose trainer reads it (a format's ``token_frequencies_file``)
TOKEN_FREQ = "token_freq.pt"


def ledger_name(tag: str | None) -> str:
    """The ledger of the writer tagged ``tag`` (None: the single run's ``done.jsonl``)."""
    return f"done.{tag}.jsonl" if tag else LEDGER


def temp_prefix(tag: str | None) -> str:
    """The start of the temporary names a writer tagged ``tag`` uses: a shard sweeps only its own
    leftovers, never the files another shard is writing right now."""
    return f"{TEMP_PREFIX}{tag}." if tag else TEMP_PREFIX


def format_name(config: dict) -> str:
    """The output format a ``data_config.json`` names; a directory written before formats had names
    holds speculators-0.3, the only format then."""
    return (config.get("format") or {}).get("name", "speculators-0.3")
