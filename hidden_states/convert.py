"""``hidden-states convert SRC DST --to FORMAT``: an existing extraction in the other layout, no model.

Streams one sample at a time from ``SRC`` into the shared writer (``output.BackgroundWriter``: the
temporary name and rename, the ``done.jsonl`` ledger), so a rerun after an interruption resumes
where it stopped and ``DST`` only ever holds whole files. Layer ids are translated
(``layer_conventions``): speculators-0.5 stores each layer once, in ascending order, so a 0.3
extraction listing a layer twice (speculators 0.3's default on a 6-layer model, ``[2, 3, 3, 5]``)
converts to its distinct layers.

Converted to speculators-0.5, an extraction of conversations gets the ``token_freq.pt`` its trainer
reads (speculators 0.9's ``--draft-vocab-size``), which a speculators-0.3 directory does not hold:
the trained tokens of the rows converted, counted as extract counts its rows (:class:`TrainedTokens`),
written once every row is converted. The rows stay as the source's extraction made them (one per
conversation), so the counts are theirs: what the trainer trains on here. They equal a direct
speculators-0.5 extraction's where the two layouts train the same tokens of a conversation (a
template with generation markers); elsewhere that extraction's rows also train what the template
renders after the generation prompt around the reply (the end-of-turn token, Qwen3's empty think
block), and its counts differ as its rows do.

FP8 states (``--state-dtype fp8``) are not converted to speculators-0.3: its trainer has no FP8
reader, and dequantized files would pass FP8's rounding off as the model's states.

``SRC`` must be one whole extraction: its ``data_config.json``, one layout only, and a whole file
for every sample ``0 .. n-1``. Anything else is refused, naming what is wrong; ``SRC`` is only read.
"""
from __future__ import annotations

from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

from . import extras, layer_conventions, run_log
from .output import formats
from .errors import OutputError, UsageError
from .inputs.identity import recorded
from .inputs.streams import Sample
from .output.directory import OutputDir
from .output.writer import BackgroundWriter
from .output.lock import DirectoryLock
from .certify.certificate import Certificate
from .output.names import CONFIG, TOKEN_FREQ, format_name
from .inputs.tokenization import count_trained, save_token_frequencies
from .output.sample_rows import file_tensors
from .files import read_json
from .progress import log_to_stderr

CONVERTIBLE = (layer_conventions.SPECULATORS_03, layer_conventions.SPECULATORS_05)


def read_sample(format_name: str, path: Path) -> tuple[list[int], list[int], list, Certificate | None]:
    """``input_ids``, ``loss_mask``, the per-layer ``[T, hidden]`` states (in the file's layer order)
    and the certificate (None: the row has none) of one sample file of ``format_name``."""
    tensors = file_tensors(format_name, path)
    if format_name == layer_conventions.SPECULATORS_05:
        if "loss_mask" not in tensors:
            raise UsageError(f"{path}: no loss_mask (not written by hidden-states): cannot convert it")
        ids, states = tensors["token_ids"], list(tensors["hidden_states"].unbind(dim=1))
    else:
        ids, states = tensors["input_ids"], list(tensors["hidden_states"])
    return ids.tolist(), tensors["loss_mask"].tolist(), states, Certificate.from_tensors(tensors)


def read_ids(path: Path) -> tuple[list[int], list[int]]:
    """``input_ids`` and ``loss_mask`` of one speculators-0.3 sample file, mapped, its states not read
    (token frequencies are counted only into speculators-0.5, so from a speculators-0.3 source)."""
    import torch

    tensors = torch.load(path, weights_only=True, mmap=True)
    return tensors["input_ids"].tolist(), tensors["loss_mask"].tolist()


