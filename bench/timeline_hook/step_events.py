"""Per-step GPU timeline of vLLM's engine for bench/steps.py: when and for how long the GPU
runs each step, with no synchronisation inside the timed steps.

Loaded by ``sitecustomize.py`` beside this file when ``BENCH_STEPS_DIR`` is set, in every Python
process of the run. In the process that runs the model (with TP=1, vLLM's engine core): CUDA timing
events at the entry and exit of ``Worker.execute_model`` and ``Worker.sample_tokens``, and, for
``--backend vllm-engine``, one on the capture's copy stream after each step's copies are queued. A
thread waits for each step's last event and writes the step as a JSON line to
``$BENCH_STEPS_DIR/steps-<pid>.jsonl``, GPU times on CLOCK_MONOTONIC (one clock for every process:
the first step is synchronised once to pin a GPU event to it). On a CPU (the dry run) the events are
the CPU times. In the extractor's process: its timed span (the summary's ``seconds``) and each
batch's resolution, to ``parent-<pid>.jsonl``.
"""
from __future__ import annotations

import json
import os
import queue
import threading
import time

class StepEvents:
    def __init__(self, directory: str):
        self._path = os.path.join(directory, f"steps-{os.getpid()}.jsonl")
        self._queue: queue.Queue | None = None  # made with the writer thread, in the process that steps
        self._anchor = None  # (timing event, its CLOCK_MONOTONIC time)
        self._step: dict | None = None
        self._writer_pid = None  # the writer thread runs in this process (a forked engine core starts its own)

    def mark(self, stream=None):
        """A point on the GPU's timeline: an event on ``stream`` (the current one by default), or the
        CPU's time where no GPU runs the model."""
        import torch

        if not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return time.monotonic()
        if self._anchor is None:
            torch.cuda.synchronize()
            anchor = torch.cuda.Event(enable_timing=True)
            anchor.record()
            anchor.synchronize()
            self._anchor = (anchor, time.monotonic())
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    def execute_model(self, wrapped, instance, args, kwargs):
        scheduler_output = kwargs["scheduler_output"] if "scheduler_output" in kwargs else args[0]
        self._finish_step()  # a step whose sampling was not called separately
        step = {"cpu_start": time.monotonic(), "tokens": scheduler_output.total_num_scheduled_tokens,
                "requests": len(scheduler_output.num_scheduled_tokens),
                "new_requests": len(scheduler_output.scheduled_new_reqs), "marks": {"start": self.mark()}}
        try:
            return wrapped(*args, **kwargs)
        finally:
            step["marks"]["executed"] = self.mark()
            copies = getattr(instance, "_vllm_compat_copies", None)  # vllm-engine's copy stream
            if copies is not None and step["tokens"]:
                step["marks"]["copied"] = self.mark(copies)
            step["cpu_executed"] = time.monotonic()
            self._step = step

    def sample_tokens(self, wrapped, instance, args, kwargs):
        step = self._step
        if step is not None:
            step["marks"]["sample_start"] = self.mark()
        try:
            return wrapped(*args, **kwargs)
        finally:
            if step is not None:
                step["marks"]["sampled"] = self.mark()
                step["cpu_sampled"] = time.monotonic()
                self._finish_step()

    def _finish_step(self) -> None:
        step, self._step = self._step, None
        if step is not None and step["tokens"]:
            if self._writer_pid != os.getpid():
                self._writer_pid, self._queue = os.getpid(), queue.Queue()
                self._path = os.path.join(os.path.dirname(self._path), f"steps-{os.getpid()}.jsonl")
                threading.Thread(target=self._write, name="bench-step-events", daemon=True).start()
            self._queue.put(step)

    def _write(self) -> None:
        sink = None  # opened with the first step: only the process that runs the model has a file
        while True:
            step = self._queue.get()
            marks = step.pop("marks")
            gpu = {}
            for name, mark in marks.items():
                if isinstance(mark, float):
                    gpu[name] = mark
                else:
                    mark.synchronize()
                    anchor, at = self._anchor
                    gpu[name] = at + anchor.elapsed_time(mark) / 1000
            sink = sink or open(self._path, "a", buffering=1)
            sink.write(json.dumps({**step, "gpu": gpu}) + "\n")


# what the hooks wrap in the extractor (tests/unit/test_bench_hooks.py checks each still exists)
ENGINE_BACKEND_FINISHED = "VllmEngineBackend.finished"
LIFECYCLE_FINISH = "Lifecycle.finish"


def install(directory: str) -> None:
    import wrapt

    events = StepEvents(directory)
    parent = os.path.join(directory, f"parent-{os.getpid()}.jsonl")

    def note(record: dict) -> None:
        with open(parent, "a") as sink:
            sink.write(json.dumps(record) + "\n")

    def on_gpu_worker(module):
        wrapt.wrap_function_wrapper(module, "Worker.execute_model", events.execute_model)
        if hasattr(module.Worker, "sample_tokens"):
            wrapt.wrap_function_wrapper(module, "Worker.sample_tokens", events.sample_tokens)

    def on_extraction(module):
        def finish(wrapped, instance, args, kwargs):
            try:
                return wrapped(*args, **kwargs)
            finally:
                if instance.started is not None:
                    note({"span": [instance.started, instance.started + instance.summary.seconds],
                          "tokens": instance.summary.tokens})

        wrapt.wrap_function_wrapper(module, LIFECYCLE_FINISH, finish)

    def on_engine_backend(module):
        from hidden_states.backends.witnessed import ProbeBatch

        def finished(wrapped, instance, args, kwargs):
            # the engine is done with a batch: its states resolved ("resolve"), or its probes' witnesses ("probes")
            started = time.monotonic()
            try:
                return wrapped(*args, **kwargs)
            finally:
                kind = "probes" if isinstance(args[0], ProbeBatch) else "resolve"
                note({kind: [started, time.monotonic()], "requests": len(args[0].ids)})

        wrapt.wrap_function_wrapper(module, ENGINE_BACKEND_FINISHED, finished)

    for name, hook in (("vllm.v1.worker.gpu_worker", on_gpu_worker),  # vLLM's CPUWorker inherits both
                       ("hidden_states.run.lifecycle", on_extraction),
                       ("hidden_states.backends.vllm_engine", on_engine_backend)):
        wrapt.register_post_import_hook(hook, name)
