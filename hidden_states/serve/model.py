"""The model ``hidden-states serve`` loads once: planned, checked and loaded as ``extract`` does.

The plan is the planner's: ``planner.plan_model`` (the settings' bounds, the model's config, the
layer ids in speculators 0.9's convention, tensor parallelism), the memory check against this host's
devices (``planner.check_memory_here``, with vLLM's CPU KV cache sized from it), and the vllm-compat
audit of the installed vLLM (``planner.audit_line``); then the ``vllm-engine`` backend loads the
model and the forward check self-tests its kernels. There is no input and no output directory: rows
come from clients, states go to files (``serve.state_files``).
"""
from __future__ import annotations

import dataclasses
import os
import time

from .. import backends
from ..forward_check import check_forward
from ..layer_conventions import SPECULATORS_05
from ..plan.planner import MemoryCheck, ModelPlan, audit_line, check_memory_here, plan_model
from ..plan.preflight import CPU_KV_CACHE_ENV
from ..settings import ModelSettings

BACKEND = "vllm-engine"  # states stream from vLLM's own engine into shared memory, from vLLM 0.11
FORMAT = SPECULATORS_05  # speculators 0.9's files: its layer ids, its layout


class ServedModel:
    """The served model: :meth:`plan`, :meth:`load`, then ``backend`` serves; :meth:`close` ends it.

    Args:
        settings: the model's settings (``backend`` and ``format`` are this module's).
        log: one line per message.

    Attributes:
        plan_lines: what the plan found (after :meth:`plan`).
        model_plan: the model, the format and the layers (``planner.ModelPlan``, after :meth:`plan`).
        memory_check: the memory check against this host's devices (after :meth:`plan`).
        layer_ids: the served layers in speculators 0.9's convention (the trainer's ``--target-layer-ids``
            are all but the last).
        layer_order: where each served layer is among those the backend captures.
        vocab_size: the model's vocabulary (a request's ids are checked against it).
        backend: the started backend (after :meth:`load`).
        load_seconds: the model load's time.
    """

    def __init__(self, settings: ModelSettings, log):
        self.settings = dataclasses.replace(settings, backend=BACKEND, format=FORMAT)
        self.log = log
        self.model_plan: ModelPlan | None = None
        self.memory_check: MemoryCheck | None = None
        self.plan_lines: list[str] = []
        self.layer_ids: list[int] = []
        self.layer_order: list[int] = []
        self.vocab_size = 0
        self.backend = None
        self.load_seconds = 0.0

    def plan(self) -> list[str]:
        self.model_plan, lines = plan_model(self.settings, self.log)
        self.layer_ids = list(self.model_plan.format_layer_ids)
        self.vocab_size = self.model_plan.facts.vocab_size
        self.memory_check = check_memory_here(self.settings, self.model_plan.facts)
        self.plan_lines = [*lines, *self.memory_check.lines, audit_line(self.settings.backend)]
        return self.plan_lines

    def load(self) -> None:
        """Start the backend (vLLM loads the model), then the forward check. Call on the main thread,
        inside ``processes.contained()`` (vLLM's processes die with this one)."""
        cpu_kv_cache = self.memory_check.cpu_kv_cache
        if cpu_kv_cache is not None:  # vLLM reads it in this process, as it builds its config
            os.environ.setdefault(CPU_KV_CACHE_ENV, str(cpu_kv_cache))
        backend_settings = self.model_plan.backend_settings(self.settings)
        self.layer_order = self.model_plan.layer_order(backend_settings)
        self.backend = backends.create(self.settings.backend, backend_settings)
        started = time.monotonic()
        self.log(f"starting the {self.settings.backend} backend: vLLM loads the model")
        self.backend.start()
        self.load_seconds = time.monotonic() - started
        self.log(f"model loaded in {self.load_seconds:.0f} s")
        if self.settings.forward_check:
            self.log(check_forward(self.backend, self.vocab_size))
        else:
            self.log("forward check skipped (--skip-forward-check): the kernels' output is not verified")

    def close(self) -> None:
        backend, self.backend = self.backend, None
        if backend is not None:
            backend.close()
