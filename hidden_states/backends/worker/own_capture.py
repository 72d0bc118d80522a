"""``--backend vllm-engine``'s worker extension when speculators 0.3/0.4 is not installed: the
extractor's own capture, streamed into the parent's regions by ``engine_capture.StreamingStates``
as speculators' is (the same regions, row attribution and guards).

speculators' capture replaces the base model's ``forward`` with a copy of its own, which the shim's
adapters keep in step with vLLM's (``embed_input_ids_alias``, ``llama_4_scaling_arg``). This one
replaces nothing: vLLM's own forward runs as vLLM wrote it, so whatever it passes its layers stays
vLLM's on every release. It adds

* a forward hook on each chosen decoder layer, which keeps that layer's output: ``hidden_states +
  residual`` (speculators' convention: layer L is the output of decoder layer L, before the final
  norm), summed in the hook, before the next layer's fused residual add may overwrite the tensors
  the layer returned;
* a wrapper around the decoder stack's ``forward`` that hands the kept outputs, in layer order, to
  ``_store_captured_states`` once the forward has run: one call per forward, as speculators' does.

Only tensor-parallel rank 0 captures (every rank computes the same states); under vLLM's pipeline
parallelism, that of each stage, the layers its stage runs. The worker-side
adapters that concern the model's kernels (``cpu_rotary_head_layout``, ...) act on vLLM's modules,
so on this capture as on speculators'; ``v2_batch_order`` gives ``StreamingStates`` the batch
order under Model Runner V2. Only vLLM's workers import this module (``worker_extension_cls``).
"""
from __future__ import annotations

from vllm_compat.extractor_api import wrap_method

from . import engine_capture
from .engine_capture import StreamingStates, base_model


def layer_output(output):
    """A decoder layer's output in speculators' convention: ``hidden_states + residual`` where the
    layer returns the pair (vLLM's fused-residual layers), else what it returns."""
    if isinstance(output, tuple):
        hidden, residual = output[0], output[1] if len(output) > 1 else None
        return hidden if residual is None else hidden + residual
    return output


def capture_layers(stack, layer_ids: list[int], store) -> None:
    """Hook ``stack`` (a decoder stack: ``layers``, ``forward``) so that each forward calls
    ``store([output of layer L for L in sorted(layer_ids)])`` once it has run."""
    wanted = sorted(set(layer_ids))
    first, end = getattr(stack, "start_layer", 0), getattr(stack, "end_layer", len(stack.layers))
    outside = [layer for layer in wanted if not first <= layer < end]
    if outside:
        raise RuntimeError(f"hidden-states vllm-engine capture: layers {outside} are not among this worker's "
                           f"decoder layers {first}-{end - 1}")
    kept: dict[int, object] = {}

    def keeper(layer_id: int):
        def keep(module, args, output):
            kept[layer_id] = layer_output(output)
        return keep

    for layer_id in wanted:
        stack.layers[layer_id].register_forward_hook(keeper(layer_id))

    def hand_over(wrapped, instance, args, kwargs):
        kept.clear()
        try:
            result = wrapped(*args, **kwargs)
            if len(kept) != len(wanted):
                raise RuntimeError(f"hidden-states vllm-engine capture: the forward ran layers "
                                   f"{sorted(kept)} of {wanted}")
            store([kept[layer_id] for layer_id in wanted])
        finally:
            kept.clear()  # no layer's output outlives its forward
        return result

    wrap_method(stack, "forward", hand_over)


class LayerOutputs:
    """The extractor's own capture (``_setup_hidden_states_capture``, as ``StreamingStates`` calls it)."""

    def _setup_hidden_states_capture(self, layer_ids: list[int]) -> None:
        if engine_capture.tp_rank() != 0:
            return
        capture_layers(base_model(self.model_runner.model), layer_ids, self._store_captured_states)


class OwnStreamingCapture(StreamingStates, LayerOutputs):
    """The own capture, its rows streamed per step."""
