"""``hidden-states prepare``: an input tokenized into a JSONL of training rows and the trained tokens'
frequencies beside it, without loading the model (conversations become rows as ``tokenization``
makes them; tokenized rows pass through checked)."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from .errors import OutputError, UsageError
from .files import TEMP_PREFIX, describe_os_error
from .inputs.streams import InputStream
from .progress import log_to_stderr
from .inputs.tokenization import ChatSettings, Counts, count_trained, save_token_frequencies


def rows_file_counts(path: Path) -> Counter | None:
    """The trained tokens' counts of a JSONL of ``input_ids``/``loss_mask`` rows (a ``prepare``
    output), None when it is not one."""
    counts: Counter = Counter()
    try:
        with path.open() as handle:
            for line in handle:
                if line.strip():
                    row = json.loads(line)
                    count_trained(counts, row["input_ids"], row["loss_mask"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return counts


def check_token_freq_free(token_freq: Path, output: Path, start_over: bool) -> None:
    """Refuse to overwrite a ``token_freq.pt`` that is not ``output``'s (another ``prepare`` into
    the same folder wrote it, beside its own rows): the pair is recognised by content, the file's
    counts being those of the rows ``output`` holds. ``start_over`` replaces it."""
    if start_over or not token_freq.exists():
        return
    held = None
    try:
        import torch

        held = torch.load(token_freq, weights_only=True)
    except Exception:  # torch raises several types for a file that is not a saved dict  # noqa: BLE001
        pass
    ours = rows_file_counts(output) if output.is_file() else None
    if ours is None or held != dict(ours):
        raise OutputError(f"--token-freq {token_freq}: already holds token frequencies that are not those of "
                          f"--output {output}'s rows (another prepare's into this folder?): name another file with "
                          f"--token-freq, or --start-over to replace it")


def prepare(chat: ChatSettings, data: str | Path, output: str | Path, token_freq: str | Path | None = None,
            start_over: bool = False, log=log_to_stderr) -> Counts:
    """``hidden-states prepare``: tokenize ``data`` into ``output`` (JSONL, ``input_ids`` and
    ``loss_mask`` per line) and write the trained tokens' frequencies (``token_freq.pt`` beside
    ``output`` unless ``token_freq`` names another path). No model is loaded; both files are
    written under a temporary name and renamed when whole. Tokenized rows pass through checked.
    A ``token_freq.pt`` another prepare wrote is refused unless ``start_over``
    (:func:`check_token_freq_free`); a file that cannot be written is one ``OutputError``.

    Returns:
        The tokenizer's :class:`Counts` (a tokenized input's: rows only).
    """
    output = Path(output)
    token_freq = Path(token_freq) if token_freq is not None else output.with_name("token_freq.pt")
    if output.is_dir():
        raise UsageError(f"--output {output}: a directory; name the JSONL file to write")
    for flag, path in (("--output", output), ("--token-freq", token_freq)):
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            above = next((p for p in path.parents if p.exists()), None)
            why = f"{above} is a file" if above is not None and not above.is_dir() else \
                describe_os_error(exc, path.parent)
            raise OutputError(f"{flag} {path}: its folder cannot be made ({why})") from None
    check_token_freq_free(token_freq, output, start_over)
    stream = InputStream(data, chat=chat)
    tmp = output.with_name(f"{TEMP_PREFIX}{output.name}")
    freq: Counter = Counter()  # counted as the rows go by: the input is never held whole
    rows = 0
    try:
        with tmp.open("w") as handle:
            for sample in stream:
                mask = sample.loss_mask if sample.loss_mask is not None else [1] * len(sample.input_ids)
                handle.write(json.dumps({"input_ids": sample.input_ids, "loss_mask": mask}) + "\n")
                count_trained(freq, sample.input_ids, mask)
                rows += 1
        tmp.replace(output)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise OutputError(f"--output {describe_os_error(exc, output)}") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    save_token_frequencies(dict(freq), token_freq)
    if stream.tokenizer is not None:
        counts = stream.tokenizer.counts
        log(stream.tokenizer.summary())
    else:
        counts = Counts(rows, rows)
        log(f"tokenized rows checked and copied: {rows}")
    log(f"prepared: {rows} rows in {output}, token frequencies in {token_freq}")
    return counts
