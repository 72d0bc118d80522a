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

from ..certify.certifier import Certifier
from ..layer_conventions import SPECULATORS_05
from ..plan.planner import BATCHES_HELD, MemoryCheck, ModelPlan, audit_line, check_memory_here, load_model, plan_model
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
        certifier: what certifies each request's row before its file is written (after :meth:`load`;
            None: rows go uncertified, the load said why).
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
        self.certifier: Certifier | None = None

    def plan(self) -> list[str]:
        self.model_plan, lines = plan_model(self.settings, self.log)
        self.layer_ids = list(self.model_plan.format_layer_ids)
        self.vocab_size = self.model_plan.facts.vocab_size
        self.memory_check = check_memory_here(self.settings, self.model_plan.facts)
        self.plan_lines = [*lines, *self.memory_check.lines, audit_line(self.settings.backend)]
        return self.plan_lines

    def load(self) -> None:
        """Start the backend (vLLM loads the model), then the forward check and the first certificate. Call on the main thread,
        inside ``processes.contained()`` (vLLM's processes die with this one)."""
        loaded = load_model(self.settings, self.model_plan, self.memory_check, log=self.log, batches_held=BATCHES_HELD,
                            held=self._hold)
        self.backend, self.layer_order, self.load_seconds = loaded.backend, loaded.layer_order, loaded.seconds
        self.certifier = Certifier.for_model(self.settings, self.model_plan, self.backend, self.layer_order, self.log)

    def _hold(self, backend) -> None:
        self.backend = backend  # closed by close(), whatever fails from here

    def close(self) -> None:
        backend, self.backend = self.backend, None
        if backend is not None:
            backend.close()