class TrainedTokens:
    """How often each token id is trained over the rows of a convert, in the rows' order
    (``tokenization.count_trained``: what an extraction of the same rows straight into the
    destination's layout writes to ``token_freq.pt``).

    Args:
        rows: the kind of rows the source's samples were made from, as its ``data_config.json``
            records it (``tokenization.rows``: ``conversations`` or ``tokenized``); None where it
            records none.
    """

    def __init__(self, rows: str | None):
        self.rows = rows
        self.counts: Counter = Counter()
        self.masked = False  # a row with an untrained token met

    def add(self, ids: list[int], mask: list[int]) -> None:
        count_trained(self.counts, ids, mask)
        self.masked = self.masked or not all(mask)

    @property
    def written(self) -> bool:
        """Whether these are the frequencies of an input of conversations, the only input an
        extraction writes them for. A directory written before ``data_config.json`` recorded the
        kind of rows does not say: its rows are taken for conversations' when one of them leaves a
        token untrained, as every conversation's prompt is (a tokenized input without masks is
        stored all ones; one with masks of its own gets the frequencies of what its rows train,
        which is what the file means)."""
        return self.rows == "conversations" or (self.rows is None and self.masked)


def source_format(src: Path) -> tuple[str, dict]:
    """The layout ``src`` holds (from its ``data_config.json``, checked against its files) and that config."""
    config_file = src / CONFIG
    if not config_file.is_file():
        raise UsageError(f"{src}: no {CONFIG}: not an extraction, or one that never started")
    config = read_json(config_file, UsageError)
    name = format_name(config)
    if name not in CONVERTIBLE:
        raise UsageError(f"{src}: format {name!r} cannot be converted (known: {', '.join(CONVERTIBLE)})")
    present = [other for other in CONVERTIBLE if formats.sample_files(other, src)]
    if len(present) > 1:
        raise UsageError(f"{src} holds samples of both {' and '.join(present)}: a mixed directory; convert from "
                         f"a directory holding one extraction")
    if present and present != [name]:
        raise UsageError(f"{src}: {CONFIG} says {name}, the files are {present[0]}")
    return name, config


def whole_samples(src: Path, name: str) -> dict[int, Path]:
    """Every sample file of ``src``, refusing a source that is cut short or has gaps."""
    layout = formats.create(name, src)
    files = formats.sample_files(name, src)
    if not files:
        raise UsageError(f"{src}: no {name} sample files")
    cut = sorted(index for index, path in files.items() if not layout.ends_whole(path))
    missing = sorted(set(range(max(files) + 1)) - set(files))
    for problem, indices in (("cut short (a crash before they reached the disk?)", cut),
                             ("missing (an unfinished or partial extraction?)", missing)):
        if indices:
            shown = ", ".join(map(str, indices[:10])) + (f" and {len(indices) - 10} more" if len(indices) > 10 else "")
            raise UsageError(f"{src} is incomplete: samples {shown} {problem}; rerun its extraction to finish it, "
                             f"then convert")
    return files


