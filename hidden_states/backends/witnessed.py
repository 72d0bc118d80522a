"""Certified batches on an engine backend (``--backend vllm-engine``): each request asks vLLM for its
logprobs at its last position, and once a batch's states are in, its probes (``certify.witness``: the
rows' first ``p + 1`` tokens, under the batch's cache salt, no region) run; the batch then resolves to
``(layers, Witness)`` per row. Everything here runs on the engine feed's thread."""
from __future__ import annotations

from ..certify.witness import TOP, Witness, first_token_logprobs
from .engine_feed import EngineBatch


def params(region: dict | None = None):
    """A certified request's sampling parameters: one token, greedy (the certificate's ids are the same
    on every run of the same rows), with the engine's logprobs at its last position (and the worker's
    region, for a row whose states are captured)."""
    from vllm import SamplingParams

    return SamplingParams(max_tokens=1, temperature=0.0, logprobs=TOP, **({"extra_args": region} if region else {}))


class ProbeBatch(EngineBatch):
    """The probes of a certified batch ``parent`` whose ``states`` are in."""

    def __init__(self, parent: EngineBatch, states: list):
        self.where = [(row, position) for row, positions in enumerate(probed(parent)) for position in positions]
        super().__init__([parent.ids[row][:position + 1] for row, position in self.where], parent.cache_salt)
        self.parent, self.states = parent, states
        self.future.add_done_callback(self._settle)

    def witnesses(self) -> list[Witness]:
        return witnesses(self.parent, self)

    def _settle(self, future) -> None:
        # let go of the states (and the batch) first: the future keeps this callback, and so this probe,
        # alive; their regions go back to the pool only when the last reference to them does
        parent, states, self.parent, self.states = self.parent, self.states, None, None
        exc = future.exception()
        if exc is not None:
            parent.future.set_exception(exc)
        else:
            parent.future.set_result(list(zip(states, future.result(), strict=True)))


def probed(parent: EngineBatch) -> list[list[int]]:
    """Each row's positions to probe: those asked, and the last of the rows vLLM's prefix cache gave it
    (copied from another request's region: a copy from the wrong place shows there first)."""
    cached = parent.cached or [0] * len(parent.ids)
    return [sorted({*asked, *([first - 1] if 0 < first < len(ids) else [])})
            for asked, first, ids in zip(parent.probes, cached, parent.ids, strict=True)]


def resolve(parent: EngineBatch, states: list, put) -> None:
    """``parent``'s states are in: resolve it now if it probes nothing, else ``put`` its probes into
    the engine; they resolve it."""
    if not any(probed(parent)):
        parent.future.set_result(list(zip(states, witnesses(parent, None), strict=True)))
    else:
        put(ProbeBatch(parent, states))


def finished(probe: ProbeBatch) -> None:
    """Every probe has run: its batch's witnesses, or the error that stops them."""
    try:
        found = probe.witnesses()
    except Exception as exc:  # noqa: BLE001 - the certified batch's caller hears of it
        probe.future.set_exception(exc)
    else:
        probe.future.set_result(found)


def witnesses(parent: EngineBatch, probe: ProbeBatch | None) -> list[Witness]:
    """Each row's witness: its probes' log-probabilities, then its own request's at its last position."""
    found: list[list] = [[] for _ in parent.ids]
    for index, (row, position) in enumerate(probe.where if probe is not None else ()):
        output = probe.finished[index]
        if list(output.prompt_token_ids) != probe.ids[index]:
            raise RuntimeError(f"vLLM's probe of batch position {row} holds other token ids")
        found[row].append((position, *first_token_logprobs(output, row)))
    for row, ids in enumerate(parent.ids):
        found[row].append((len(ids) - 1, *first_token_logprobs(parent.finished[row], row)))
    return [Witness([p for p, _, _ in entries], [i for _, i, _ in entries], [v for _, _, v in entries],
                    tuple(p for p, _, _ in entries[:-1]))  # all but the last came from probes
            for entries in found]
