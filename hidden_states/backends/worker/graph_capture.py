"""``--backend vllm-engine --cuda-graphs``'s worker extension: the extractor's own capture, its
copies traced into vLLM's compiled forward (and so into every CUDA graph vLLM captures), streamed
into the parent's regions by ``engine_capture.StreamingStates`` as the eager captures' rows are.

The eager own capture (``own_capture``) hooks the decoder layers after the engine has started: with
vLLM running eager that is enough, every step runs the hooks. With vLLM compiling its forward, the
compiled code is what was traced when vLLM first ran the model (its profiling run, before the
engine reports ready), and vLLM drops the guards that would retrace it: hooks added later never run,
and a CUDA graph replays kernels alone. So here the copies go onto the model as soon as it is
loaded (``Worker.load_model``, before vLLM's first forward compiles it), and they are tensor ops
on persistent buffers (``graph_store.GraphStore``), which the trace keeps:

* a forward hook on each captured decoder layer: its output (``hidden_states + residual``, as the
  eager capture) into that layer's buffer;
* a forward pre-hook on the token embedding: the forward's token ids; one on the first decoder
  layer: its positions (vLLM's decoder layers take them first), into theirs.

After each ``execute_model`` (``_hidden_states_step_ran``) the step's real rows (the first
``num_tokens``: the scheduler's tokens, not the CUDA graph's padding) go to
``_store_captured_states``, as the eager hooks' rows do. The token-id pre-hook counts the forwards
that run it as Python (none once vLLM has compiled), which the run's end reports
(``_hidden_states_graph_report``, ``graph_store.report_line``). The layers to capture reach the workers
before the load through ``LAYERS_ENV`` (the ``collective_rpc`` that sets the eager capture up comes
after the engine has compiled). Only vLLM's workers import this module (``worker_extension_cls``).
"""
from __future__ import annotations

import os

from vllm_compat.extractor_api import wrap_method

from . import engine_capture
from .engine_capture import StreamingStates, base_model
from ..shared.graph_store import LAYERS_ENV, GraphStore, buffer_rows
from .own_capture import layer_output

_LOAD_WRAPPED = False  # Worker.load_model installs the copies (install_at_model_load, once per process)


def layers_from_environment(environ=os.environ) -> list[int]:
    text = environ.get(LAYERS_ENV, "")
    try:
        layers = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        layers = []
    if not layers:
        raise RuntimeError(f"hidden-states vllm-engine graph capture: {LAYERS_ENV}={text!r}: expected the decoder "
                           f"layer ids to capture, comma-separated")
    return layers


def install_copies(stack, store: GraphStore) -> None:
    """Make every forward of ``stack`` (a decoder stack: ``layers``, ``embed_tokens``) write its
    captured layers' outputs, token ids and positions into ``store``'s buffers. Must run before the
    stack is compiled: a compiled forward keeps only what was traced."""
    import torch

    first, end = getattr(stack, "start_layer", 0), getattr(stack, "end_layer", len(stack.layers))
    outside = [layer for layer in store.layer_ids if not first <= layer < end]
    if outside:
        raise RuntimeError(f"hidden-states vllm-engine graph capture: layers {outside} are not among this worker's "
                           f"decoder layers {first}-{end - 1}")
    embedding = getattr(stack, "embed_tokens", None)
    if embedding is None:
        raise RuntimeError(f"hidden-states vllm-engine graph capture: no token embedding ('embed_tokens') in "
                           f"{type(stack).__name__}: the forward's token ids cannot be kept")

    def keeper(index: int):
        def keep(module, args, output):
            store.keep_layer(index, layer_output(output))
        return keep

    def keep_ids(module, args):
        # a forward that runs this as Python (vLLM eager) is counted; the trace of a compiled forward
        # takes the other branch (is_compiling() is a constant True there), so the compiled code has
        # no count: a count above zero says the copies ran as hooks, not inside the compiled forward
        if not torch.compiler.is_compiling():
            store.python_forwards += 1
        store.keep_ids(args[0])

    def keep_positions(module, args, kwargs):
        store.keep_positions(kwargs["positions"] if "positions" in kwargs else args[0])

    for index, layer_id in enumerate(store.layer_ids):
        stack.layers[layer_id].register_forward_hook(keeper(index))
    embedding.register_forward_pre_hook(keep_ids)
    stack.layers[first].register_forward_pre_hook(keep_positions, with_kwargs=True)


