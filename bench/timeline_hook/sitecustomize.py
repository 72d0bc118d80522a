"""Worker-side timing for bench/timeline.py, loaded by every Python process started with this folder
first on PYTHONPATH (bench/timeline.py sets that, and ``BENCH_TIMELINE_DIR``, just before the
generator spawns its vLLM workers). Without ``BENCH_TIMELINE_DIR`` it only hands over to the
sitecustomize it shadows. With ``BENCH_STEPS_DIR`` (bench/steps.py) it installs ``step_events``: CUDA
events per engine step, no synchronisation.

Each wrapper is installed when its module is imported (wrapt's post-import hooks). These hooks are
registered at interpreter start, before vllm_compat's plugin registers its own, so on the same
target ours run first and wrap the original: ``w:cat`` is speculators' own ``_get_captured_states``
(its ``torch.cat``), while ``w:_get_captured_states`` (taken where the worker looks the RPC up) is the
whole call, vllm_compat's regrouping and transport included. GPU spans are bounded by
``torch.cuda.synchronize()``. Spans start disabled; the parent enables them for its timed pass.
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))

# RPCs of speculators' worker extension, reached through WorkerWrapperBase.__getattr__
EXTENSION_RPCS = ("_get_captured_states", "_reset_capture")


def _sync() -> None:
    import torch

    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _install(spans) -> None:
    import wrapt

    def on_gpu_worker(module):
        wrapt.wrap_function_wrapper(module, "Worker.execute_model", spans.wrapper("w:execute_model"))
        wrapt.wrap_function_wrapper(module, "Worker.sample_tokens", spans.wrapper("w:sample_tokens"))

    def on_worker_base(module):
        def timed_lookup(wrapped, instance, args, kwargs):
            value = wrapped(*args, **kwargs)
            name = args[0] if args else kwargs.get("attr")
            if name not in EXTENSION_RPCS or not callable(value):
                return value

            def rpc(*a, **kw):
                if not spans.enabled:
                    return value(*a, **kw)
                with spans.span(f"w:{name}"):
                    return value(*a, **kw)

            return rpc

        wrapt.wrap_function_wrapper(module, "WorkerWrapperBase.__getattr__", timed_lookup)

    def on_executor(module):
        wrapt.wrap_function_wrapper(module, "WorkerProc.enqueue_output", spans.wrapper("w:reply send"))

    def on_custom_worker(module):
        forward = module._patched_forward  # bound onto the base model by _setup_hidden_states_capture

        def timed_forward(self, *args, **kwargs):
            if not spans.enabled:
                return forward(self, *args, **kwargs)
            _sync()  # the step's input preparation ends outside the span
            with spans.span("w:forward") as info:
                out = forward(self, *args, **kwargs)
                _sync()
                positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
                if positions is not None:
                    info["tokens"] = int(positions.shape[-1])
            return out

        module._patched_forward = timed_forward

        def timed_cat(wrapped, instance, args, kwargs):
            if not spans.enabled:
                return wrapped(*args, **kwargs)
            with spans.span("w:cat") as info:
                out = wrapped(*args, **kwargs)
                _sync()
                if out:
                    info["bytes"] = sum(t.numel() * t.element_size() for t in out)
            return out

        wrapt.wrap_function_wrapper(module, "HiddenStatesWorkerExtension._get_captured_states", timed_cat)

    def on_capture_transport(module):
        to_host = module.to_host  # looked up as a module global by the adapter's wrapper

        def timed_to_host(obj):
            if not spans.enabled:
                return to_host(obj)
            _sync()  # the regrouping's GPU work ends outside the span
            with spans.span("w:to_host") as info:
                out = to_host(obj)
                if obj:
                    info["bytes"] = sum(t.numel() * t.element_size() for t in obj)
            return out

        module.to_host = timed_to_host

    def on_transport(module):
        wrapt.wrap_function_wrapper(module._segment, "ensure", spans.wrapper("w:segment ensure"))

    for name, hook in (("vllm.v1.worker.gpu_worker", on_gpu_worker), ("vllm.v1.worker.worker_base", on_worker_base),
                       ("vllm.v1.executor.multiproc_executor", on_executor),
                       ("speculators.data_generation.custom_worker", on_custom_worker),
                       ("vllm_compat.adapters.capture_transport", on_capture_transport),
                       ("vllm_compat.transport", on_transport)):
        wrapt.register_post_import_hook(hook, name)


def _hand_over() -> None:
    """Run the sitecustomize this one shadows (a distribution's, a virtual environment's), if any."""
    path = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is not None and spec.loader is not None and os.path.abspath(spec.origin or "") != os.path.abspath(__file__):
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


def _start() -> None:
    steps = os.environ.get("BENCH_STEPS_DIR")
    if steps:
        import step_events

        step_events.install(steps)
    directory = os.environ.get("BENCH_TIMELINE_DIR")
    if directory:
        import timeline_spans

        timeline_spans.WORKER = timeline_spans.Spans("worker", os.path.join(directory, f"worker-{os.getpid()}.jsonl"))
        timeline_spans.WORKER.enabled = False
        _install(timeline_spans.WORKER)


_start()
_hand_over()
