#!/usr/bin/env python3
"""Why the parent's copy out of the shared segment runs at 2 GB/s, on the CPU alone.

    python bench/host_copy.py                          # batch 8 and 32 x 2048 tokens x 4 layers x 4096, bf16
    python bench/host_copy.py --batches 2 --calls 3    # quick

What the parent does in the real run: the worker's reply is 4 layer tensors ``[batch * length,
hidden]`` in a ``/dev/shm`` segment that the parent maps (``vllm_compat.transport``); speculators'
unmodified generator clones every sequence's slice of every layer (``h[offset:offset + n].clone()``),
keeps the clones until ``generate()`` returns, and the extractor's writer holds them until written,
while the next call's clones are made (``--in-flight`` calls held). Here one process plays both
sides (the segment is filled once through one mapping and read through a second, as the parent's).

Each remedy runs in a fresh process (the allocator's settings and torch's THP switch are per
process and read once). Per call: GB/s of the clones and minor page faults (``ru_minflt``) per MiB
cloned; 256 per MiB is one fault per 4 KiB page: every byte lands on a page the kernel must find,
zero and map first.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time

from provenance import provenance

MODES = {  # name -> (environment, what it is)
    "as is": ({}, "glibc's defaults: freed 16 MiB clones go back to the kernel"),
    "keep freed memory": ({"HOST_COPY_KEEP": "1"}, "vllm_compat.transport.keep_freed_host_memory()"),
    "mallopt mmap 32 MiB only": ({"HOST_COPY_MALLOPT": "threshold"}, "M_MMAP_THRESHOLD=32 MiB, trim default"),
    "THP_MEM_ALLOC_ENABLE=1": ({"THP_MEM_ALLOC_ENABLE": "1"}, "torch: 2 MiB-aligned allocations, madvise(MADV_HUGEPAGE)"),
    "segment MAP_POPULATE": ({"HOST_COPY_POPULATE": "1"}, "parent's mapping of the segment prefaulted"),
}


def one_process(batch: int, length: int, hidden: int, layers: int, calls: int, in_flight: int) -> list[dict]:
    import mmap
    import resource
    import tempfile

    import torch

    if os.environ.get("HOST_COPY_THREADS"):
        torch.set_num_threads(int(os.environ["HOST_COPY_THREADS"]))
    if os.environ.get("HOST_COPY_KEEP"):
        from vllm_compat.transport import keep_freed_host_memory

        keep_freed_host_memory()
    if os.environ.get("HOST_COPY_MALLOPT") == "threshold":
        import ctypes

        ctypes.CDLL("libc.so.6").mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD
    rows = batch * length
    layer_bytes = rows * hidden * 2
    size = layer_bytes * layers
    with tempfile.NamedTemporaryFile(dir="/dev/shm", prefix="host-copy-") as handle:
        os.ftruncate(handle.fileno(), size)
        writer = mmap.mmap(handle.fileno(), size)  # the worker's side
        torch.frombuffer(writer, dtype=torch.bfloat16).fill_(1.5)  # every page of the segment exists, as after a D2H copy
        flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if os.environ.get("HOST_COPY_POPULATE") else 0)
        reader = mmap.mmap(handle.fileno(), size, flags=flags)  # the parent's side
        segment = torch.frombuffer(reader, dtype=torch.bfloat16).view(layers, rows, hidden)
        held, results = [], []
        for call in range(calls):
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            start = time.perf_counter()
            clones = [[segment[layer, s * length:(s + 1) * length].clone() for layer in range(layers)]
                      for s in range(batch)]  # what speculators 0.3.0's generator does per request
            seconds = time.perf_counter() - start
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
            results.append({"call": call, "seconds": seconds, "gb_s": size / seconds / 1e9,
                            "faults_per_mib": faults / (size / 2**20)})
            held.append(clones)
            while len(held) > in_flight:  # the writer frees a call's tensors once written
                held.pop(0)
        del segment, held, clones
        reader.close()
        writer.close()
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="8,32")
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--calls", type=int, default=6)
    parser.add_argument("--in-flight", type=int, default=1, help="calls whose clones are still held (the writer)")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--threads", default="default,1", help="torch intra-op threads to try ('default': torch's)")
    parser.add_argument("--jsonl", help="append the raw results here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(one_process(int(args.batches), args.length, args.hidden, args.layers, args.calls, args.in_flight)))
        return 0
    import torch

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads by default, {os.cpu_count()} CPUs, THP "
          f"{open('/sys/kernel/mm/transparent_hugepage/enabled').read().strip()}, "
          f"{args.length} tokens x {args.layers} layers x {args.hidden} bf16 per sequence, "
          f"{args.in_flight} call(s) held while the next is cloned")
    print("| remedy | torch threads | batch | first call GB/s | faults/MiB | steady calls GB/s (median) | faults/MiB |")
    print("|---|---|---|---|---|---|---|")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for name, threads, batch in itertools.product(args.modes.split(","), args.threads.split(","),
                                                  [int(b) for b in args.batches.split(",")]):
        extra = {**MODES[name][0], **({} if threads == "default" else {"HOST_COPY_THREADS": threads})}
        env = {**os.environ, **extra, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
        out = subprocess.run([sys.executable, __file__, "--child", "--batches", str(batch), "--length", str(args.length),
                              "--hidden", str(args.hidden), "--layers", str(args.layers), "--calls", str(args.calls),
                              "--in-flight", str(args.in_flight)], env=env, capture_output=True, text=True)
        if out.returncode:
            print(f"| {name} | {threads} | {batch} | failed: {out.stderr.strip().splitlines()[-1]} |||")
            continue
        calls = json.loads(out.stdout.strip().splitlines()[-1])
        steady = sorted(calls[args.in_flight + 2:], key=lambda c: c["gb_s"])  # once freed calls can be reused
        mid = steady[len(steady) // 2] if steady else calls[-1]
        print(f"| {name} | {threads} | {batch} | {calls[0]['gb_s']:.2f} | {calls[0]['faults_per_mib']:.0f} | "
              f"{mid['gb_s']:.2f} | {mid['faults_per_mib']:.1f} |", flush=True)
        if args.jsonl:
            settings = {**vars(args), "mode": name, "threads": threads, "batch": batch, "environment": extra}
            with open(args.jsonl, "a") as handle:
                handle.write(json.dumps({"bench": "host_copy", "mode": name, "threads": threads, "batch": batch, "length": args.length,
                                         "torch": torch.__version__, "calls": calls,
                                         "provenance": provenance(settings)}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