def install_at_model_load() -> None:
    """Have every vLLM worker extended with :class:`GraphLayerCopies` install its copies right after
    its model loads (once per process)."""
    global _LOAD_WRAPPED
    from vllm.v1.worker.gpu_worker import Worker  # the CPU worker subclasses it, and loads through it

    if _LOAD_WRAPPED:
        return

    def then_install(wrapped, worker, args, kwargs):
        result = wrapped(*args, **kwargs)
        if isinstance(worker, GraphLayerCopies):
            worker._hidden_states_install_copies()
        return result

    wrap_method(Worker, "load_model", then_install)
    _LOAD_WRAPPED = True


class GraphLayerCopies:
    """The capture half (``_setup_hidden_states_capture``, as ``StreamingStates`` calls it) and the
    step's end, for a forward that vLLM compiles."""

    _hidden_states_ids_from_forward = False  # the store keeps them: no Python may run in the forward
    _hidden_states_graph_store: GraphStore | None = None

    def _hidden_states_install_copies(self) -> None:
        """At model load, before vLLM's first forward: the buffers, and the copies into them."""
        if engine_capture.tp_rank() != 0:
            return
        config = self.vllm_config
        compilation = config.compilation_config
        # the decode graphs' batch sizes, and (vLLM 0.34) the prefill graphs' token sizes
        sizes = [*(compilation.cudagraph_capture_sizes or ()),
                 *(getattr(compilation, "prefill_cudagraph_capture_token_sizes", None) or ())]
        rows = buffer_rows(config.scheduler_config.max_num_batched_tokens, sizes,
                           config.parallel_config.tensor_parallel_size)
        model = self.model_runner.get_model()
        parameter = next(model.parameters())
        store = GraphStore(layers_from_environment(), rows, self.model_config.get_hidden_size(),
                           self.model_config.dtype, parameter.device)
        install_copies(base_model(model), store)
        self._hidden_states_graph_store = store

    def _setup_hidden_states_capture(self, layer_ids: list[int]) -> None:
        if engine_capture.tp_rank() != 0:
            return
        store = self._hidden_states_graph_store
        if store is None:
            raise RuntimeError("hidden-states vllm-engine graph capture: the copies were not installed at model load "
                               "(the worker's load_model ran before this module was imported?)")
        if store.layer_ids != sorted(set(layer_ids)):
            raise RuntimeError(f"hidden-states vllm-engine graph capture: the copies capture layers {store.layer_ids} "
                               f"({LAYERS_ENV}), the run asks for {sorted(set(layer_ids))}")

    def _hidden_states_step_ran(self) -> None:
        """After ``execute_model`` has run the step's forward: its real rows, as the eager capture's."""
        step = self._hidden_states_step
        if step is None:
            return
        num_tokens = sum(step[0].values())
        if not num_tokens:
            return
        layers, self._hidden_states_input_ids, self._hidden_states_positions = \
            self._hidden_states_graph_store.taken(num_tokens, clone=self._hidden_states_copies is not None)
        self._store_captured_states(layers)

    def _hidden_states_graph_report(self) -> dict | None:
        """The run so far, for its end (``graph_store.report_line``): the steps whose rows were taken,
        and the forwards that ran the copies as Python (None: not the capturing rank)."""
        store = self._hidden_states_graph_store
        if engine_capture.tp_rank() != 0 or store is None:
            return None
        return {"steps": store.steps, "python_forwards": store.python_forwards}


class GraphStreamingCapture(GraphLayerCopies, StreamingStates):
    """The own capture inside vLLM's compiled forward and CUDA graphs, its rows streamed per step
    (``GraphLayerCopies`` first: its step end and its token ids replace ``StreamingStates``' eager ones)."""


if os.environ.get(LAYERS_ENV):  # a vLLM worker, which imports this module as its worker_extension_cls
    install_at_model_load()
