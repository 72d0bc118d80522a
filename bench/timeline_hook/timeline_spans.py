"""Nested wall-clock spans for bench/timeline.py, in the parent and (through sitecustomize.py
beside this file) in the generator's spawned vLLM workers.

Every span records its start and end on CLOCK_MONOTONIC, one clock for every process of the
machine, so the parent's and the workers' spans line up on one timeline; and its self time (its
duration less its children's). Spans are opened and closed on one thread (the parent's main
thread, a worker's busy loop). A worker writes each span as a JSON line to
``$BENCH_TIMELINE_DIR/worker-<pid>.jsonl``; the parent keeps its own in memory.
"""
from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager

ENV_DIR = "BENCH_TIMELINE_DIR"


class Spans:
    def __init__(self, process: str, path: str | None = None):
        self.process = process
        self.path = path
        self.enabled = True
        self.events: list[dict] = []
        self._stack: list[list] = []  # [name, start, children's seconds, info]
        self._sink = None

    def open(self, name: str, info: dict | None = None) -> dict:
        info = {} if info is None else info
        self._stack.append([name, time.monotonic(), 0.0, info])
        return info

    def close(self, name: str) -> None:
        opened, start, children, info = self._stack.pop()
        if opened != name:
            raise RuntimeError(f"timeline: closing {name!r} while {opened!r} is open")
        end = time.monotonic()
        seconds = end - start
        if self._stack:
            self._stack[-1][2] += seconds
        event = {"process": self.process, "pid": os.getpid(), "name": name, "start": start, "end": end,
                 "self": seconds - children, "depth": len(self._stack), **({"info": info} if info else {})}
        self.events.append(event)
        if self.path:
            if self._sink is None:
                self._sink = open(self.path, "a", buffering=1)
            self._sink.write(json.dumps(event) + "\n")

    def open_info(self) -> dict:
        return self._stack[-1][3]

    def is_open(self, name: str) -> bool:
        return bool(self._stack) and self._stack[-1][0] == name

    @contextmanager
    def span(self, name: str, info: dict | None = None):
        info = self.open(name, info)
        try:
            yield info
        finally:
            self.close(name)

    def wrapper(self, name):
        """A wrapt wrapper timing each call as a span; ``name`` is a string or ``f(args, kwargs)``."""

        def timed(wrapped, instance, args, kwargs):
            if not self.enabled:
                return wrapped(*args, **kwargs)
            with self.span(name(args, kwargs) if callable(name) else name):
                return wrapped(*args, **kwargs)

        return timed


WORKER: Spans | None = None  # this worker's spans, set by sitecustomize.py


def set_enabled(worker, enabled: bool) -> bool:
    """Run in each worker through ``collective_rpc`` (vLLM passes the worker first): spans on or off.
    Off, the wrappers call straight through, with no synchronisation: the untimed pass."""
    if WORKER is not None:
        WORKER.enabled = enabled
    return WORKER is not None


def read_worker_events(directory: str) -> list[dict]:
    events = []
    for name in sorted(os.listdir(directory)):
        if name.startswith("worker-") and name.endswith(".jsonl"):
            with open(os.path.join(directory, name)) as handle:
                events.extend(json.loads(line) for line in handle if line.strip())
    return events
