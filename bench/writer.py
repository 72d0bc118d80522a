#!/usr/bin/env python3
"""The extractor's writer alone: how fast it empties its queue, and whether it starves the
extraction loop of Python's GIL while it writes.

    python bench/writer.py --dir /path/on/the/target/disk [--samples 32] [--tokens 2048] \\
        [--hidden 4096] [--layers 4] [--threads 1 2 4] [--formats speculators-0.3 speculators-0.5]

Feeds ``hidden_states.output.writer.BackgroundWriter`` 8B-shaped samples (bf16, ``layers`` x ``tokens`` x
``hidden``, the layers as columns of one ``[tokens, layers, hidden]`` tensor, as vllm-native hands
them over), in each output format: once alone (the main thread waits), once while the main thread
spins a pure-Python loop, the stand-in for a scheduling loop that wants the GIL. ``loop share`` is
that loop's rate during the writes over its rate beside an idle thread: near 100 % means the writer
leaves the GIL to the loop; a writer that held it would pull the share to about 50 % per busy
thread. A writer that gives the GIL up in its writes waits for it back between them: beside the
loop its files take longer.
"""
import argparse
import shutil
import tempfile
import threading
import time
from pathlib import Path


def spin_until(event: threading.Event) -> float:
    """Loop iterations per second until ``event`` is set."""
    count, started = 0, time.perf_counter()
    while not event.is_set():
        count += 1
    return count / (time.perf_counter() - started)


def idle_rate(seconds: float = 1.0) -> float:
    done = threading.Event()
    threading.Timer(seconds, done.set).start()
    return spin_until(done)


def write_all(args, name: str, threads: int, stacked, sample, layers, beside_loop: bool) -> tuple[float, float]:
    """Seconds for the writer to write ``args.samples`` copies of the sample in format ``name``, and
    the spinning loop's rate meanwhile (``beside_loop``; else the main thread only waits)."""
    from hidden_states.output import formats
    from hidden_states.output.writer import BackgroundWriter

    work = Path(tempfile.mkdtemp(prefix="bench-writer-", dir=args.dir))
    try:
        format = formats.create(name, work, layers, log=lambda message: None)
        (work / format.sample_file(0)).parent.mkdir(exist_ok=True)
        record = format.record(sample, [stacked[:, j] for j in range(args.layers)])
        writer = BackgroundWriter(work, threads=threads, format=format)
        done = threading.Event()

        def feed():
            for index in range(args.samples):
                writer.submit(index, record)
            writer.close()
            done.set()

        started = time.perf_counter()
        feeder = threading.Thread(target=feed)
        feeder.start()
        rate = spin_until(done) if beside_loop else 0.0
        feeder.join()
        return time.perf_counter() - started, rate
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", required=True, type=Path, help="a directory on the disk to measure")
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--formats", nargs="+", default=["speculators-0.3", "speculators-0.5"])
    args = parser.parse_args()

    import torch

    from hidden_states.output import formats
    from hidden_states.inputs.streams import Sample

    stacked = torch.randn(args.tokens, args.layers, args.hidden, dtype=torch.bfloat16)
    sample = Sample(0, 1, list(range(args.tokens)), None)
    layers = formats.Layers(list(range(args.layers)), args.layers + 1, args.hidden)
    sample_mb = stacked.numel() * stacked.element_size() / 1e6
    baseline = idle_rate()
    print(f"{args.samples} samples of {sample_mb:.0f} MB ({args.layers} x {args.tokens} x {args.hidden} bf16) "
          f"to {args.dir}\n")
    print("| format | writer threads | alone: ms per file | MB/s | beside the loop: ms per file | MB/s "
          "| tokens/s it sustains | loop share |\n|---|---|---|---|---|---|---|---|")
    megabytes = args.samples * sample_mb
    for name, threads in [(name, threads) for name in args.formats for threads in args.threads]:
        alone, _ = write_all(args, name, threads, stacked, sample, layers, beside_loop=False)
        seconds, rate = write_all(args, name, threads, stacked, sample, layers, beside_loop=True)
        print(f"| {name} | {threads} | {alone / args.samples * 1000:,.0f} | {megabytes / alone:,.0f} "
              f"| {seconds / args.samples * 1000:,.0f} | {megabytes / seconds:,.0f} "
              f"| {args.samples * args.tokens / seconds:,.0f} | {rate / baseline:.0%} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
