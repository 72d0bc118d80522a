"""What a layer id means to each speculators line, and the translation between them.

The extractor counts as speculators 0.3/0.4 do: id ``L`` is the *output of decoder layer L*, before
the final norm (``speculators/data_generation/custom_worker.py:44-52`` in 0.3.0 captures
``hidden_states + residual`` after layer ``L`` runs; its default is ``[2, N // 2, N - 3, N - 1]``,
``vllm_hidden_states_generator.py:97``).

speculators >= 0.5 trains on what vLLM's ``extract_hidden_states`` writes, and vLLM counts the
*state after k decoder layers*: ``_maybe_add_hidden_state`` is called with ``start_layer`` before the
first layer and with ``idx + 1`` after layer ``idx`` (``vllm/model_executor/models/llama.py:428-441``,
``interfaces.py:1601-1611`` in vLLM 0.32.0), so ``k = 0`` is the embeddings and ``k = N`` the last
layer's output before the final norm. Their ``k`` is our ``k - 1``. speculators 0.9.0's trainer
defaults to the auxiliary layers ``[2, N // 2, N - 3]`` (``speculators/models/utils.py:111``) and
takes the file's last layer as the verifier's last state and the others as the fused input
(``train/data.py:325-331``: ``hidden_states[:, :-1]`` and ``hidden_states[:, -1]``),
so the layout's default is those plus ``N``.

Ids are always given in the convention of the format that is written, so the same command means the
same layers to the trainer that reads the files.
"""
from __future__ import annotations

from .errors import UsageError

SPECULATORS_03 = "speculators-0.3"
SPECULATORS_05 = "speculators-0.5"

MEANING = {
    SPECULATORS_03: "id L = the output of decoder layer L (0-based), before the final norm",
    SPECULATORS_05: "id k = the state after k decoder layers (0: the embeddings; N: the last layer's "
                    "output), before the final norm; vLLM's extract_hidden_states convention",
}


def meaning(format_name: str) -> str:
    """What a layer id means in ``format_name`` (a format of its own counts as the extractor does)."""
    return MEANING.get(format_name, MEANING[SPECULATORS_03])


def default_layer_ids(num_layers: int) -> list[int]:
    """speculators 0.3/0.4's own default (``VllmHiddenStatesGenerator``), entry for entry: layers
    2, N/2 and N-3 (what EAGLE-3 fuses) and N-1 (the target's last state). Its trainer takes every
    entry but the last as the fused input and the last as the target, so it needs all four even where
    two coincide (N = 6: [2, 3, 3, 5]); each layer is captured once and written as often as listed."""
    if num_layers < 3:
        raise UsageError(f"the model has {num_layers} layers; speculators' default layer ids need at least 3: "
                         f"pass --layer-ids")
    return [2, num_layers // 2, num_layers - 3, num_layers - 1]


def default_ids(format_name: str, num_layers: int) -> list[int]:
    """The default layer ids of the trainer that reads ``format_name``, in that format's convention."""
    if format_name != SPECULATORS_05:
        return default_layer_ids(num_layers)
    if num_layers < 3:
        raise UsageError(f"the model has {num_layers} layers; speculators' default layer ids need at least 3: "
                         f"pass --layer-ids")
    return sorted({2, num_layers // 2, num_layers - 3, num_layers})


def default_format() -> str:
    """``--format``'s default: what the installed speculators trains on (read from its distribution,
    not imported); speculators-0.5 when none is installed, as the newer releases read that layout."""
    import importlib.metadata

    from packaging.specifiers import SpecifierSet
    from vllm_compat.extractor_api import TRAINER_LAYOUTS

    try:
        installed = importlib.metadata.version("speculators")
    except importlib.metadata.PackageNotFoundError:
        return SPECULATORS_05
    newer = SpecifierSet(TRAINER_LAYOUTS[SPECULATORS_05])
    return SPECULATORS_05 if newer.contains(installed, prereleases=True) else SPECULATORS_03


def to_extractor(format_name: str, ids: list[int], num_layers: int) -> list[int]:
    """``ids`` in ``format_name``'s convention -> the extractor's (speculators 0.3/0.4's)."""
    if format_name != SPECULATORS_05:
        return list(ids)
    outside = [k for k in ids if not 1 <= k <= num_layers]
    if outside:
        embeddings = " (0 is the embeddings, which the extractor does not capture)" if 0 in outside else ""
        raise UsageError(f"--layer-ids: {outside} outside [1, {num_layers}] for --format {SPECULATORS_05}, which "
                         f"counts layers done (the model has {num_layers}){embeddings}")
    duplicates = sorted({k for k in ids if ids.count(k) > 1})
    if duplicates:
        raise UsageError(f"--layer-ids: {duplicates} given more than once")
    return [k - 1 for k in sorted(ids)]


def from_extractor(format_name: str, ids: list[int]) -> list[int]:
    """The extractor's ids -> ``format_name``'s convention."""
    if format_name != SPECULATORS_05:
        return list(ids)
    return [layer + 1 for layer in ids]