def convert(src: str | Path, dst: str | Path, to: str, log=log_to_stderr) -> int:
    """Convert the extraction in ``src`` to format ``to`` in ``dst``; returns the samples written."""
    src, dst = Path(src), Path(dst)
    if to not in CONVERTIBLE:
        raise UsageError(f"--to {to}: unknown (known: {', '.join(CONVERTIBLE)})")
    if src.resolve() == dst.resolve():
        raise UsageError("SRC and DST are the same directory: convert into another one")
    name, config = source_format(src)
    if name == to:
        raise UsageError(f"{src} is already {to}")
    stored_as = (config.get("format") or {}).get("state_dtype", "model")
    if stored_as not in formats.state_dtypes(to):
        # dequantized, the files would look like the model's states while carrying FP8's error
        raise UsageError(f"{src} holds {stored_as} states, which {to}'s trainer cannot read; dequantizing them would "
                         f"pass FP8's rounding off as the model's states: extract again with --format {to}")
    files = whole_samples(src, name)
    if to == layer_conventions.SPECULATORS_05:  # its index is written last: checked before the first sample
        extras.require("datasets", f"--to {to} (its dataset index, which the trainer reads)")
    # the model may not be here: its depth bounds nothing the source did not already hold
    src_ids = layer_conventions.to_extractor(name, config["layer_ids"], num_layers=max(config["layer_ids"]))
    dst_ids = sorted(set(src_ids))  # what both layouts can hold: each layer once, in the model's order
    order = [src_ids.index(layer) for layer in dst_ids]
    first = read_sample(name, files[0])
    layers = formats.Layers(dst_ids, num_layers=0, hidden_size=int(first[2][0].shape[-1]))  # num_layers: unused here
    layout = formats.create(to, dst, layers, log=log)
    output = OutputDir(layout, layouts=formats.readers(dst))
    dst_layer_ids = layer_conventions.from_extractor(to, dst_ids)
    source, tokenization = recorded(config)
    identity = {"model": config.get("model"), "layer_ids": dst_layer_ids, "input": source,
                "tokenization": tokenization}
    output.create()
    lock = DirectoryLock(dst)  # one run at a time per output directory, as extract's
    taken_over = lock.acquire()
    try:
        if taken_over:
            log(taken_over)
        held = output.check(identity)
        output.claim(identity, {
            **{key: value for key, value in config.items() if key not in ("format", "layer_ids", "layer_convention")},
            "format": layout.describe(), "layer_convention": layer_conventions.meaning(to),
            "converted_from": {"directory": str(src.resolve()), "format": name, "layer_ids": config["layer_ids"],
                               "at": datetime.now(timezone.utc).isoformat(timespec="seconds")}},
                     formats.create(held.format, dst) if held else None)
        run_log.directory_claimed()  # the log file may go there now
        finished = output.finished()
        todo = [index for index in sorted(files) if index not in finished]
        log(f"convert {src} ({name}, layers {config['layer_ids']}) -> {dst} ({to}, layers "
            f"{dst_layer_ids}): {len(files)} samples, {len(files) - len(todo)} already converted, {len(todo)} to go")
        # the destination's trainer reads token frequencies, which a tokenized input never has
        trained = TrainedTokens(tokenization.get("rows")) \
            if output.token_frequencies is not None and tokenization.get("rows") != "tokenized" else None
        writer = BackgroundWriter(dst, max_pending=8, format=layout)
        try:
            for index in sorted(files):
                if index in finished:  # converted already: its trained tokens counted all the same
                    if trained is not None:
                        trained.add(*read_ids(files[index]))
                    continue
                input_ids, loss_mask, states, certificate = read_sample(name, files[index])
                if trained is not None:
                    trained.add(input_ids, loss_mask)
                if len(states) != len(src_ids):
                    raise OutputError(f"{files[index]}: {len(states)} layers, {CONFIG} lists {len(src_ids)}")
                if certificate is not None:  # it travels with the row: its sketch's layers as the row's now lie
                    certificate.sketch = certificate.sketch[:, order]
                writer.submit(index, layout.record(Sample(index, index + 1, input_ids, loss_mask),
                                                   [states[k] for k in order],
                                                   *([certificate.tensors()] if certificate is not None else [])))
        finally:
            writer.close()
            finished.update(writer.stats.lengths)
            output.finish(finished)
        if trained is not None and trained.written and set(files) <= set(finished):
            write_token_frequencies(trained, output.token_frequencies, src / TOKEN_FREQ, log)
        return len(todo)
    finally:
        lock.release()


def write_token_frequencies(trained: TrainedTokens, path: Path, held: Path, log) -> None:
    """``trained``'s counts into ``path``, once every row is converted. ``held``: where a
    speculators-0.3 source written by an older version keeps its own, counted over the same rows;
    one that differs is said (the file written counts the rows converted)."""
    freq = dict(trained.counts)
    if held.is_file():
        import torch

        try:
            same = torch.load(held, weights_only=True) == freq
        except Exception:  # unreadable (cut short, not a dict): not these rows' counts either
            same = False
        if not same:
            log(f"warning: {held} does not hold the trained tokens' frequencies of its rows; {path} holds those "
                f"of the rows converted")
    save_token_frequencies(freq, path)
